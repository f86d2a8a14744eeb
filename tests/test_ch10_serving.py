"""Chapter 10: the OpenAI-compatible server. The official openai client streams completions
and chats; streamed greedy text equals LLM.generate's; 100 concurrent streams all finish with
their tokens; a client that disconnects frees its KV blocks; bad requests get a 4xx while
the server keeps serving; a full queue answers 503; a failure inside the server reaches the client
as a 500 or a last stream event naming it; static mode never mixes batches; /metrics is Prometheus
text whose counters add up; and the streaming exercise's deltas.

Each server runs in a thread on 127.0.0.1 with an OS-chosen port, on the embedded default
model (4M parameters, its real tokenizer), and is shut down by its fixture. Every wait is
bounded in count and time.
"""
from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_checks import (ENGINE, MODEL, TIMEOUT, answer, chunks_of, error_event, expect_status, openai_client,
                           running_server, wait_until_idle)

from minivllm import LLM, LLMEngine, SamplingParams, load_tokenizer
from minivllm.course.bench.load import SLO, RequestResult, bench_serve, summarize
from minivllm.request.outputs import CompletionOutput, RequestOutput
from minivllm.core.trace import Trace
from minivllm.entrypoints.openai.sse import DONE, Chunks, StreamState, new_deltas, sse, stream_events

pytestmark = [pytest.mark.ch10, pytest.mark.floors]

PROMPTS = ["import os\n\ndef list_files(path):\n    return", "class Stack:\n    def push(self, item):\n        self.",
           "for i in range("]


@pytest.fixture(scope="module")
def llm(default_model, chat_tokenizer) -> LLM:
    """The offline engine on the same weights: what the server's answers must equal."""
    return LLM(default_model, tokenizer=chat_tokenizer, **ENGINE)


@pytest.fixture(scope="module", params=["thread", "process"])
def server(default_model, chat_tokenizer, request):
    """Chapter 10's one-process server, then chapter 15's with the engine core in its own process:
    every check that uses this fixture runs against both."""
    engine = LLMEngine(default_model, tokenizer=chat_tokenizer, **ENGINE)
    with running_server(engine, core_process=request.param == "process") as (url, app):
        yield url, app


@pytest.fixture()
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0], timeout=TIMEOUT, trust_env=False) as client:
        yield client


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def test_openai_client_streams_a_completion_equal_to_generate(server, llm):
    client = openai_client(server[0])
    for prompt in PROMPTS:
        expected = llm.generate(prompt, greedy(24), use_tqdm=False)[0]
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.outputs[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.outputs[0].finish_reason
        assert chunks[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)
        assert chunks[-1].usage.prompt_tokens == len(expected.prompt_token_ids)
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert whole.choices[0].text == expected.outputs[0].text


def test_openai_client_streams_a_chat_through_the_template(server, llm):
    client = openai_client(server[0])
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    rendered = "# system: You write Python.\n# user: def add(a, b):\n# assistant:"  # CHAT_TEMPLATE, by hand
    expected = llm.generate(rendered, greedy(16), use_tqdm=False)[0].outputs[0]
    assert llm.chat(messages, greedy(16), use_tqdm=False)[0].outputs[0].text == expected.text
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16, temperature=0)
    assert whole.choices[0].message.content == expected.text


def test_chat_without_a_template_is_a_clear_400(default_model):
    engine = LLMEngine(default_model, tokenizer=load_tokenizer(), num_kv_blocks=64)
    with running_server(engine) as (url, _):
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            openai_client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])


