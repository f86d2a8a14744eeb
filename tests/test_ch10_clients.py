"""Chapter 10: the server as real clients use it, through the official openai client. Batched
prompts (texts and token-id lists, n > 1, streamed and not) answer choice p * n + i with what
LLM.generate gives prompt p; echo returns the prompt, and its logprobs equal transformers'
log-softmax of the prompt (the first null), also with max_tokens 0 (how lm-evaluation-harness
scores loglikelihoods); a max_tokens the context cannot hold and logprobs above --max-logprobs
are 400s with OpenAI's error body, and the server keeps serving; --api-key (or
MINIVLLM_API_KEY) closes /v1 to requests without the key, and leaves /health and /metrics open.

Servers run in a thread on 127.0.0.1 (a port the OS picks) on the embedded model and its real
tokenizer; the reference is the same checkpoint loaded by transformers. Every wait is bounded.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections import defaultdict

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from minivllm import DEFAULT_MODEL, LLM, LLMEngine, SamplingParams, load_tokenizer
from minivllm.request.outputs import CompletionOutput, RequestOutput
from minivllm.entrypoints.openai import threaded
from minivllm.entrypoints.openai.auth import APIKeyMiddleware
from minivllm.entrypoints.openai.responses import Echo
from minivllm.entrypoints.openai.sse import Chunks, stream_events

pytestmark = [pytest.mark.ch10, pytest.mark.floors]

MODEL = "tiny-clients"
ENGINE = dict(num_kv_blocks=256, max_num_seqs=64)
TEXTS = ["import os\n\ndef list_files(path):\n    return", "class Stack:\n    def push(self, item):", "x = ["]
IDS = [[101, 7, 2050, 33, 912], [5, 6, 7], [3000, 14, 15, 16, 17, 18, 19, 20]]
CONTEXT = 512  # the embedded model's max_model_len
TIMEOUT = 60  # seconds any one client call may take


@pytest.fixture(scope="module")
def llm(default_model) -> LLM:
    """The offline engine on the same weights: what the server's choices must equal."""
    return LLM(default_model, tokenizer=load_tokenizer(), **ENGINE)


@pytest.fixture(scope="module")
def hf():
    """The embedded checkpoint in transformers, and its tokenizer: the reference for logprobs."""
    return (AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def server(default_model):
    with threaded.running_server(LLMEngine(default_model, tokenizer=load_tokenizer(), **ENGINE), MODEL) as running:
        yield running


def client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=TIMEOUT)


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits in float64: row j is the distribution of token j + 1."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].double().log_softmax(-1)


def streamed(chunks) -> dict[int, dict]:
    """Per choice index: the text and legacy logprobs its chunks add up to, and how it finished."""
    choices: dict[int, dict] = defaultdict(lambda: {"text": "", "tokens": [], "token_logprobs": [], "text_offset": [],
                                                    "finish_reason": None})
    for chunk in chunks:
        for c in chunk.choices:
            mine = choices[c.index]
            assert mine["finish_reason"] is None, "a chunk after the choice finished"
            mine["text"] += c.text
            for key in ("tokens", "token_logprobs", "text_offset"):
                mine[key] += getattr(c.logprobs, key) if c.logprobs else []
            mine["finish_reason"] = c.finish_reason
    return dict(choices)


# ---- batched prompts ----

@pytest.mark.parametrize("prompts", [TEXTS, IDS], ids=["texts", "token-id lists"])
def test_batched_prompts_answer_choice_p_times_n_plus_i_with_what_generate_gives(server, llm, prompts):
    params = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=6, ignore_eos=True)
    expected = llm.generate(prompts, params, use_tqdm=False)
    want = {p * 2 + c.index: c.text for p, out in enumerate(expected) for c in out.outputs}
    assert len(set(want.values())) > len(prompts), "the completions of a prompt should differ"
    body = dict(model=MODEL, prompt=prompts, n=2, temperature=0.9, seed=5, max_tokens=6,
                extra_body={"ignore_eos": True})
    whole = client(server[0]).completions.create(**body)
    assert [c.index for c in whole.choices] == list(range(2 * len(prompts)))
    assert {c.index: c.text for c in whole.choices} == want
    assert whole.usage.prompt_tokens == sum(len(out.prompt_token_ids) for out in expected)
    assert whole.usage.completion_tokens == 6 * 2 * len(prompts)
    chunks = list(client(server[0]).completions.create(**body, stream=True, stream_options={"include_usage": True}))
    got = streamed(chunks)
    assert {i: c["text"] for i, c in got.items()} == want
    assert all(c["finish_reason"] == "length" for c in got.values())
    assert len({chunk.id for chunk in chunks}) == 1 and chunks[-1].usage == whole.usage  # summed over the prompts


