"""Loaded at start-up by every Python process that has this folder on PYTHONPATH (tools/
trace_exercises.py puts it there): with MINIVLLM_TRACE_OUT set, it wraps each registered
exercise function when its module is first imported and appends "chapter qualname" to that file
the first time the process calls it. Wrapping at import costs nothing per call, so checks that
start servers and core processes run at their usual speed, and the processes they start are
traced too (they inherit PYTHONPATH)."""
import functools
import importlib.abc
import importlib.machinery
import os
import sys

OUT = os.environ.get("MINIVLLM_TRACE_OUT")


def _wrap(module, entries):
    for qualname, chapter in entries:
        owner, name = module, qualname
        if "." in qualname:
            class_name, name = qualname.split(".")
            owner = getattr(module, class_name)
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        called = []

        @functools.wraps(original)
        def traced(*args, _original=original, _called=called, _line=f"{chapter} {qualname}\n", **kwargs):
            if not _called:
                _called.append(True)
                with open(OUT, "a") as out:
                    out.write(_line)
            return _original(*args, **kwargs)

        setattr(owner, name, traced)


class _WrapOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, modules):
        self.modules = modules  # module name -> [(qualname, chapter)]

    def find_spec(self, name, path, target=None):
        if name not in self.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module, _execute=execute, _entries=self.modules[name]):
            _execute(module)
            _wrap(module, _entries)

        spec.loader.exec_module = exec_module
        return spec


if OUT:
    modules = {}
    for line in os.environ["MINIVLLM_TRACE_TARGETS"].split(";"):
        module, qualname, chapter = line.split()
        modules.setdefault(module, []).append((qualname, chapter))
    sys.meta_path.insert(0, _WrapOnImport(modules))
