"""The GPU runbook on a CPU: its dry run goes through every part with the tiny checkpoint, so that
the one command a GPU run depends on cannot rot where CI has no GPU; a part killed at its limit
still reports the rows it had saved; the budget stops parts that no longer fit."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import time
import zipfile
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


@pytest.mark.floors
@pytest.mark.slow
@pytest.mark.timeout(800)
def test_the_dry_run_goes_through_every_part(tiny_checkpoint, tmp_path):
    out, archive = tmp_path / "run", tmp_path / "run.tar.gz"
    done = runbook("--out", str(out), "--device", "cpu", "--model", str(tiny_checkpoint), "--archive", str(archive),
                   timeout=780)  # 13 parts; measured 503 s for 12 of them on 2 cores under load 6-9
    summary = json.loads((out / "runbook.json").read_text())
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert [p["name"] for p in summary["parts"]] == [p.name for p in load_runbook().PARTS]
    for part in summary["parts"]:
        assert part["status"] == "ok", part
        assert "results" not in part["summary"] and "complete" not in part["summary"], part  # read back, finished
        assert (out / part["log"]).stat().st_size > 0
    assert {"python", "torch", "triton", "transformers", "device", "tree"} <= summary["machine"].keys()
    figures = {p.stem for p in (out / "figures").glob("*.png")}
    assert {"09_step_timeline", "09_roofline", "11_shared_prefix", "15_latency_vs_users_dry_run", "ladder",
            "14_copies_on_one_device_dry_run",
            "12_verify_graphs_cpu", "16_overlap"} <= figures
    results = {p.stem for p in (out / "benchmarks" / "results").glob("*.json")}
    assert {"gpu_smoke_cpu", "08_triton_kernel_cpu_check", "09_cuda_graphs_cpu", "09_roofline_cpu",
            "11_prefix_caching_cpu", "15_serving_cpu", "tour_cpu_tiny", "12_speculative_decoding_runbook_cpu",
            "16_async_scheduling_cpu", "14_data_parallel_cpu"} <= results
    for name, servers in [("15_serving_cpu", {"one process (ch10)", "core process (ch15)"}),
                          ("14_data_parallel_cpu", {"one core (ch15)", "two copies (ch14)"})]:
        serving = json.loads((out / "benchmarks" / "results" / f"{name}.json").read_text())
        assert set(serving["runs"]) == servers
        for levels in serving["runs"].values():  # at least 4 requests per user, all answered
            assert all(level["requests"] >= 4 * level["concurrency"] and not level["failed"] for level in levels)
    with tarfile.open(archive) as packed:
        names = packed.getnames()
    assert "run/runbook.json" in names and "run/figures/09_roofline.png" in names


def test_a_part_killed_at_its_limit_still_reports_the_rows_it_saved(tmp_path):
    """A part whose script saves a row, then hangs: it is killed with its whole process group at
    its limit, and its summary is read from what it saved, marked incomplete."""
    rb = load_runbook()
    child = tmp_path / "child.pid"
    code = textwrap.dedent(f"""
        import json, pathlib, subprocess, sys, time
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # e.g. a server it started
        pathlib.Path({str(child)!r}).write_text(str(helper.pid))
        path = pathlib.Path("benchmarks/results/rows.json")
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({{"rows": [{{"level": 1, "tok/s": 10}}], "complete": False}}))
        time.sleep(600)
    """)

    def summarize(run):
        payload = rb.results(run, "rows")
        return {"levels": [row["level"] for row in payload["rows"]]} | rb.completeness(payload)

    part = rb.Part("hangs", 3, "saves one row, then hangs", summarize, command=lambda run: ["-c", code])
    run = rb.Run("cpu", [], tmp_path, 3.0, time.time() + 3.0)
    start = time.perf_counter()
    row = rb.run_part(part, 1, run, None)
    assert time.perf_counter() - start < 20
    assert row["status"] == "timed out after 3 s"
    assert row["summary"] == {"levels": [1], "complete": False}
    status = Path(f"/proc/{child.read_text()}/status")  # the helper went with the part's process group
    for _ in range(50):
        if not status.exists() or "zombie" in status.read_text():  # gone, or dead and not yet reaped
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the part's helper process outlived it")


@pytest.mark.floors
def test_the_budget_stops_the_parts_that_no_longer_fit(tmp_path):
    out = tmp_path / "run"
    done = runbook("--out", str(out), "--device", "cpu", "--parts", "smoke,tour", "--budget", "3", timeout=120)
    assert done.returncode == 1
    summary = json.loads((out / "runbook.json").read_text())
    assert [(p["name"], p["status"]) for p in summary["parts"]] == [("smoke", "not run: the budget was spent"),
                                                                    ("tour", "not run: the budget was spent")]


def test_cpu_parts_run_torch_on_one_thread():
    """On a busy 2-core machine torch's two threads wait for each other at every operator: a
    tiny model's decode step measured 486 ms with two threads and 9 ms with one (load average
    4-5). The dry run's parts get one thread; GPU parts keep torch's choice."""
    rb = load_runbook()
    assert rb.part_environment("cpu", None)["OMP_NUM_THREADS"] == "1"
    assert rb.part_environment("cuda", None).get("OMP_NUM_THREADS") == os.environ.get("OMP_NUM_THREADS")


def test_parts_are_chosen_by_name_or_number_and_run_in_priority_order():
    rb = load_runbook()
    names = [p.name for p in rb.PARTS]
    assert names[:4] == ["smoke", "gpu_checks", "roofline", "serving"] and names[-1] == "prefix_caching"
    assert [p.name for p in rb.parse_parts("tour,1,roofline")] == ["smoke", "roofline", "tour"]
    for bad in ("0", str(len(names) + 1), "smoke,1", "warp_drive", ""):
        with pytest.raises(Exception, match="parts are"):
            rb.parse_parts(bad)
    for part in rb.PARTS:  # each part is one thing to run, a command or a function
        assert (part.command is None) != (part.function is None), part.name


def test_missing_packages_are_reported(tmp_path, monkeypatch):
    """Without FastAPI & co. and without wheels to install them from, the reason is reported."""
    rb = load_runbook()
    monkeypatch.setattr(rb, "EXTRA_MODULES", ("fastapi", "no_such_module_minivllm"))
    status, path = rb.extra_packages(tmp_path / "no_wheels", tmp_path / "wheels.log")
    assert path is None and "no_such_module_minivllm" in status and "fetch_wheels" in status
    monkeypatch.setattr(rb, "EXTRA_MODULES", ("json",))
    assert rb.extra_packages(tmp_path, tmp_path / "wheels.log") == ("installed already", None)


def test_a_wheel_that_does_not_install_leaves_the_others_installed(tmp_path, monkeypatch):
    """The wheels are installed in two groups; a broken xgrammar wheel is reported and does not
    stop the server's packages (here: a tiny pure-Python wheel built on the spot)."""
    rb = load_runbook()
    monkeypatch.setattr(rb, "EXTRA_MODULES", ("no_such_module_minivllm",))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    good = wheels / "tinypkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(good, "w") as whl:
        whl.writestr("tinypkg/__init__.py", "X = 1\n")
        whl.writestr("tinypkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n")
        whl.writestr("tinypkg-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                    "Tag: py3-none-any\n")
        whl.writestr("tinypkg-1.0.dist-info/RECORD", "")
    (wheels / "xgrammar-0.0-py3-none-any.whl").write_bytes(b"not a zip file")
    status, site = rb.extra_packages(wheels, tmp_path / "wheels.log")
    assert site is not None and (Path(site) / "tinypkg" / "__init__.py").is_file(), status
    assert status.startswith("installed 1 wheels") and "could not install xgrammar-0.0-py3-none-any.whl" in status