def test_a_list_of_token_ids_is_one_prompt_and_a_list_of_lists_is_a_batch(server, llm):
    greedy = SamplingParams(temperature=0, max_tokens=5)
    one = client(server[0]).completions.create(model=MODEL, prompt=IDS[0], temperature=0, max_tokens=5)
    assert [c.text for c in one.choices] == [llm.generate(IDS[0], greedy, use_tqdm=False)[0].outputs[0].text]
    batch = client(server[0]).completions.create(model=MODEL, prompt=[IDS[0]], temperature=0, max_tokens=5)
    assert [c.text for c in batch.choices] == [c.text for c in one.choices]


BAD_BATCHES = {
    "an empty list": [],
    "an empty prompt in a batch": [[5, 6], []],
    "an empty text in a batch": ["x = ", ""],
    "texts and token ids mixed": ["x = ", [5, 6]],
    "token ids and a text mixed": [[5, 6], "x = "],
    "a bool for a token id": [True, 5],
    "lists three deep": [[[5]]],
    "a token id outside the vocabulary": [[5], [99999]],
}


@pytest.mark.parametrize("case", list(BAD_BATCHES))
def test_a_bad_batch_is_a_400_that_queues_nothing(server, case):
    engine = server[1].state.engine.engine
    with httpx.Client(base_url=server[0], timeout=TIMEOUT, trust_env=False) as http:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": BAD_BATCHES[case], "max_tokens": 2})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "prompt" and error["type"] == "invalid_request_error" and error["message"]
        if case.startswith(("an empty prompt", "an empty text", "a token id")):
            assert error["message"].startswith("prompt 1: ")  # which prompt of the batch
        assert not engine.requests
        good = http.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2})
        assert good.status_code == 200 and len(good.json()["choices"]) == 2


def finished_counts(http: httpx.Client, seconds: float = 20) -> dict[str, float]:
    """Once nothing runs or waits: how many requests finished, by reason, and the tokens generated."""
    deadline = time.monotonic() + seconds
    while True:
        values = {s.name + "".join(f"{{{v}}}" for v in s.labels.values()): s.value
                  for family in text_string_to_metric_families(http.get("/metrics").text) for s in family.samples}
        if values["minivllm_num_requests_running"] == values["minivllm_num_requests_waiting"] == 0:
            return {"abort": values.get("minivllm_requests_finished_total{abort}", 0),
                    "length": values.get("minivllm_requests_finished_total{length}", 0),
                    "tokens": values["minivllm_generation_tokens_total"]}
        assert time.monotonic() < deadline, f"still busy after {seconds} s"
        time.sleep(0.05)


def test_a_batch_refused_halfway_takes_back_the_prompts_already_queued(default_model):
    """One request runs at a time and two may wait, so a batch of four finds the queue full: the
    whole request is a 503, and the prompts the engine took are aborted, never run to their end."""
    engine = LLMEngine(default_model, tokenizer=load_tokenizer(), num_kv_blocks=256, max_num_seqs=1)
    with threaded.running_server(engine, MODEL, max_waiting=2) as (url, _), \
            httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False) as http:
        body = {"model": MODEL, "prompt": IDS + [[9, 9]], "max_tokens": 400, "ignore_eos": True}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 503 and "max_waiting" in response.json()["error"]["message"]
        counts = finished_counts(http)
        assert counts["length"] == 0 and counts["abort"] in (2, 3) and counts["tokens"] < 400
        assert engine.core.block_manager.num_free == engine.core.block_manager.num_blocks
        assert http.post("/v1/completions", json=body | {"prompt": IDS[:2], "max_tokens": 2}).status_code == 200


