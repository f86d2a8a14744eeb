"""The engine benchmark on a tiny workload: it runs, every runner produces transformers' tokens, and the
traced run's steps account for exactly the tokens the workload needs computed."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from tiny_models import run_script

from minivllm.course.bench.peers import continuous_batching_unavailable

pytestmark = pytest.mark.floors

BENCHMARK = Path(__file__).parents[1] / "benchmarks" / "continuous_vs_transformers.py"


def test_engine_benchmark_writes_json_and_figure(tiny_checkpoint, tmp_path):
    payload = run_script(BENCHMARK, ["--model", str(tiny_checkpoint), "--workload", "tiny", "--requests", "3", "8",
                                     "--repeats", "1", "--device", "cpu"],
                         tmp_path, "07_vs_transformers_cpu", figures=["07_vs_transformers"])
    assert [run["workload"]["requests"] for run in payload["runs"]] == [3, 8]
    peers = ["transformers generate (static)"]
    if not continuous_batching_unavailable():  # transformers < 5.5 has no continuous batching to compare with
        peers.append("transformers generate_batch")
    for run in payload["runs"]:
        n = run["workload"]["requests"]
        assert [row["name"] for row in run["rows"]] == ["minivllm LLM.generate", *peers]
        for row in run["rows"]:
            assert row["same_tokens_as_minivllm"] == f"{n}/{n}", row["name"]
            assert row["useful_tokens"] == sum(run["workload"]["output_lens"])
    # The traced run is the headline workload (tiny's own 8 requests). Without preemption each
    # request computes its prompt once and then one decode token per output token but the first,
    # which its prompt's last position already predicted.
    headline = next(run for run in payload["runs"] if run["workload"]["requests"] == payload["headline_requests"])
    prompt_lens, output_lens = headline["workload"]["prompt_lens"], headline["workload"]["output_lens"]
    steps = payload["minivllm_steps"]
    assert sum(kind["tokens"] for kind in steps) == sum(prompt_lens) + sum(output_lens) - len(prompt_lens)
    assert steps[0]["kind"].startswith("prefill")


def test_host_step_benchmark_times_every_phase_of_a_decode_step(tmp_path):
    """benchmarks/host_step.py on a small batch: every measured step is a decode step of the
    whole batch (it checks that itself), and the phases add up to no more than the step."""
    script = Path(__file__).parents[1] / "benchmarks" / "host_step.py"
    payload = run_script(script, ["--batch-size", "8", "--context", "40", "--steps", "3", "--rounds", "1"],
                         tmp_path, "09_host_step_cpu")
    medians = payload["medians_ms"]["this tree"]
    # The script itself refuses a run that imported minivllm from anywhere but the tree it names.
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=script.parent, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert payload["trees"]["this tree"].split()[0] == head
    parts = ("schedule", "prepare (eager)", "sample", "finish")
    assert all(medians[p] > 0 for p in parts) and medians["prepare (graph)"] > 0
    # finish is the step less the other three, step by step, so the phases fill each step exactly;
    # their medians need not add up to the step's median (3 steps on a shared machine: measured
    # 1.05x once), so the check allows a quarter more, and still catches a phase timed twice
    assert sum(medians[p] for p in parts) <= 1.25 * medians["step"] + 1e-3
