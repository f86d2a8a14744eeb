"""Chapter 10 (issue 49): the /metrics series vLLM's dashboards plot that the server lacked —
tokens per step, waiting by reason, preemptions, the cache's configuration and the per-request
histograms — read with prometheus-client's own parser, from both servers: chapter 10's (the
engine in a thread) and chapter 15's (the core in a process of its own).

Each check sends what it knows (prompt lengths, max_tokens, n) and reads back what the series
must then say: counts and sums of the histograms, vLLM's 1-2-5 bucket edges up to the context,
the identities between the phases (queue + inference = e2e, prefill + decode = inference),
preemptions where a starved KV pool forces them (counted again, request by request, from the
engine's own outputs), and "deferred" waiting while a grammar is held back from compiling.
"""
from __future__ import annotations

import threading
import time
from concurrent import futures

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_checks import MODEL, TIMEOUT, answer, running_server, wait_until_idle

from minivllm import LLMEngine

pytestmark = [pytest.mark.ch10, pytest.mark.floors]
SERVERS = [pytest.param(False, id="thread"), pytest.param(True, id="core_process")]
# The core process' steps are slower to come by on a busy machine (~20 s each here): one check runs in the fast tier.
SERVERS_SLOW_PROCESS = [SERVERS[0], pytest.param(True, id="core_process", marks=pytest.mark.slow)]
ROOMY = {"num_kv_blocks": 256, "max_num_seqs": 16, "max_model_len": 256}
PHASES = ("queue", "prefill", "decode", "inference")


def families(http: httpx.Client) -> dict[str, list]:
    """/metrics through prometheus-client's parser: family name -> its samples."""
    response = http.get("/metrics")
    assert response.status_code == 200, response.text
    return {f.name: f.samples for f in text_string_to_metric_families(response.text)}


def value(samples: list, name: str, **labels: str) -> float:
    """The one sample called `name` whose labels include `labels` (model_name=MODEL always)."""
    labels = {"model_name": MODEL} | labels
    found = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples in {samples}"
    return found[0]


def histogram(metrics: dict[str, list], name: str) -> tuple[float, float, dict[float, float]]:
    """(count, sum, {upper edge: cumulative count}) of a vllm: histogram."""
    samples = metrics[name]
    buckets = {float(s.labels["le"]): s.value for s in samples if s.name == f"{name}_bucket"}
    return value(samples, f"{name}_count"), value(samples, f"{name}_sum"), buckets


def one_two_five_up_to(limit: int) -> list[float]:
    """vLLM's edges for token counts, written out: 1, 2, 5, 10, 20, 50, ... <= limit."""
    return [float(m * 10**e) for e in range(8) for m in (1, 2, 5) if m * 10**e <= limit]


def completions(http: httpx.Client, prompt: list[list[int]] | list[int], max_tokens: int, n: int = 1) -> dict:
    return answer(http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "n": n,
                                                     "temperature": 0 if n == 1 else 1.0, "ignore_eos": True}))


@pytest.mark.parametrize("core_process", SERVERS)
def test_the_request_histograms_count_the_requests_sent(default_model, chat_tokenizer, core_process):
    engine = LLMEngine(default_model, tokenizer=chat_tokenizer, **ROOMY)
    prompts = [[7] * 3, [9] * 12, [11] * 40]  # one batch: three engine requests of max_tokens 5
    with running_server(engine, core_process=core_process) as (url, _), httpx.Client(base_url=url,
                                                                                       timeout=TIMEOUT) as http:
        completions(http, prompts, max_tokens=5)
        completions(http, [5] * 21, max_tokens=4, n=2)  # one request, two completions
        wait_until_idle(http)
        after = families(http)
    lengths = [3, 12, 40, 21]
    edges = one_two_five_up_to(ROOMY["max_model_len"])
    count, total, buckets = histogram(after, "vllm:request_prompt_tokens")
    assert (count, total) == (4, sum(lengths))
    assert sorted(buckets) == [*edges, float("inf")]
    assert all(buckets[le] == sum(n <= le for n in lengths) for le in buckets)
    count, total, _ = histogram(after, "vllm:request_generation_tokens")
    assert (count, total) == (4, 3 * 5 + 2 * 4)
    count, total, buckets = histogram(after, "vllm:request_params_n")
    assert (count, total, buckets[1.0], buckets[2.0]) == (4, 3 + 2, 3, 4)
    count, total, buckets = histogram(after, "vllm:request_params_max_tokens")
    assert (count, total, buckets[2.0], buckets[5.0]) == (4, 3 * 5 + 4, 0, 4)

    # vLLM's tokens per step: the prompts of the requests whose first token the step made, plus its new tokens
    count, total, _ = histogram(after, "vllm:iteration_tokens_total")
    assert total == sum(lengths) + 23 == sum(value(after[name], f"{name}_total")  # (a fresh server: totals from 0)
                                             for name in ("vllm:prompt_tokens", "vllm:generation_tokens"))
    assert 5 + 4 <= count <= 23  # the two calls one after the other: at least a step per token of each

    seconds = {phase: histogram(after, f"vllm:request_{phase}_time_seconds") for phase in PHASES}
    assert all(count == 4 for count, _, _ in seconds.values())
    queue, prefill, decode, inference = (seconds[phase][1] for phase in PHASES)
    e2e = histogram(after, "vllm:e2e_request_latency_seconds")[1]
    assert min(queue, prefill, decode) >= 0 and prefill > 0  # a prompt's step takes time
    assert queue + inference == pytest.approx(e2e, abs=1e-6)
    assert prefill + decode == pytest.approx(inference, abs=1e-6)

    assert value(after["vllm:num_preemptions"], "vllm:num_preemptions_total") == 0  # room for everyone
    [info] = after["vllm:cache_config_info"]
    assert info.value == 1
    assert {k: info.labels[k] for k in ("block_size", "num_gpu_blocks", "enable_prefix_caching")} == \
        {"block_size": str(engine.config.block_size), "num_gpu_blocks": str(ROOMY["num_kv_blocks"]),
         "enable_prefix_caching": str(bool(engine.config.enable_prefix_caching))}


