"""Chapter 14: a script that starts processes without `if __name__ == "__main__":` fails at once
with one error that names the fix, instead of hanging (every spawned process runs the script
again). Each script runs in a fresh interpreter with a time limit, as a user would run it."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minivllm.executor.main_guard import MAIN_GUARD_ERROR, _guarded

pytestmark = [pytest.mark.ch14, pytest.mark.floors]
LIMIT = 240  # seconds: importing torch and minivllm on a busy machine; a hang takes for ever
BOOTSTRAP = "An attempt has been made to start a new process"  # multiprocessing's own message


def run_script(folder: Path, source: str) -> subprocess.CompletedProcess:
    script = folder / "script.py"
    script.write_text(textwrap.dedent(source))
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, str(script)], check=False, cwd=folder, capture_output=True, text=True,
                          timeout=LIMIT, env=environment)


@pytest.mark.parametrize("setting", ["data_parallel_size=2", pytest.param("tensor_parallel_size=2", marks=pytest.mark.slow),
                                     pytest.param("multiprocess=True", marks=pytest.mark.slow)])
def test_an_unguarded_script_fails_at_once_naming_the_fix(tmp_path, setting):
    result = run_script(tmp_path, f"""
        from minivllm import LLM
        llm = LLM({setting}, num_kv_blocks=64)
        print("engine built")
    """)
    assert result.returncode != 0
    assert "engine built" not in result.stdout
    assert MAIN_GUARD_ERROR in result.stderr, result.stderr[-2000:]
    assert BOOTSTRAP not in result.stderr  # no child was started at all


def test_a_main_called_outside_the_guard_is_refused_too(tmp_path):
    result = run_script(tmp_path, """
        from minivllm import LLM

        def main():
            return LLM(data_parallel_size=2, num_kv_blocks=64)

        main()
    """)
    assert result.returncode != 0 and MAIN_GUARD_ERROR in result.stderr, result.stderr[-2000:]


@pytest.mark.slow
def test_the_guarded_script_runs(tmp_path):
    result = run_script(tmp_path, """
        from minivllm import LLM, SamplingParams

        def main():
            llm = LLM(data_parallel_size=2, num_kv_blocks=64)
            out = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
            llm.shutdown()
            print("tokens", len(out[0].outputs[0].token_ids))

        if __name__ == "__main__":
            main()
    """)
    assert result.returncode == 0 and "tokens 3" in result.stdout, result.stderr[-2000:]


def test_the_guard_is_read_from_the_syntax_tree(tmp_path):
    script = tmp_path / "s.py"
    source = ("import x\nx.start()\nif '__main__' == __name__:\n    try:\n        x.start()\n"
              "    finally:\n        pass\nelse:\n    x.start()\nif __name__ != '__main__':\n    x.start()\n")
    script.write_text(source)
    code = compile(source, str(script), "exec", dont_inherit=True)
    assert [_guarded(str(script), code, line) for line in (2, 5, 9, 11)] == [False, True, False, False]
    script.write_text("\n\n" + source)  # edited since it was loaded: its lines may have moved, so no refusal
    assert _guarded(str(script), code, 2)