def test_disconnecting_from_a_streamed_batch_aborts_every_prompt(server):
    engine = server[1].state.engine.engine
    body = {"model": MODEL, "prompt": IDS, "n": 2, "temperature": 1.0, "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server[0], timeout=TIMEOUT, trust_env=False) as http:
        before = finished_counts(http)
        with http.stream("POST", "/v1/completions", json=body) as response:
            first = [line for _, line in zip(range(8), response.iter_lines())]
            events = [line for line in first if line.startswith("data: ")]
            # (in a student copy a stub's error comes as one of these events: shown, it names the stub)
            assert len(events) == 4 and not any('"error"' in e for e in events), first
        after = finished_counts(http)  # the connection is closed: the server must notice and abort all three
    assert after["abort"] - before["abort"] == len(IDS) and after["length"] == before["length"]
    assert after["tokens"] - before["tokens"] < 400 * 2 * len(IDS)
    assert engine.core.block_manager.num_free == engine.core.block_manager.num_blocks


def test_interleaved_prompts_stream_under_their_choice_indices():
    """Without a server: two prompts' outputs arriving interleaved (n = 2) become chunks under
    index p * 2 + i, each choice's first chunk led by its prompt (echo), usage summed."""
    def output(prompt: int, texts: list[str], finished: bool) -> RequestOutput:
        completions = [CompletionOutput(i, t, list(range(len(t))), finish_reason="length" if finished else None)
                       for i, t in enumerate(texts)]
        return RequestOutput(f"r-{prompt}", None, [1, 2, 3][:prompt + 1], completions, finished)

    script = [(1, output(1, ["a", "b"], False)), (0, output(0, ["c", ""], False)),
              (1, output(1, ["ab", "bc"], True)), (0, output(0, ["cd", "de"], True))]

    async def events() -> list[str]:
        async def pairs():
            for pair in script:
                yield pair
        chunks = Chunks("cmpl-1", 0, MODEL, chat=False, n=2, echo=[Echo("P:", "P"), Echo("Q:", "Q")])
        return [e async for e in stream_events(pairs(), chunks, include_usage=True)]

    chunks = [json.loads(e.removeprefix("data: ")) for e in asyncio.run(events())[:-1]]
    choices = [c for chunk in chunks[:-1] for c in chunk["choices"]]
    assert [c["index"] for c in choices] == [2, 3, 0, 2, 3, 0, 1]  # completion 1 of prompt 0 had no token yet
    assert [c["text"] for c in choices] == ["Q:a", "Q:b", "P:c", "b", "c", "d", "P:de"]
    assert chunks[-1]["usage"] == {"prompt_tokens": 1 + 2, "completion_tokens": 8, "total_tokens": 11}


# ---- echo ----

def check_prompt_logprobs(logprobs: dict, ids: list[int], reference: torch.Tensor, tokenizer, k: int) -> None:
    """The prompt's part of echoed legacy logprobs against transformers: token i's logprob is
    log_softmax(logits of position i - 1)[token i], its alternatives the top k (and itself)."""
    assert logprobs["tokens"][:len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None  # nothing predicts it
    for i in range(1, len(ids)):
        row = reference[i - 1]
        assert logprobs["token_logprobs"][i] == pytest.approx(float(row[ids[i]]), abs=1e-4)
        top = {tokenizer.decode([t]): float(row[t]) for t in row.topk(k).indices.tolist() + [ids[i]]}
        assert logprobs["top_logprobs"][i] == pytest.approx(top, abs=1e-4)


@pytest.mark.parametrize("prompt", [TEXTS[0], IDS[0]], ids=["text", "token ids"])
def test_echo_returns_the_prompt_and_its_logprobs_equal_transformers(server, llm, hf, prompt):
    hf_model, tokenizer = hf
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    prompt_text = prompt if isinstance(prompt, str) else tokenizer.decode(ids)
    generated = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    reference = hf_logprobs(hf_model, ids + generated.token_ids)
    answer = client(server[0]).completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6, echo=True,
                                                  logprobs=2)
    choice = answer.choices[0]
    assert choice.text == prompt_text + generated.text
    logprobs = choice.logprobs.model_dump()
    assert len(logprobs["tokens"]) == len(ids) + len(generated.token_ids)
    check_prompt_logprobs(logprobs, ids, reference, tokenizer, 2)
    for j, token in enumerate(generated.token_ids):  # then the generated tokens, as without echo
        assert logprobs["token_logprobs"][len(ids) + j] == pytest.approx(float(reference[len(ids) + j - 1, token]),
                                                                         abs=1e-4)
    assert logprobs["text_offset"][len(ids)] == len(prompt_text)  # the completion's text starts after the prompt's
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == len(generated.token_ids)


def test_echo_with_max_tokens_0_scores_the_prompt_without_generating(server, hf):
    """lm-evaluation-harness's loglikelihood request: a batch of prompts, echo, max_tokens 0."""
    hf_model, tokenizer = hf
    answer = client(server[0]).completions.create(model=MODEL, prompt=TEXTS[:2], echo=True, max_tokens=0,
                                                  logprobs=1, temperature=0)
    assert [c.index for c in answer.choices] == [0, 1]
    for prompt, choice in zip(TEXTS, answer.choices):
        ids = tokenizer.encode(prompt)
        assert choice.text == prompt and choice.finish_reason == "length"
        logprobs = choice.logprobs.model_dump()
        assert len(logprobs["tokens"]) == len(ids)
        check_prompt_logprobs(logprobs, ids, hf_logprobs(hf_model, ids), tokenizer, 1)
        # the loglikelihood of the prompt's tail given its head, as the harness sums it
        tail = sum(logprobs["token_logprobs"][3:])
        assert tail == pytest.approx(sum(float(hf_logprobs(hf_model, ids)[i - 1, ids[i]]) for i in range(3, len(ids))),
                                     abs=1e-3)
    assert answer.usage.completion_tokens == 0
    assert answer.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in TEXTS[:2])
    plain = client(server[0]).completions.create(model=MODEL, prompt=IDS[1], echo=True, max_tokens=0)
    assert plain.choices[0].text == tokenizer.decode(IDS[1]) and plain.choices[0].logprobs is None


