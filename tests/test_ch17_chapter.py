"""Chapter 17's script on the tiny checkpoint, end to end: it writes its JSON, the consumer gives
one engine's tokens having loaded every full block before the last token, the calls it shows
come in the order of kv_transfer/base.py's table, and each timed row moved what its length says."""
from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import run_script

pytestmark = [pytest.mark.ch17, pytest.mark.floors, pytest.mark.timeout(240)]

SCRIPT = Path(__file__).parents[1] / "chapters" / "17_disaggregated_prefill.py"


def test_the_chapter_script_shows_the_calls_and_times_both_ways(tiny_checkpoint, tmp_path):
    args = ["--model", str(tiny_checkpoint), "--device", "cpu", "--lengths", "20,40", "--repeats", "1"]
    payload = run_script(SCRIPT, args, tmp_path, "17_disaggregated_prefill_cpu")
    one = payload["one_request"]
    assert one["same_tokens"] and one["loaded_tokens"] == (one["prompt_tokens"] - 1) // 16 * 16 > 0
    consumer = [line.split()[2].split("(")[0] for line in one["calls"] if line.startswith("consumer")]
    order = ["get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
             "bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
             "request_finished"]
    assert consumer == order, f"the consumer's calls for one request, in order: {consumer}"
    assert [r["prompt_tokens"] for r in payload["load_or_compute"]] == [20, 40]
    for r in payload["load_or_compute"]:
        assert r["loaded_tokens"] == (r["prompt_tokens"] - 1) // 16 * 16
        assert r["compute_ms"] > 0 and r["load_ms"] > 0
