"""Processes started from a script: the `if __name__ == "__main__":` guard, checked before anything starts.

minivllm starts its processes (core processes, data-parallel copies, tensor-parallel ranks) with
multiprocessing's "spawn": a fresh interpreter, since fork would copy this process's threads and
CUDA state. A spawned process first runs the parent's main script again (as module `__mp_main__`)
to find what it was handed, and only then reads the rest of what the parent sends it. A script
that builds `LLM(data_parallel_size=2)` outside the guard builds it again in every child, which
then fails or exits before reading the rest; the parent, still writing that rest (the tokenizer,
perhaps the weights: more than a pipe holds), waits for ever.

So every place that starts processes calls `refuse_unguarded_start()` first, in the caller's
thread: it finds the line of the main script that is running (the stack frame of the script's top
level) and asks the script's syntax tree whether that line sits under `if __name__ == "__main__":`.
If not, it raises MAIN_GUARD_ERROR before any process exists. (Code the script runs through exec()
has no file to read; it is not checked.)
"""
from __future__ import annotations

import ast
import os
import sys
from types import CodeType

MAIN_GUARD_ERROR = (
    'minivllm starts its processes with "spawn", and each new process first runs your script again; this '
    "script creates the engine outside `if __name__ == \"__main__\":`, so every new process would create "
    "another one. Put the code that creates and uses the LLM (or AsyncLLM) under "
    "`if __name__ == \"__main__\":`, for example in a main() that the guard calls.")


def refuse_unguarded_start() -> None:
    """Call before starting any process, in the caller's thread (the check reads its stack).
    Raises RuntimeError(MAIN_GUARD_ERROR) when the main script reached here from a line outside
    its main guard, and a spawned process would therefore run that line again."""
    script = _script_spawn_reruns()
    if script is None:
        return
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and _same_file(frame.f_code.co_filename, script)):
        frame = frame.f_back
    if frame is not None and not _guarded(script, frame.f_code, frame.f_lineno):
        raise RuntimeError(MAIN_GUARD_ERROR)


def _script_spawn_reruns() -> str | None:
    """The file a spawned child runs again before its target, by multiprocessing's own rule
    (spawn.get_preparation_data / _fixup_main_*): `python script.py` and `python -m pkg.mod` are
    re-run; a package's __main__, a REPL, a notebook or `python -c` are not."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None and (name == "__main__" or name.endswith(".__main__")):
        return None
    path = getattr(main, "__file__", None)
    if path is None or not path.endswith(".py") or not os.path.isfile(path):
        return None
    return path


def _same_file(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


def _guarded(script: str, running: CodeType, line: int) -> bool:
    """Whether `line` of `script` lies inside an `if __name__ == "__main__":` block (at any depth).
    `running` is the script's code as it was loaded: if the file has changed since (edited while
    it runs), its lines may have moved, and the check gives the benefit of the doubt."""
    with open(script, encoding="utf-8") as file:
        tree = ast.parse(file.read(), script)
    loaded = compile(tree, script, "exec", dont_inherit=True)
    if (loaded.co_code, list(loaded.co_lines())) != (running.co_code, list(running.co_lines())):
        return True
    return any(isinstance(node, ast.If) and _is_main_test(node.test)
               and node.body[0].lineno <= line <= node.body[-1].end_lineno for node in ast.walk(tree))


def _is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))
