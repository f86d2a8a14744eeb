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
import json
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
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


# Triton builds its own library (tl.sum, tl.max, tl.cdiv, ...) when it is imported, so every way into
# the interpreter must choose before then: Triton 3.2 to 3.9 alike, interpreted kernels on a library
# built for the GPU stop inside the interpreter with "Cannot call @triton.jit'd outside of the scope of
# a kernel". These checks run in fresh processes without TRITON_INTERPRET, as a user's would start.
def fresh_process_environment() -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return env


def run_fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, env=fresh_process_environment(),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.floors
def test_asking_for_the_interpreter_after_triton_was_imported_says_what_to_set_and_before_what():
    done = run_fresh("import triton\nfrom minivllm.triton_support import use_interpreter\nuse_interpreter()")
    assert done.returncode != 0, "use_interpreter() accepted a Triton already imported without the interpreter"
    assert "RuntimeError" in done.stderr and "TRITON_INTERPRET=1 before anything imports Triton" in done.stderr, \
        done.stderr[-2000:]


@pytest.mark.floors
@pytest.mark.parametrize("module", ["minivllm.attention.triton_kernels", "minivllm.fused.kernels"])
def test_kernels_interpreted_over_a_triton_imported_without_it_refuse_on_import(module):
    """What a script or notebook does when it sets the variable too late: the error names the fix,
    instead of an InterpreterError from the first kernel launch."""
    done = run_fresh(f"import os, triton\nos.environ['TRITON_INTERPRET'] = '1'\nimport {module}")
    assert done.returncode != 0, f"{module} imported interpreted kernels over a library compiled for the GPU"
    assert "RuntimeError: TRITON_INTERPRET=1 was set after Triton was imported" in done.stderr, done.stderr[-2000:]


@pytest.mark.floors
@pytest.mark.slow  # about 30 s of CPU (the interpreter), more on a busy machine
def test_the_tour_interprets_its_triton_stage_on_a_cpu_without_being_told(tiny_checkpoint, tmp_path):
    """The README's main job as a user runs it: loading the model imports Triton (through torch's
    compiler), so the tour must choose the interpreter before it loads anything."""
    done = subprocess.run([sys.executable, "-m", "minivllm.entrypoints.cli", "tour", "--model", str(tiny_checkpoint),
                           "--workload", "tiny", "--requests", "2", "--check", "2", "--stages", "triton", "--no-peers",
                           "--device", "cpu"], check=False, cwd=tmp_path, env=fresh_process_environment(),
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "benchmarks/results/tour_cpu_tiny.json").read_text())["rows"]
    assert [(row["name"], row["agrees"]) for row in rows] == [("triton", "✓")]