async def stream_text(client: httpx.AsyncClient, body: dict) -> tuple[str, dict]:
    """The streamed text of one completion and its usage chunk."""
    text, usage = [], None
    async with client.stream("POST", "/v1/completions", json=body | {"stream": True,
                                                                     "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, f"HTTP {r.status_code}: {(await r.aread()).decode()}"
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != DONE.strip():
                chunk = json.loads(line.removeprefix("data: "))
                assert error_event(chunk) is None, f"the stream ended with an error event: {error_event(chunk)}"
                text += [c["text"] for c in chunk["choices"]]
                usage = chunk.get("usage") or usage
    return "".join(text), usage


def test_100_concurrent_streams_all_finish_with_their_tokens(server, llm, chat_tokenizer):
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 4096) for _ in range(rng.randint(4, 24))] for _ in range(100)]
    lengths = [rng.randint(1, 12) for _ in prompts]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    expected = [out.outputs[0].text for out in llm.generate(prompts, params, use_tqdm=False)]

    async def all_clients() -> list[tuple[str, dict]]:
        async with httpx.AsyncClient(base_url=server[0], timeout=TIMEOUT, trust_env=False,
                                     limits=httpx.Limits(max_connections=100)) as client:
            bodies = [{"model": MODEL, "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True}
                      for p, n in zip(prompts, lengths)]
            return await asyncio.wait_for(asyncio.gather(*(stream_text(client, b) for b in bodies)), TIMEOUT)

    results = asyncio.run(all_clients())
    assert [usage["completion_tokens"] for _, usage in results] == lengths
    assert [text for text, _ in results] == expected


def test_disconnect_mid_stream_aborts_and_frees_every_kv_block(server, http):
    engine = getattr(server[1].state.engine, "engine", None)  # None: the engine is in the core process
    before = wait_until_idle(http)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        expect_status(response)
        lines = response.iter_lines()
        assert len(list(chunks_of(line for _, line in zip(range(6), lines)))) == 3  # 3 events, 3 separators
    after = wait_until_idle(http)  # the connection is closed: the server must notice and abort
    assert after.get("minivllm_requests_finished_total{finished_reason=abort}", 0) == \
        before.get("minivllm_requests_finished_total{finished_reason=abort}", 0) + 1
    assert after["minivllm_generation_tokens_total"] - before["minivllm_generation_tokens_total"] < 400
    assert after["minivllm_kv_cache_usage"] == 0
    assert engine is None or engine.core.block_manager.num_free == engine.core.block_manager.num_blocks
    expect_status(http.post("/v1/completions", json={"model": MODEL, "prompt": "x = ", "max_tokens": 2}))


TOO_LONG = list(range(1, 600))  # the embedded model's context is 512 tokens
BAD_COMPLETIONS = {
    "malformed JSON": ('{"model": "tiny-server", "prompt": "x",', 400),
    "not an object": ("[1, 2]", 400),
    "unknown model": ({"model": "gpt-4", "prompt": "x"}, 404),
    "missing prompt": ({"model": MODEL}, 400),
    "empty prompt": ({"model": MODEL, "prompt": ""}, 400),
    "empty token list": ({"model": MODEL, "prompt": []}, 400),
    "token id outside the vocabulary": ({"model": MODEL, "prompt": [5, 99999]}, 400),
    "prompt too long": ({"model": MODEL, "prompt": TOO_LONG}, 400),
    "negative temperature": ({"model": MODEL, "prompt": "x", "temperature": -1}, 400),
    "top_p 0": ({"model": MODEL, "prompt": "x", "top_p": 0}, 400),
    "max_tokens 0": ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400),
    "a string for a number": ({"model": MODEL, "prompt": "x", "temperature": "0.5"}, 400),
    "a float for an integer": ({"model": MODEL, "prompt": "x", "max_tokens": 4.0}, 400),
    "stop of the wrong type": ({"model": MODEL, "prompt": "x", "stop": 7}, 400),
    "unknown field": ({"model": MODEL, "prompt": "x", "best_of_the_best": 2}, 400),
    "unsupported OpenAI field": ({"model": MODEL, "prompt": "x", "suffix": "end"}, 400),
    "unknown stream option": ({"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"x": 1}}, 400),
}
BAD_CHATS = {
    "no messages": ({"model": MODEL, "messages": []}, 400),
    # any role goes to the template, and a message may leave out its content (vLLM's rules): but
    # a role is a non-empty string, and content is text
    "empty role": ({"model": MODEL, "messages": [{"role": "", "content": "hi"}]}, 400),
    "role not a string": ({"model": MODEL, "messages": [{"role": 5, "content": "hi"}]}, 400),
    "content not text": ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400),
    "top_logprobs without logprobs": ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                       "top_logprobs": 2}, 400),
}


@pytest.mark.parametrize("path,case", [("/v1/completions", c) for c in BAD_COMPLETIONS] +
                         [("/v1/chat/completions", c) for c in BAD_CHATS])
def test_bad_request_gets_its_4xx_and_the_next_good_one_succeeds(http, path, case):
    body, status = (BAD_COMPLETIONS if path == "/v1/completions" else BAD_CHATS)[case]
    content = body if isinstance(body, str) else json.dumps(body)
    response = http.post(path, content=content, headers={"content-type": "application/json"})
    expect_status(response, status)
    error = response.json()["error"]
    assert error["message"] and error["type"]
    good = http.post("/v1/completions", json={"model": MODEL, "prompt": "x = ", "max_tokens": 3, "temperature": 0})
    assert answer(good)["usage"]["completion_tokens"] == 3