def test_streamed_echo_sends_the_prompt_first_and_adds_up_to_the_whole_answer(server, hf):
    _, tokenizer = hf
    texts = TEXTS[1:]
    ids = [tokenizer.encode(text) for text in texts]
    body = dict(model=MODEL, prompt=texts, n=2, temperature=0.8, seed=3, max_tokens=5, echo=True,
                logprobs=1, extra_body={"ignore_eos": True})
    whole = client(server[0]).completions.create(**body)
    chunks = list(client(server[0]).completions.create(**body, stream=True))
    got = streamed(chunks)
    assert sorted(got) == [c.index for c in whole.choices] == [0, 1, 2, 3]
    for choice in whole.choices:
        mine = got[choice.index]
        assert choice.text.startswith(texts[choice.index // 2])
        assert (mine["text"], mine["finish_reason"]) == (choice.text, choice.finish_reason)
        assert (mine["tokens"], mine["text_offset"]) == (choice.logprobs.tokens, choice.logprobs.text_offset)
        # The two runs may batch differently, so fp32 sums round differently: logprobs agree to 1e-4.
        assert mine["token_logprobs"] == pytest.approx(choice.logprobs.token_logprobs, abs=1e-4)
    firsts = {}
    for chunk in chunks:
        for c in chunk.choices:
            firsts.setdefault(c.index, c)
    for index, first in firsts.items():  # each choice's first chunk: the whole prompt, its logprobs first
        prompt = index // 2
        assert first.text.startswith(texts[prompt])
        assert first.logprobs.tokens[:len(ids[prompt])] == [tokenizer.decode([t]) for t in ids[prompt]]
        assert first.logprobs.token_logprobs[0] is None
    scored = streamed(client(server[0]).completions.create(**(body | {"max_tokens": 0}), stream=True))
    assert {i: c["text"] for i, c in scored.items()} == {i: texts[i // 2] for i in range(4)}
    assert {i: len(c["tokens"]) for i, c in scored.items()} == {i: len(ids[i // 2]) for i in range(4)}
    assert all(c["finish_reason"] == "length" for c in scored.values())


# ---- limits: 400s with OpenAI's error body, and the server keeps serving ----

LONG = list(range(1000, 1500))  # 500 tokens: 12 left in the context


def assert_400(call, param: str, *fragments: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and error["type"] == "invalid_request_error"
    for fragment in fragments:
        assert fragment in error["message"]


def test_max_tokens_beyond_the_context_is_a_400_with_vllms_message(server):
    c = client(server[0])
    assert_400(lambda: c.completions.create(model=MODEL, prompt=LONG, max_tokens=13), "max_tokens",
               "'max_tokens' or 'max_completion_tokens' is too large: 13. This model's maximum context length is "
               "512 tokens and your request has 500 input tokens (13 > 512 - 500).")
    assert_400(lambda: c.completions.create(model=MODEL, prompt="x", max_tokens=10**9), "max_tokens", "too large")
    assert_400(lambda: c.completions.create(model=MODEL, prompt=[IDS[0], LONG], max_tokens=13), "max_tokens",
               "prompt 1: ", "500 input tokens")
    fits = c.completions.create(model=MODEL, prompt=LONG, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert fits.usage.completion_tokens == 12  # 500 + 12 = 512: exactly the context
    rest = c.completions.create(model=MODEL, prompt=LONG, max_tokens=None, temperature=0,
                                extra_body={"ignore_eos": True})
    assert (rest.usage.completion_tokens, rest.choices[0].finish_reason) == (12, "length")  # None: what is left


def test_chat_max_tokens_beyond_the_context_is_a_400(default_model):
    tokenizer = load_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the content alone
    content = "def f(x):\n" + "    x = x + 1\n" * 80
    n = len(tokenizer.encode(content, add_special_tokens=False))
    assert 400 < n < CONTEXT - 4
    with threaded.running_server(LLMEngine(default_model, tokenizer=tokenizer, num_kv_blocks=64), MODEL) as (url, _):
        c = client(url)
        messages = [{"role": "user", "content": content}]
        assert_400(lambda: c.chat.completions.create(model=MODEL, messages=messages, max_tokens=CONTEXT - n + 1),
                   "max_tokens", f"your request has {n} input tokens ({CONTEXT - n + 1} > {CONTEXT} - {n})")
        assert_400(lambda: c.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10**9),
                   "max_completion_tokens", "too large: 1000000000")
        ok = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=CONTEXT - n, temperature=0,
                                       extra_body={"ignore_eos": True})
        assert ok.usage.completion_tokens == CONTEXT - n  # exactly the context


def test_logprobs_above_max_logprobs_are_400s(server):
    c = client(server[0])
    assert_400(lambda: c.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=1000), "logprobs",
               "Requested sample logprobs of 1000, which is greater than max allowed: 20")
    assert_400(lambda: c.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=21), "logprobs", "21")
    assert_400(lambda: c.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"prompt_logprobs": 21}),
               "prompt_logprobs", "Requested prompt logprobs of 21")
    assert_400(lambda: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                 logprobs=True, top_logprobs=21), "top_logprobs", "max allowed: 20")
    answer = c.completions.create(model=MODEL, prompt="x = ", max_tokens=2, temperature=0, logprobs=20)
    # the top 20 by their texts (two tokens may decode alike: a byte of a character each)
    assert all(1 < len(top) <= 20 for top in answer.choices[0].logprobs.top_logprobs)


def test_max_logprobs_is_the_servers_setting(default_model):
    with threaded.running_server(LLMEngine(default_model, tokenizer=load_tokenizer(), num_kv_blocks=64), MODEL,
                                 max_logprobs=3) as (url, _):
        c = client(url)
        assert_400(lambda: c.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=4), "logprobs",
                   "max allowed: 3")
        answer = c.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=3,
                                      extra_body={"ignore_eos": True})
        assert len(answer.choices[0].logprobs.tokens) == 2
    for bad in (-2, 2.0, True, "20"):  # (-1 lifts the cap, as in vLLM)
        with pytest.raises(ValueError, match="max_logprobs"):
            threaded.build_app(LLMEngine(default_model, num_kv_blocks=8), MODEL, max_logprobs=bad)


