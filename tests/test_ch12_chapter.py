"""Chapter 12's script on the embedded model and its draft, at a small size, end to end: it writes
its figures and JSON, speculation never changes a greedy token, and its counts are consistent
(acceptances are shares, a verify step scores k + 1 tokens per sequence)."""
from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import run_script

pytestmark = pytest.mark.ch12

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