def test_a_full_queue_answers_503(default_model, chat_tokenizer):
    engine = LLMEngine(default_model, tokenizer=chat_tokenizer, num_kv_blocks=64, max_num_seqs=1)
    long = {"model": MODEL, "prompt": "x = ", "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}
    with running_server(engine, max_waiting=1) as (url, _), \
            httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False) as http:
        with http.stream("POST", "/v1/completions", json=long) as running:
            expect_status(running)
            lines = running.iter_lines()  # (kept: dropping a half-read iterator closes the connection)
            next(lines)  # its first token is out: it runs, and holds the only seat
            with http.stream("POST", "/v1/completions", json=long) as waiting:
                expect_status(waiting)  # accepted: it waits in the queue
                refused = http.post("/v1/completions", json=long)
                expect_status(refused, 503)
                assert "max_waiting" in refused.json()["error"]["message"]


STUB = "Exercise ch99 broken_step: a stub that was never written"  # what a student copy's stub raises


def failing_after(calls: int, function):
    """`function`, except that every call after the first `calls` raises NotImplementedError(STUB)."""
    made = []

    def call_or_fail(*args, **kwargs):
        made.append(1)
        if len(made) > calls:
            raise NotImplementedError(STUB)
        return function(*args, **kwargs)
    return call_or_fail


def test_a_failed_step_reaches_every_client_as_a_500_naming_it(default_model, chat_tokenizer):
    """A step that raises stops the engine. The request waiting for it and every later one get a
    500 whose OpenAI error body names what raised (in a student copy: the exercise), and
    /health says why the engine stopped."""
    engine = LLMEngine(default_model, tokenizer=chat_tokenizer, num_kv_blocks=64)
    engine.step = failing_after(0, engine.step)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4}
    with running_server(engine) as (url, _), httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False) as http:
        for _ in range(2):  # in flight when the step fails, then after
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 500, response.text
            error = response.json()["error"]
            assert error["type"] == "internal_server_error" and f"NotImplementedError: {STUB}" in error["message"]
        health = http.get("/health")
        assert health.status_code == 503 and STUB in health.json()["error"]["message"]
        with pytest.raises(openai.InternalServerError, match="Exercise ch99 broken_step"):
            openai_client(url).completions.create(model=MODEL, prompt="x", max_tokens=2)


def test_a_stream_that_fails_after_it_began_ends_with_an_error_event(default_model, chat_tokenizer, monkeypatch):
    """Once a stream has begun its 200 is sent: a failure, in the engine thread or in the event
    loop, ends the stream with one `data: {"error": ...}` event naming it, then [DONE]; the
    openai client raises it as an APIError."""
    engine = LLMEngine(default_model, tokenizer=chat_tokenizer, num_kv_blocks=64)
    engine.step = failing_after(3, engine.step)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "ignore_eos": True, "stream": True}
    with running_server(engine) as (url, _), httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            expect_status(response)
            events = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                      if line.startswith("data: ") and line != DONE.strip()]
            # (a reader that fell behind gets only the newest output: how many token chunks
            # come before the error depends on timing, up to one per step that ran)
            assert len(events) <= 4 and all(len(e["choices"]) == 1 for e in events[:-1])
            assert STUB in error_event(events[-1])
    fresh = LLMEngine(default_model, tokenizer=chat_tokenizer, num_kv_blocks=64)
    monkeypatch.setattr("minivllm.entrypoints.openai.sse.new_deltas", failing_after(0, None))  # fails in the event loop
    with running_server(fresh) as (url, _):
        with pytest.raises(openai.APIError, match="Exercise ch99 broken_step"):
            list(openai_client(url).completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True))