@pytest.mark.parametrize("core_process", SERVERS_SLOW_PROCESS)
def test_preemptions_are_counted_when_the_kv_pool_is_starved(default_model, chat_tokenizer, core_process):
    # 8 blocks of 4 tokens: three requests of 5 + 12 tokens need 5 blocks each at the end, 15 in all
    engine = LLMEngine(default_model, tokenizer=chat_tokenizer, num_kv_blocks=8, block_size=4, max_num_seqs=4,
                       enable_prefix_caching=False)
    with running_server(engine, core_process=core_process) as (url, app), httpx.Client(base_url=url,
                                                                                         timeout=TIMEOUT) as http:
        per_request = []  # each finished request's own count, as the engine's outputs report it
        metrics = app.state.engine.metrics
        step_outputs = metrics.step_outputs

        def counting(outputs, now):
            per_request.extend(o.metrics.num_preemptions for o in outputs if o.finished)
            step_outputs(outputs, now)

        metrics.step_outputs = counting
        completions(http, [[3] * 5, [4] * 5, [6] * 5], max_tokens=12)
        wait_until_idle(http)
        after = families(http)
    assert len(per_request) == 3 and sum(per_request) > 0, per_request
    assert value(after["vllm:num_preemptions"], "vllm:num_preemptions_total") == sum(per_request)


@pytest.mark.parametrize("core_process", SERVERS_SLOW_PROCESS)
def test_requests_waiting_for_a_place_in_the_batch_wait_for_capacity(default_model, chat_tokenizer, core_process):
    engine = LLMEngine(default_model, tokenizer=chat_tokenizer, num_kv_blocks=64, max_num_seqs=1)
    with running_server(engine, core_process=core_process) as (url, _), httpx.Client(base_url=url,
                                                                                       timeout=TIMEOUT) as http:
        sender = threading.Thread(target=lambda: completions(httpx.Client(base_url=url, timeout=TIMEOUT),
                                                             [[3] * 5, [4] * 5], max_tokens=30))
        sender.start()
        seen = set()
        deadline = time.monotonic() + TIMEOUT
        while sender.is_alive() and time.monotonic() < deadline:
            samples = families(http)["vllm:num_requests_waiting_by_reason"]
            seen.add(tuple(value(samples, "vllm:num_requests_waiting_by_reason", reason=r)
                           for r in ("capacity", "deferred")))
            time.sleep(0.02)
        sender.join(TIMEOUT)
        idle = families(http)["vllm:num_requests_waiting_by_reason"]
    assert (1, 0) in seen, seen  # one runs (max_num_seqs=1), the other waits for its place
    assert {s.labels["reason"]: s.value for s in idle} == {"capacity": 0, "deferred": 0}


@pytest.mark.ch13  # a grammar: chapter 13
def test_a_request_whose_grammar_is_compiling_waits_deferred(default_model, chat_tokenizer):
    engine = LLMEngine(default_model, tokenizer=chat_tokenizer, num_kv_blocks=64)
    compile_constraint = engine.core._compile_constraint
    held: list[tuple[futures.Future, futures.Future]] = []

    def held_back(params):  # the grammar compiles, but the core sees it ready only when the check says so
        compiled = compile_constraint(params)
        if compiled is None:
            return None
        held.append((futures.Future(), compiled))
        return held[-1][0]

    engine.core._compile_constraint = held_back
    body = {"model": MODEL, "prompt": "x = ", "max_tokens": 3, "structured_outputs": {"regex": "[0-9]+"}}
    with running_server(engine) as (url, _), httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        sender = threading.Thread(target=lambda: answer(httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)))
        sender.start()
        deadline = time.monotonic() + TIMEOUT
        while True:
            samples = families(http)["vllm:num_requests_waiting_by_reason"]
            reasons = {s.labels["reason"]: s.value for s in samples}
            if reasons["deferred"] == 1:
                break
            assert time.monotonic() < deadline and sender.is_alive(), reasons
            time.sleep(0.02)
        assert reasons == {"capacity": 0, "deferred": 1}
        [(pending, compiled)] = held
        pending.set_result(compiled.result(TIMEOUT))  # the grammar is ready: the request runs and ends
        sender.join(TIMEOUT)
        idle = wait_until_idle(http)
    assert idle[f'vllm:num_requests_waiting_by_reason{{model_name={MODEL},reason=deferred}}'] == 0