# ---- --api-key ----

KEY = "sk-minivllm-test-key"


def check_access(url: str, key: str) -> None:
    """/v1 answers 401 without the key or with a wrong one, 200 with it; /health and /metrics are open."""
    messages = [{"role": "user", "content": "x"}]
    for wrong in ("wrong", KEY + "x", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError) as caught:
            client(url, wrong).completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    with httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False) as http:
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                             ("GET", "/v1/nothing-here")):
            response = http.request(method, path, json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
            assert response.json()["error"]["type"] == "invalid_request_error"
            assert http.request(method, path, headers={"Authorization": f"Basic {key}"}).status_code == 401
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        assert http.get("/v1/models", headers={"Authorization": f"bearer {key}"}).status_code == 200
    good = client(url, key)
    assert good.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).usage.completion_tokens == 2
    assert len(list(good.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True))) >= 1
    assert good.models.list().data[0].id == MODEL
    with pytest.raises(openai.BadRequestError, match="chat template"):  # through the door, then refused for itself
        good.chat.completions.create(model=MODEL, messages=messages)


def test_api_key_closes_v1_and_leaves_health_and_metrics_open(default_model):
    with threaded.running_server(LLMEngine(default_model, tokenizer=load_tokenizer(), num_kv_blocks=64), MODEL,
                                 api_key=KEY) as (url, _):
        check_access(url, KEY)