def test_static_mode_runs_batches_that_never_mix(default_model, chat_tokenizer):
    engine = LLMEngine(default_model, tokenizer=chat_tokenizer, num_kv_blocks=64)
    engine.core.trace = Trace()
    lengths = [3, 9, 5, 7, 2]
    with running_server(engine, static_batch_size=2) as (url, _):
        async def send_all() -> list[tuple[str, dict]]:
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, trust_env=False) as client:
                bodies = [{"model": MODEL, "prompt": [7, 8, 9], "max_tokens": n, "ignore_eos": True} for n in lengths]
                return await asyncio.wait_for(asyncio.gather(*(stream_text(client, b) for b in bodies)), TIMEOUT)

        results = asyncio.run(send_all())
    assert [usage["completion_tokens"] for _, usage in results] == lengths
    steps: dict[str, list[int]] = {}  # request id -> the steps it computed in
    for record in engine.core.trace.steps:
        for request_id in [*record.prefill, *record.decode]:
            steps.setdefault(request_id, []).append(record.step)
    spans = sorted((s[0], s[-1]) for s in steps.values())
    assert len(spans) == len(lengths)
    for (start_a, end_a), (start_b, end_b) in zip(spans, spans[1:]):
        assert start_b == start_a or start_b > end_a, "a request joined a batch that was still running"
    assert max(sum(s == start for s, _ in spans) for start, _ in spans) == 2  # batches of 2, 2 and 1


def test_metrics_are_prometheus_text_whose_counts_add_up(server, http):
    before = wait_until_idle(http)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    expect_status(http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 7, "ignore_eos": True}))
    after = wait_until_idle(http)
    assert after["minivllm_prompt_tokens_total"] - before["minivllm_prompt_tokens_total"] == len(prompt)
    assert after["minivllm_generation_tokens_total"] - before["minivllm_generation_tokens_total"] == 7
    for histogram, observations in (("time_to_first_token", 1), ("inter_token_latency", 6), ("e2e_request_latency", 1)):
        name = f"minivllm_{histogram}_seconds_count"
        assert after[name] - before[name] == observations
    assert after["minivllm_requests_finished_total{finished_reason=length}"] - \
        before.get("minivllm_requests_finished_total{finished_reason=length}", 0) == 1
    assert after["minivllm_kv_cache_usage"] == 0


def test_health_and_models(http):
    expect_status(http.get("/health"))
    models = answer(http.get("/v1/models"))
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 512


# ---- the vLLM sampling fields, through the server ----

SAMPLING_CASES = {
    "n=2, seeded": ({"n": 2, "temperature": 0.8, "seed": 7}, dict(n=2, temperature=0.8, seed=7)),
    "stop string": ({"temperature": 0, "stop": ["(", "\n"]}, dict(temperature=0.0, stop=["(", "\n"])),
    "logprobs": ({"temperature": 0, "logprobs": 2}, dict(temperature=0.0, logprobs=2)),
    "penalties, top_k, min_p": ({"temperature": 0.7, "seed": 1, "presence_penalty": 0.5, "frequency_penalty": 0.3,
                                 "repetition_penalty": 1.2, "top_k": 20, "min_p": 0.05, "min_tokens": 4},
                                dict(temperature=0.7, seed=1, presence_penalty=0.5, frequency_penalty=0.3,
                                     repetition_penalty=1.2, top_k=20, min_p=0.05, min_tokens=4)),
}


def streamed_choices(http: httpx.Client, body: dict) -> dict[int, dict]:
    """Per completion index: its streamed text, finish and stop reasons, and token logprobs."""
    choices: dict[int, dict] = {}
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
        expect_status(response)
        for chunk in chunks_of(response.iter_lines()):
            for c in chunk["choices"]:
                mine = choices.setdefault(c["index"], {"text": "", "logprobs": []})
                mine["text"] += c["text"]
                mine["logprobs"] += (c["logprobs"] or {}).get("token_logprobs", [])
                if c["finish_reason"]:
                    mine["finish_reason"], mine["stop_reason"] = c["finish_reason"], c["stop_reason"]
    return choices


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_sampling_fields_map_to_samplingparams(http, llm, case):
    fields, kwargs = SAMPLING_CASES[case]
    expected = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, **kwargs), use_tqdm=False)[0].outputs
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12} | fields
    whole = answer(http.post("/v1/completions", json=body))
    streamed = streamed_choices(http, body)
    assert sorted(streamed) == [c.index for c in expected] == [c["index"] for c in whole["choices"]]
    for c, mine in zip(expected, whole["choices"]):
        assert (mine["text"], mine["finish_reason"], mine["stop_reason"]) == (c.text, c.finish_reason, c.stop_reason)
        assert (streamed[c.index]["text"], streamed[c.index]["finish_reason"]) == (c.text, c.finish_reason)
        if c.logprobs is not None:
            chosen = [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)]
            assert mine["logprobs"]["token_logprobs"] == pytest.approx(chosen)
            assert streamed[c.index]["logprobs"] == pytest.approx(chosen)
            assert all(len(top) == 2 for top in mine["logprobs"]["top_logprobs"])
    assert whole["usage"]["completion_tokens"] == sum(len(c.token_ids) for c in expected)


