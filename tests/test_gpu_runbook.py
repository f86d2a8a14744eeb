"""The GPU runbook on a CPU: its dry run goes through every part with the tiny checkpoint, so that
the one command a GPU run depends on cannot rot where CI has no GPU; and a part that overruns
its limit is killed and reported while the next part runs."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

# A maintainer's check, not a classroom one: the runbook runs chapters 8 to 12, so no chapter's
# marker selects it (a student in chapter 9 would meet chapter 11's stubs in it).

ROOT = Path(__file__).resolve().parents[1]
RUNBOOK = ROOT / "benchmarks" / "gpu_runbook.py"


def runbook(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(RUNBOOK), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def load_runbook():
    spec = importlib.util.spec_from_file_location("gpu_runbook", RUNBOOK)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_runbook"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_dry_run_goes_through_every_part(tiny_checkpoint, tmp_path):
    out, archive = tmp_path / "run", tmp_path / "run.tar.gz"
    done = runbook("--out", str(out), "--device", "cpu", "--model", str(tiny_checkpoint), "--archive", str(archive),
                   timeout=280)
    summary = json.loads((out / "runbook.json").read_text())
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert [p["part"] for p in summary["parts"]] == list(range(1, 10))
    for part in summary["parts"]:
        assert part["status"] == "ok", part
        assert "results" not in part["summary"], part  # its headline numbers were read back
        assert (out / part["log"]).stat().st_size > 0
    assert {"python", "torch", "triton", "transformers", "device", "tree"} <= summary["machine"].keys()
    figures = {p.stem for p in (out / "figures").glob("*.png")}
    assert {"09_step_timeline", "09_roofline", "11_shared_prefix", "10_chapter_latency_vs_concurrency",
            "ladder", "12_verify_cost"} <= figures
    results = {p.stem for p in (out / "benchmarks" / "results").glob("*.json")}
    assert {"gpu_smoke_cpu", "08_triton_kernel_cpu_check", "09_cuda_graphs_cpu", "09_roofline_cpu",
            "11_prefix_caching_cpu", "10_serving_chapter_cpu", "tour_cpu_tiny", "12_speculative_decoding_cpu"} <= results
    with tarfile.open(archive) as packed:
        names = packed.getnames()
    assert "run/runbook.json" in names and "run/figures/09_roofline.png" in names


def test_a_part_that_overruns_is_killed_and_the_next_one_runs(tmp_path):
    out = tmp_path / "run"
    done = runbook("--out", str(out), "--device", "cpu", "--parts", "1,8", "--limit-scale", "0.001", timeout=120)
    assert done.returncode == 1
    parts = json.loads((out / "runbook.json").read_text())["parts"]
    assert [(p["part"], p["status"].split(" after")[0]) for p in parts] == [(1, "timed out"), (8, "timed out")]
    assert all(p["seconds"] < 15 for p in parts)  # killed at once: the limits were 0.08 and 0.17 s


def test_parts_are_refused_unless_known_and_once():
    runbook_module = load_runbook()
    assert [p.number for p in runbook_module.parse_parts("6,1,3")] == [1, 3, 6]
    for bad in ("0", "10", "1,1", "one", ""):
        with pytest.raises(Exception, match="part"):
            runbook_module.parse_parts(bad)


def test_the_serving_part_says_what_it_lacks(tmp_path, monkeypatch):
    """Without FastAPI & co. and without wheels to install them from, the reason is reported."""
    runbook_module = load_runbook()
    monkeypatch.setattr(runbook_module, "SERVING_MODULES", ("fastapi", "no_such_module_minivllm"))
    status, path = runbook_module.serving_packages(tmp_path / "no_wheels", tmp_path / "wheels.log")
    assert path is None and "no_such_module_minivllm" in status and "fetch_wheels" in status
    monkeypatch.setattr(runbook_module, "SERVING_MODULES", ("json",))
    assert runbook_module.serving_packages(tmp_path, tmp_path / "wheels.log") == ("installed already", None)
