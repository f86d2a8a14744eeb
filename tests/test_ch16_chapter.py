"""Chapter 16's script on the tiny checkpoint, end to end: it writes its figure and JSON, async
scheduling gives the synchronous tokens, and the stand-in measured what it says (every row has
both engines, the device time it asked for at least). The timeline it draws follows the model
of the two engines exactly: host + device per step in turn, max(host, device) overlapped."""
from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import run_script

from minivllm.course.plots.overlap import simulate

pytestmark = [pytest.mark.ch16, pytest.mark.timeout(240)]

SCRIPT = Path(__file__).parents[1] / "chapters" / "16_async_scheduling.py"


@pytest.mark.floors
def test_the_chapter_script_runs_and_measures_both_engines(tiny_checkpoint, tmp_path):
    args = ["--model", str(tiny_checkpoint), "--device", "cpu", "--batch-size", "8", "--context", "40", "--steps", "6",
            "--device-ms", "1,3", "--out", str(tmp_path)]
    payload = run_script(SCRIPT, args, tmp_path, "16_async_scheduling_cpu", figures=("16_overlap",))
    assert payload["sample"]["same_tokens"]
    rows = payload["stand_in"]["rows"]
    assert [r["asked_device_ms"] for r in rows] == [1.0, 3.0]
    for r in rows:
        assert r["device_ms"] >= r["asked_device_ms"]  # a sleep never ends early
        assert r["host_plus_device_ms"] == pytest.approx(r["host_ms"] + r["device_ms"])
        assert r["max_host_device_ms"] == max(r["host_ms"], r["device_ms"])
        assert r["sync_ms"] > 0 and r["async_ms"] > 0


@pytest.mark.parametrize("host, device", [(2.0, 1.0), (1.0, 3.0), (1.5, 1.5)])
def test_the_drawn_timeline_follows_the_two_engines(host, device):
    steps = 6
    sync = simulate(host, device, steps, overlap=False)
    assert max(end for *_, end in sync) == pytest.approx(steps * (host + device))
    overlapped = simulate(host, device, steps, overlap=True)
    device_spans = sorted((start, end) for lane, _, start, end in overlapped if lane == "device")
    assert all(a[1] <= b[0] + 1e-9 for a, b in zip(device_spans, device_spans[1:])), "the device runs one step at a time"
    starts = [start for start, _ in device_spans]
    gaps = [b - a for a, b in zip(starts[1:], starts[2:])]  # steady state, after the first step
    assert gaps == pytest.approx([max(host, device)] * len(gaps))