def test_prompt_logprobs_and_chat_logprobs(http, llm):
    prompt = [11, 12, 13, 14]
    expected = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1, logprobs=1),
                            use_tqdm=False)[0]
    whole = answer(http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3,
                                                      "temperature": 0, "prompt_logprobs": 1}))
    got = whole["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(prompt)
    assert [entry[str(t)]["logprob"] for t, entry in zip(prompt[1:], got[1:])] == \
        pytest.approx([entry[t].logprob for t, entry in zip(prompt[1:], expected.prompt_logprobs[1:])])
    chat = answer(http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 3, "temperature": 0, "logprobs": True,
                                                          "top_logprobs": 2}))
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] == 3
    assert all(len(t["top_logprobs"]) == 2 and t["top_logprobs"][0]["logprob"] >= t["logprob"] for t in content)


# ---- the load generator ----

def result(ttft: float, tpot: float, tokens: int = 11) -> RequestResult:
    """A request sent at 0 whose chunks came at ttft, then every tpot seconds."""
    return RequestResult(tokens, 0.0, [ttft + k * tpot for k in range(tokens)], tokens)


def test_summary_and_slo_at_p99():
    fast = [result(0.1, 0.01) for _ in range(99)]
    summary = summarize(fast + [result(0.1, 0.01)], elapsed=10.0, slo=SLO())
    assert summary["slo_met"] and summary["goodput"] == 10.0 and summary["slo_fraction"] == 1.0
    assert summary["tpot"]["p50"] == pytest.approx(0.01) and summary["ttft"]["p99"] == pytest.approx(0.1)
    assert summary["output_throughput"] == 110.0 and summary["request_throughput"] == 10.0
    one_slow = summarize(fast + [result(2.0, 0.01)], 10.0, SLO())  # 1 user in 100 may wait: p99 still holds
    assert one_slow["slo_met"] and one_slow["goodput"] == 9.9
    two_slow = summarize(fast[:98] + [result(2.0, 0.01)] * 2, 10.0, SLO())  # 2 in 100: p99 is 2 s
    assert not two_slow["slo_met"] and two_slow["ttft"]["p99"] == pytest.approx(2.0)
    slow_tokens = summarize(fast + [result(0.1, 0.03)] * 2, 10.0, SLO())  # 30 ms a token is 33 tok/s
    assert not slow_tokens["slo_met"] and slow_tokens["slo_fraction"] == pytest.approx(99 / 101)
    failed = summarize(fast + [RequestResult(5, error="HTTP 503")], 10.0, SLO())
    assert not failed["slo_met"] and failed["failed"] == 1 and failed["errors"] == ["HTTP 503"]


