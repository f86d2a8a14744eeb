"""Chapter 12's script on the embedded model and its draft, at a small size, end to end: it writes
its figures and JSON, speculation never changes a greedy token, and its counts are consistent
(acceptances are shares, a verify step scores k + 1 tokens per sequence)."""
from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import run_script

from minivllm.course.bench.speculation import pause_threshold

pytestmark = [pytest.mark.ch12, pytest.mark.floors]

SCRIPT = Path(__file__).parents[1] / "chapters" / "12_speculative_decoding.py"


@pytest.fixture(scope="module")
def payload(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ch12")
    args = ["--device", "cpu", "--prompt-tokens", "80", "--output-tokens", "24", "--ks", "1", "3",
            "--batches", "1", "2", "--repeats", "1", "--k", "3"]
    return run_script(SCRIPT, args, folder, "12_speculative_decoding_cpu",
                      figures=("12_verify_step", "12_acceptance", "12_speedup_vs_batch", "12_verify_cost"))


def test_speculation_never_changes_a_greedy_token(payload):
    assert all(row["same_tokens"] for row in payload["benchmark"].values())
    assert all(row[m]["same_tokens"] for row in payload["batch_sweep"] for m in ("ngram", "draft"))


def test_the_sweeps_report_shares_and_gains(payload):
    rows = payload["acceptance"]
    assert {(r["method"], r["kind"], r["k"]) for r in rows} == {
        (m, kind, k) for m in ("ngram", "draft") for kind in ("repetitive", "ordinary") for k in (1, 3)}
    for r in rows:
        assert 0 <= r["acceptance"] <= 1
        assert 1 <= r["tokens_per_forward"] <= r["k"] + 1  # every verify step gains 1 to k + 1 tokens
    assert [r["batch_size"] for r in payload["verify_cost"]] == [1, 2]
    assert payload["benchmark"]["ngram"]["draft_tokens"] > 0


def test_the_gpu_runbook_part_dry_runs_on_the_cpu(tmp_path):
    """`--runbook` on a CPU: the verify steps replay the (stand-in) graphs of (bucket, 1 + k), the
    embedded model's n-gram run keeps every greedy token, and the numbers it reports hang together."""
    args = ["--device", "cpu", "--runbook", "--batches", "1", "3", "--prompt-tokens", "80", "--output-tokens", "24",
            "--repeats", "1", "--k", "3"]
    result = run_script(SCRIPT, args, tmp_path, "12_speculative_decoding_runbook_cpu", figures=("12_verify_graphs_cpu",))
    assert [r["batch_size"] for r in result["verify_cost"]] == [1, 3]
    assert all(r["verify_replayed"] for r in result["verify_cost"])
    e2e, padding = result["end_to_end"], result["padding"]
    assert e2e["same_tokens"] and e2e["ngram"]["draft_tokens"] > 0
    assert 1 <= e2e["tokens_per_verify"] <= 4 and padding["verify_steps"] > 0
    assert 0 <= padding["short_guess_share"] <= padding["padding_share"] < 1
    gains = [r["gain"] for r in result["predicted_gain"]]
    assert gains == pytest.approx([e2e["tokens_per_verify"] / r["ratio"] for r in result["verify_cost"]])
    assert result["disable_by_batch_size"] == pause_threshold([1, 3], gains)


def test_pause_threshold_is_the_first_batch_below_the_bar():
    assert pause_threshold([1, 2, 4, 8, 16, 32, 64], [1.82, 1.52, 1.18, 1.15, 1.09, 1.14, 1.03]) == 16
    assert pause_threshold([1, 256], [2.0, 1.2]) is None
    assert pause_threshold([1, 2], [1.0, 2.0], below=1.5) == 1
    with pytest.raises(ValueError):
        pause_threshold([1, 2], [1.0])