def test_api_key_from_the_environment_variable(default_model, monkeypatch):
    from minivllm.entrypoints.cli import build_parser, server_options

    monkeypatch.setenv("MINIVLLM_API_KEY", KEY)
    options = server_options(build_parser().parse_args(["serve"]))
    assert options["api_key"] == KEY
    assert server_options(build_parser().parse_args(["serve", "--api-key", "other"]))["api_key"] == "other"
    with threaded.running_server(LLMEngine(default_model, tokenizer=load_tokenizer(), num_kv_blocks=64), MODEL,
                                 **options) as (url, _):
        check_access(url, KEY)
    monkeypatch.setenv("MINIVLLM_API_KEY", "")
    assert server_options(build_parser().parse_args(["serve"]))["api_key"] is None  # empty: no key, an open server
    monkeypatch.delenv("MINIVLLM_API_KEY")
    assert server_options(build_parser().parse_args(["serve"]))["api_key"] is None


def test_keys_are_compared_in_constant_time_on_digests(monkeypatch):
    """Every check goes through hmac.compare_digest, on two 32-byte SHA-256 digests: the time it
    takes depends on neither how much of a guess is right nor how long the key is."""
    compared, compare = [], hmac.compare_digest

    def spy(a, b):
        compared.append((len(a), len(b)))
        return compare(a, b)

    monkeypatch.setattr("minivllm.entrypoints.openai.auth.hmac.compare_digest", spy)
    middleware = APIKeyMiddleware(None, KEY)

    def scope(value: bytes | None) -> dict:
        return {"headers": [] if value is None else [(b"authorization", value)]}

    assert middleware.authorized(scope(f"Bearer {KEY}".encode()))
    for wrong in (b"Bearer x", f"Bearer {KEY}{KEY}".encode(), f"Bearer {KEY[:-1]}".encode(), b"", None):
        assert not middleware.authorized(scope(wrong))
    assert compared == [(32, 32)] * 6


@pytest.mark.parametrize("bad", ["", "has space", "ключ", "tab\there", 12345, b"bytes"])
def test_keys_a_client_cannot_send_are_refused(default_model, bad):
    with pytest.raises(ValueError, match="API key"):
        threaded.build_app(LLMEngine(default_model, num_kv_blocks=8), MODEL, api_key=bad)


def test_serve_flags_reach_the_app():
    from minivllm.entrypoints.cli import build_parser, server_options

    options = server_options(build_parser().parse_args(["serve", "--max-logprobs", "5", "--api-key", KEY,
                                                        "--scheduler", "static", "--static-batch-size", "4",
                                                        "--max-request-bytes", "1000"]))
    assert options == {"max_waiting": 512, "static_batch_size": 4, "max_logprobs": 5, "api_key": KEY,
                       "max_request_bytes": 1000, "root_path": "", "return_tokens_as_token_ids": False,
                       "enable_force_include_usage": False, "enable_prompt_tokens_details": False,
                       "enable_per_request_metrics": False, "trust_request_chat_template": False}
    assert server_options(build_parser().parse_args(["serve", "--trust-request-chat-template"]))[
        "trust_request_chat_template"] is True
    assert server_options(build_parser().parse_args(["serve"]))["max_request_bytes"] == 4 * 2**20
    assert server_options(build_parser().parse_args(["serve"]))["max_logprobs"] == 20  # vLLM's default