def test_bench_serve_end_to_end(server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # results and figure land under tmp_path
    payload = bench_serve([server[0]], concurrency=[1, 4], workload="tiny", requests=6, labels=["mine"],
                          results="serving_test", figure="serving_test", timeout=TIMEOUT, deadline=TIMEOUT)
    run = payload["runs"]["concurrency"]["mine"]
    assert [lv["concurrency"] for lv in run["levels"]] == [1, 4]
    for lv in run["levels"]:
        assert lv["completed"] == lv["requests"] == 6 and lv["failed"] == 0, \
            f"{lv['failed']} of {lv['requests']} requests failed at concurrency {lv['concurrency']}: {lv['errors']}"
    assert run["server"]["model"] == MODEL and run["server"]["scheduler"] == "continuous"
    assert json.loads((tmp_path / "benchmarks/results/serving_test.json").read_text()) == payload
    assert (tmp_path / "figures/serving_test.png").stat().st_size > 0


# ---- Exercise 10.1: streaming deltas, checked without a server ----

def cumulative_outputs(steps: list[list[tuple[str, int, str | None]]]) -> list[RequestOutput]:
    """Engine outputs from a script: steps[k][i] = (text, number of tokens, finish reason) of
    completion i after step k. Token ids are 100 + position."""
    outputs = []
    for step in steps:
        completions = [CompletionOutput(i, text, [100 + j for j in range(n)], finish_reason=reason,
                                        stop_reason="\n" if reason == "stop" else None)
                       for i, (text, n, reason) in enumerate(step)]
        outputs.append(RequestOutput("r", None, [1, 2], completions[::-1], all(r for _, _, r in step)))
    return outputs


# Completion 0 ends at step 3 with a stop string; completion 1's second token is half a
# character (no new text yet) and it ends at step 4 with its length. Once done, a completion
# keeps appearing, as it ended, in the outputs of the request.
SCRIPT = [
    [("def", 1, None), ("é", 1, None)],
    [("def f", 2, None), ("é", 2, None)],
    [("def f()", 3, "stop"), ("é🙂", 3, None)],
    [("def f()", 3, "stop"), ("é🙂!", 4, "length")],
]


def test_deltas_add_up_to_each_completion():
    state, deltas = StreamState(), []
    for output in cumulative_outputs(SCRIPT):
        step = new_deltas(output, state)
        assert [d.index for d in step] == sorted(d.index for d in step)
        assert new_deltas(output, state) == [], "the same output sent twice"
        deltas += step
    for i, (text, n, reason) in enumerate(SCRIPT[-1]):
        mine = [d for d in deltas if d.index == i]
        assert "".join(d.text for d in mine) == text
        assert sum((d.token_ids for d in mine), []) == [100 + j for j in range(n)]
        assert [d.first_token for d in mine] == [sum(len(d.token_ids) for d in mine[:k]) for k in range(len(mine))]
        assert [d.finish_reason for d in mine] == [None] * (len(mine) - 1) + [reason]
        assert mine[-1].stop_reason == ("\n" if reason == "stop" else None)
    assert [d.text for d in deltas if d.index == 1] == ["é", "", "🙂", "!"]  # a chunk per step, text or not


def test_a_finished_completion_without_new_text_still_sends_its_finish():
    (delta,) = new_deltas(cumulative_outputs([[("ab", 2, "length")]])[0], StreamState(text_sent={0: 2}, tokens_sent={0: 2}))
    assert (delta.text, delta.token_ids, delta.finish_reason) == ("", [], "length")


def test_event_stream_framing():
    outputs = cumulative_outputs([[("h", 1, None)], [("hi", 2, "length")]])

    async def collect() -> list[str]:
        async def agen():
            for o in outputs:
                yield 0, o  # (prompt index, output)
        return [e async for e in stream_events(agen(), Chunks("cmpl-1", 0, MODEL, chat=True), include_usage=True)]

    events = asyncio.run(collect())
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events) and events[-1] == DONE
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:-1]] == ["h", "i"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 2,
                                                                   "total_tokens": 4}
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'


@pytest.mark.ch11  # the server's default engine is chapter 11's, with the prefix cache on
def test_serve_flags_reach_the_engine(tiny_checkpoint):
    """`minivllm serve` passes vLLM's --enforce-eager and --[no-]enable-prefix-caching through, and
    leaves the rest to the engine's own per-device choice."""
    from minivllm.entrypoints.cli import build_parser, engine_options
    from minivllm.config import engine as engine_config
    from minivllm.core.prefix_cache import PrefixCachingBlockManager

    def options(*flags: str) -> dict:
        return engine_options(build_parser().parse_args(["serve", "--model", str(tiny_checkpoint), *flags]))

    assert options()["attention"] is None and options()["cuda_graphs"] is None
    assert options()["enable_prefix_caching"] is None
    assert options("--enforce-eager")["cuda_graphs"] is False
    assert options("--no-enable-prefix-caching")["enable_prefix_caching"] is False
    assert options("--enable-prefix-caching")["enable_prefix_caching"] is True
    engine = LLMEngine(str(tiny_checkpoint), **options("--no-enable-prefix-caching", "--device", "cpu"))
    assert not isinstance(engine.core.block_manager, PrefixCachingBlockManager)
    engine = LLMEngine(str(tiny_checkpoint), **options("--device", "cpu"))  # the engine's default: on from chapter 11
    assert isinstance(engine.core.block_manager, PrefixCachingBlockManager) == engine_config.PREFIX_CACHING_DEFAULT


def test_streamed_completion_logprobs_equal_the_whole_answers(http):
    """Chunk by chunk, the legacy logprobs (tokens, their logprobs and text offsets) add up to
    those of the same request answered whole."""
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "logprobs": 2}
    whole = answer(http.post("/v1/completions", json=body))["choices"][0]["logprobs"]
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
        expect_status(response)
        for chunk in chunks_of(response.iter_lines()):
            logprobs = chunk["choices"][0]["logprobs"]
            for key in streamed:
                streamed[key] += logprobs[key] if logprobs else []
    assert len(whole["tokens"]) == 12
    assert {key: whole[key] for key in streamed} == streamed
