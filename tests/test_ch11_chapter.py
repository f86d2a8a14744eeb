"""Chapter 11's script on the tiny checkpoint, end to end: it writes its figures and JSON, caching
changes no token, and the work it reports is exactly what block arithmetic predicts — the
cached run computes the plain run's prompt tokens minus the full blocks each request found
(the shared system prompt's, the previous turn's), as its trace counted them."""
from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import run_script

pytestmark = [pytest.mark.ch11, pytest.mark.floors]

SCRIPT = Path(__file__).parents[1] / "chapters" / "11_prefix_caching.py"
PREFIX, REQUESTS, SWEEP_PROMPT, SWEEP_REQUESTS = 40, 4, 64, 3


def full_blocks(tokens: int, block_size: int) -> int:
    """Tokens in the full blocks of a run of `tokens` tokens."""
    return tokens // block_size * block_size


@pytest.fixture(scope="module")
def payload(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ch11")
    args = ["--model", str(tiny_checkpoint), "--device", "cpu", "--requests", str(REQUESTS),
            "--prefix", str(PREFIX), "--repeats", "1", "--rate", "50", "--shares", "0", "0.5", "0.9",
            "--sweep-prompt", str(SWEEP_PROMPT), "--sweep-requests", str(SWEEP_REQUESTS), "--sweep-repeats", "1",
            "--conversations", "2", "--turns", "3", "--chat-repeats", "1"]
    return run_script(SCRIPT, args, folder, "11_prefix_caching_cpu",  # one run for all the checks below
                      figures=("11_shared_blocks", "11_shared_prefix", "11_multi_turn"))


def test_shared_prefix_benchmark_counts_the_work_the_cache_saves(payload):
    head, size = payload["headline"], payload["engine"]["block_size"]
    prompt_lens = head["workload"]["prompt_lens"]
    on, off = head["counts"]["caching on"], head["counts"]["caching off"]
    assert on["preemptions"] == off["preemptions"] == 0, "the pool was sized for every request at once"
    assert off["cached_tokens"] == 0 and off["prompt_tokens_computed"] == sum(prompt_lens)
    # The first request computes the system prompt; each of the others finds its full blocks.
    assert on["cached_tokens"] == (REQUESTS - 1) * full_blocks(PREFIX, size)
    assert on["prompt_tokens_computed"] == off["prompt_tokens_computed"] - on["cached_tokens"]
    assert on["decode_tokens"] == off["decode_tokens"] == sum(head["workload"]["output_lens"]) - REQUESTS
    # Every request is admitted in the first step: the plain run then holds every prompt's blocks.
    assert off["peak_kv_blocks"] >= sum(-(-n // size) for n in prompt_lens) > on["peak_kv_blocks"]
    digests = {run["outputs_digest"] for setting in head["runs"].values() for run in setting["at_once"]}
    assert len(digests) == 1 and head["same_tokens"], "prefix caching changed some token"
    assert all(len(setting["arrivals"]) == 1 and setting["arrivals"][0]["ttft_p50"] > 0
               for setting in head["runs"].values())


def test_sweep_saves_the_shared_full_blocks_of_every_request_but_the_first(payload):
    sweep, size = payload["sweep"], payload["engine"]["block_size"]
    assert sweep["prefix_lens"] == [round(s * SWEEP_PROMPT) for s in (0, 0.5, 0.9)]
    assert len(sweep["speedups"]) == 3 and all(g["ttft_p50"] > 0 for g in sweep["speedups"])
    for prefix, on, off in zip(sweep["prefix_lens"], sweep["results"]["caching on"], sweep["results"]["caching off"]):
        assert off["prompt_tokens_computed"] == SWEEP_REQUESTS * SWEEP_PROMPT
        assert on["cached_tokens"] == (SWEEP_REQUESTS - 1) * full_blocks(prefix, size), prefix
        assert on["prompt_tokens_computed"] == off["prompt_tokens_computed"] - on["cached_tokens"]
        assert on["outputs_digest"] == off["outputs_digest"]


def test_each_chat_turn_computes_only_what_the_last_turn_did_not(payload):
    chat, size = payload["multi_turn"], payload["multi_turn"]["block_size"]
    assert chat["same_tokens"] and len(chat["turns"]) == 3
    for turn in chat["turns"]:
        on, off = turn["caching on"], turn["caching off"]
        assert off["cached_tokens"] == 0 and off["prompt_tokens_computed"] == turn["prompt_tokens"]
        # The last turn's K/V cover its prompt and its answer but the answer's last token (never
        # fed back), so the full blocks of history - 1 tokens are found.
        expected = sum(full_blocks(h - 1, size) for h in turn["history_lens"] if h)
        assert on["cached_tokens"] == expected, turn["turn"]
        assert on["prompt_tokens_computed"] == turn["prompt_tokens"] - expected
    assert chat["turns"][0]["history_lens"] == [0, 0] and chat["turns"][-1]["caching on"]["cached_tokens"] > 0


def test_n_samples_compute_their_prompt_once(payload):
    n = payload["n_completions"]
    size, prompt = payload["engine"]["block_size"], n["prompt_tokens"]
    tail = prompt - full_blocks(prompt - 1, size)  # the block a sample cannot share: it holds the last token
    assert n["caching on"]["first_step_prefill"] == [prompt] + [tail] * (n["n"] - 1)
    assert n["caching off"]["first_step_prefill"] == [prompt] * n["n"]
    assert n["caching on"]["cached_tokens"] == (n["n"] - 1) * (prompt - tail)


def test_shared_blocks_picture_counts_its_owners(payload):
    shared = payload["shared_blocks"]
    tables, refs = shared["tables"], shared["ref_counts"]
    full = shared["system_prompt_tokens"] // shared["block_size"]
    assert len(tables) == 3 and len({tuple(t[:full]) for t in tables.values()}) == 1, "one system prompt, one copy"
    assert len({t[full] for t in tables.values()}) == 3, "the block holding the prompt's last token is private"
    assert all(refs[b] == sum(b in t for t in tables.values()) for b in range(len(refs)))
    assert all(n == full * shared["block_size"] for n in shared["cached_tokens"].values())
    sample = payload["sample"]
    assert sample["same_tokens"] and sample["cached_tokens"][0] == 0 and min(sample["cached_tokens"][1:]) > 0


def test_workloads_share_what_they_say_and_refuse_bad_settings():
    from minivllm.course.bench.workloads import make_multi_turn_workload, make_shared_prefix_workload

    work = make_shared_prefix_workload(97, prefix_len=20, num_requests=5, suffix=(3, 9), output=(2, 4), seed=1)
    system = work.prompts[0][:20]
    assert all(p[:20] == system and 23 <= len(p) <= 29 for p in work.prompts) and work.arrivals is None
    assert len({tuple(p[20:]) for p in work.prompts}) == 5, "each request has a part of its own"
    timed = make_shared_prefix_workload(97, 20, 5, (3, 9), (2, 4), seed=1, rate=4.0)
    assert timed.prompts == work.prompts and timed.output_lens == work.output_lens
    assert timed.arrivals == sorted(timed.arrivals) and timed.arrivals[0] > 0
    chats = make_multi_turn_workload(97, num_conversations=3, turns=2, first=(5, 6), message=(1, 2), output=(1, 2))
    assert chats.prompts(0, [[], [], []]) == [m[0] for m in chats.messages]
    assert chats.prompts(1, [[1], [2], [3]]) == [[i + 1] + m[1] for i, m in enumerate(chats.messages)]
    for bad in (dict(prefix_len=-1), dict(prefix_len=2.0), dict(prefix_len=True), dict(prefix_len=4, suffix=(0, 2)),
                dict(prefix_len=4, suffix=[1, 2]), dict(prefix_len=4, output=(3, 1)), dict(prefix_len=4, num_requests=0)):
        with pytest.raises(ValueError):
            make_shared_prefix_workload(97, **bad)
    with pytest.raises(ValueError):
        make_multi_turn_workload(97, turns=0)
    with pytest.raises(ValueError):
        chats.prompts(1, [[1]])
