"""Chapter 10's script on the tiny checkpoint, end to end, on loopback only: it streams with the
openai client, shows a template-less chat's 400 and a raw event stream, reads /metrics, load-tests
a continuous and a static server and writes its JSON and figure; every count it reports is the
one the requests and the seeded workload fix in advance, and it leaves no server running."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest
from tiny_models import run_script

from minivllm.course.bench.workloads import make_workload
from minivllm.course.text import DEMO_PROMPT, encode_or_random

pytestmark = [pytest.mark.ch10, pytest.mark.floors]

SCRIPT = Path(__file__).parents[1] / "chapters" / "10_serving.py"
LEVELS, REQUESTS, VOCAB = [1, 3], 4, 97  # the tiny checkpoint's vocabulary
WARM_UP, COMPLETION, RAW = 2, 32, 6  # tokens of the script's requests to the continuous server


@pytest.fixture(scope="module")
def run(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ch10")
    args = ["--model", str(tiny_checkpoint), "--device", "cpu", "--workload", "tiny",
            "--concurrency", ",".join(map(str, LEVELS)), "--requests-per-level", str(REQUESTS),
            "--static-batch-size", "2"]
    return folder, run_script(SCRIPT, args, folder, "10_serving_chapter_cpu")  # one run for all the checks below


def test_it_writes_its_own_json_and_figure_and_nothing_else(run):
    folder, _ = run
    written = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert written == ["benchmarks/results/10_serving_chapter_cpu.json", "figures/10_chapter_latency_vs_concurrency.png"]
    assert (folder / "figures/10_chapter_latency_vs_concurrency.png").stat().st_size > 10_000


def test_every_server_and_engine_thread_is_gone(run):
    _, payload = run
    alive = [t.name for t in threading.enumerate() if t.name in ("uvicorn", "minivllm-engine")]
    assert not alive, f"still running: {alive}"
    for url in payload["chapter"]["urls"].values():
        assert url.startswith("http://127.0.0.1:")
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=5, trust_env=False)


def test_the_streams_carry_the_tokens_asked_for(run):
    _, payload = run
    facts, prompt = payload["chapter"], encode_or_random(None, DEMO_PROMPT, VOCAB)  # no tokenizer: token ids
    completion = facts["completion"]
    assert completion["prompt"] == prompt
    counts = {k: completion["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert counts == {"prompt_tokens": len(prompt), "completion_tokens": COMPLETION,
                      "total_tokens": len(prompt) + COMPLETION}
    assert completion["finish_reason"] == "length" and 1 <= completion["chunks"] <= COMPLETION
    assert "chat" not in facts  # no tokenizer, so no template to chat through
    refused = facts["chat_without_template"]
    assert refused["status"] == 400 and "no chat template" in refused["message"]

    lines = facts["raw_events"]
    assert lines[1::2] == [""] * (len(lines) // 2), "every event ends with a blank line"
    events = lines[0::2]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == RAW
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"


def test_metrics_count_exactly_the_requests_sent_before_they_were_read(run):
    _, payload = run
    metrics, prompt = payload["chapter"]["metrics"], encode_or_random(None, DEMO_PROMPT, VOCAB)
    assert metrics["minivllm_generation_tokens_total"] == WARM_UP + COMPLETION + RAW
    assert metrics["minivllm_prompt_tokens_total"] == 3 * len(prompt)
    assert metrics['minivllm_requests_finished_total{finished_reason="length"}'] == 3
    assert metrics["minivllm_time_to_first_token_seconds_count"] == 3
    assert metrics["minivllm_num_requests_running"] == metrics["minivllm_kv_cache_usage"] == 0


def test_load_test_serves_every_request_of_the_seeded_workload_on_both_servers(run):
    _, payload = run
    runs = payload["runs"]["concurrency"]
    assert sorted(runs) == ["continuous", "static"]
    assert runs["static"]["server"]["static_batch_size"] == 2 and runs["continuous"]["server"]["scheduler"] == "continuous"
    planned = sum(make_workload("tiny", VOCAB, seed=0, num_requests=REQUESTS).output_lens)
    for label, run_ in runs.items():
        assert [lv["concurrency"] for lv in run_["levels"]] == LEVELS
        for lv in run_["levels"]:
            assert lv["completed"] == lv["requests"] == REQUESTS and lv["failed"] == 0, (label, lv["errors"])
            assert lv["output_throughput"] * lv["seconds"] == pytest.approx(planned), label
        best = run_["highest_level_meeting_slo"]
        assert best == max((lv["concurrency"] for lv in run_["levels"] if lv["slo_met"]), default=None)
    assert payload["chapter"]["engine"]["enable_prefix_caching"] is False
