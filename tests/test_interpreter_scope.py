"""Triton's interpreter stays in the processes that choose it (conftest.INTERPRETER).

Triton decides when a kernel is defined, its own library included, whether it is compiled for
the GPU or run by the CPU interpreter (TRITON_INTERPRET=1). The interpreter checks of chapters
8 and 9 used to set the variable when pytest imported their modules, so in a full run on a GPU
machine every later test, the GPU checks too, got interpreted kernels (and bfloat16 refused).
Now a process interprets or compiles, chosen once before Triton is imported, and the checks of
the other kind run in a process of their own.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import INTERPRETER, INTERPRETER_CHECKS, wants_interpreter

pytest.importorskip("triton")
pytestmark = pytest.mark.ch08

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path", INTERPRETER_CHECKS)
def test_importing_the_interpreter_checks_leaves_the_environment_alone(path, monkeypatch):
    """What pytest does at collection, before any test runs: import the module."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # and put back whatever was there
    spec = importlib.util.spec_from_file_location(f"collected_{Path(path).stem}", ROOT / path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert "TRITON_INTERPRET" not in os.environ, f"importing {path} sets TRITON_INTERPRET for every later test"


def test_a_process_interprets_only_without_a_gpu_or_when_asked():
    assert wants_interpreter(cuda_available=False, environ={})
    assert not wants_interpreter(cuda_available=True, environ={})
    assert wants_interpreter(cuda_available=True, environ={"TRITON_INTERPRET": "1"})
    assert not wants_interpreter(cuda_available=True, environ={"TRITON_INTERPRET": "0"})


def test_the_kernels_of_this_process_are_the_kind_it_chose():
    """Whichever test imported them first: interpreted here only if this process interprets."""
    for name in ("minivllm.attention.triton_kernels", "minivllm.fused.kernels"):
        assert importlib.import_module(name).INTERPRETED == INTERPRETER, name


@pytest.mark.floors
@pytest.mark.skipif(INTERPRETER, reason="this process interprets: the interpreter checks run in it")
def test_the_interpreter_checks_pass_in_a_process_of_their_own():
    """On a GPU machine this process compiles kernels; the interpreter checks run next door."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *INTERPRETER_CHECKS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
