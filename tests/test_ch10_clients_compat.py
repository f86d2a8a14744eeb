"""Issue 36: the server as clients nobody here wrote use it. What vLLM accepts is accepted
(`null` for "not given", vLLM's extra fields; the older guided_* names in test_ch13_serving.py); what minivllm cannot
honour is a 400 that names the field; vLLM's side endpoints round-trip; every error has OpenAI's
shape, 404 and 405 included; lm-evaluation-harness's `local-completions` requests, sent exactly
as it sends them, give transformers' loglikelihoods; guidellm's streaming request gets usage in
every chunk; a 2 MB prompt does not stall /health and a 20 MB body is refused before it is read;
/metrics carries vLLM's names.

The server runs in a thread on 127.0.0.1 with an OS-chosen port, on the embedded model; every
wait is bounded.
"""
from __future__ import annotations

import logging
import threading
import time

import httpx
import pytest
import torch
from server_checks import MODEL, TIMEOUT, answer, chunks_of, expect_status, metric_values
from transformers import AutoModelForCausalLM

from minivllm import DEFAULT_MODEL, LLMEngine, load_tokenizer
from minivllm.entrypoints.openai import threaded

pytestmark = [pytest.mark.ch10, pytest.mark.floors]

ENGINE = dict(num_kv_blocks=128, max_num_seqs=16)
PROMPT = "def fibonacci(n):\n    "


@pytest.fixture(scope="module")
def server(default_model, chat_tokenizer):
    engine = LLMEngine(default_model, tokenizer=chat_tokenizer, **ENGINE)
    with threaded.running_server(engine, MODEL) as (url, _):
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
            yield http


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def complete(http: httpx.Client, **fields) -> dict:
    return answer(http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 6,
                                                      "temperature": 0} | fields))


def refusal(http: httpx.Client, path: str, body: dict, status: int = 400) -> str:
    """The message of an answer that must be a `status` in OpenAI's error shape."""
    response = http.post(path, json=body)
    expect_status(response, status)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error["message"]


# ---- what vLLM accepts ----

def test_null_means_not_given(server):
    plain = complete(server)["choices"][0]["text"]
    nulls = dict.fromkeys(("suffix", "logit_bias", "best_of", "tools", "tool_choice", "parallel_tool_calls", "user",
                           "stop", "seed", "presence_penalty", "top_p", "n", "stream_options", "logprobs"))
    assert complete(server, **nulls)["choices"][0]["text"] == plain
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    reference = answer(server.post("/v1/chat/completions", json=chat))["choices"][0]["message"]["content"]
    with_nulls = chat | {k: None for k in ("tools", "tool_choice", "parallel_tool_calls", "logit_bias", "top_logprobs",
                                          "response_format", "max_completion_tokens", "frequency_penalty")}
    assert answer(server.post("/v1/chat/completions", json=with_nulls))["choices"][0]["message"]["content"] == reference


def test_vllm_extra_fields_do_what_they_say(server, tokenizer):
    ids = tokenizer.encode(PROMPT)
    plain = complete(server)
    # truncate_prompt_tokens keeps the prompt's last k tokens: the same as sending those tokens
    cut = complete(server, truncate_prompt_tokens=4)
    assert cut["usage"]["prompt_tokens"] == 4
    assert cut["choices"][0]["text"] == complete(server, prompt=ids[-4:])["choices"][0]["text"]
    # accepted as vLLM's defaults (or, for priority, accepted and ignored: first come, first served)
    same = complete(server, skip_special_tokens=True, add_special_tokens=True, priority=5, min_tokens=2,
                    store=False, metadata={"who": "test"})
    assert same["choices"][0]["text"] == plain["choices"][0]["text"]
    assert complete(server, request_id="my-id-1")["id"] == "cmpl-my-id-1"
    # add_special_tokens=false: the text's tokens alone (this tokenizer adds none, so the same count)
    assert complete(server, add_special_tokens=False)["usage"]["prompt_tokens"] == len(
        tokenizer.encode(PROMPT, add_special_tokens=False))


def test_ignored_fields_are_named_in_a_warning(server, caplog):
    with caplog.at_level(logging.WARNING, logger="minivllm.entrypoints.openai"):
        complete(server, store=True, service_tier="auto")
    assert any("ignored" in r.getMessage() and "service_tier" in r.getMessage() and "store" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("fields, named", [
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": "x"}, "bad_words"),
    ({"suffix": "end"}, "suffix"),
    ({"cache_salt": "s"}, "cache_salt"),
    ({"best_of": 3}, "best_of"),
    ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": "3"}, "truncate_prompt_tokens"),
    ({"priority": "high"}, "priority"),
    ({"request_id": 7}, "request_id"),
    ({"temperature": "0"}, "temperature"),
    ({"guided_choice": ["a"], "structured_outputs": {"regex": "b"}}, "guided_"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"max_tokenz": 3}, "max_tokenz"),  # a typo is no field vLLM knows either: refused, not silently ignored
])
def test_what_cannot_be_honoured_is_a_400_naming_it(server, fields, named):
    assert named in refusal(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2} | fields)
    assert complete(server, max_tokens=1)["choices"][0]["finish_reason"] == "length"  # still serving


# ---- side endpoints and errors ----

def test_side_endpoints_round_trip(server, tokenizer, chat_tokenizer):
    tokens = answer(server.post("/tokenize", json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True}))
    assert tokens["tokens"] == tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
    assert tokens["token_strs"] == tokenizer.convert_ids_to_tokens(tokens["tokens"])
    assert tokens["max_model_len"] == 512
    assert answer(server.post("/detokenize", json={"tokens": tokens["tokens"]}))["prompt"] == PROMPT
    messages = [{"role": "user", "content": "hi"}]
    chat = answer(server.post("/tokenize", json={"messages": messages}))
    text = chat_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == chat_tokenizer.encode(text, add_special_tokens=False)
    info = answer(server.get("/tokenizer_info"))
    assert info["eos_token"] == tokenizer.eos_token and info["eos_token_id"] == tokenizer.eos_token_id
    assert info["chat_template"] == chat_tokenizer.chat_template
    assert isinstance(answer(server.get("/version"))["version"], str)
    card = answer(server.get(f"/v1/models/{MODEL}"))
    assert card["id"] == MODEL and card == answer(server.get("/v1/models"))["data"][0]
    assert "vocabulary" in refusal(server, "/detokenize", {"tokens": [10**9]})
    assert "prompt" in refusal(server, "/tokenize", {"prompt": "a", "messages": messages})


def test_every_error_has_openais_shape(server):
    for response, status in ((server.get("/v1/nothing"), 404), (server.get("/v1/models/gpt-4"), 404),
                             (server.get("/v1/completions"), 405), (server.delete("/health"), 405)):
        expect_status(response, status)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


# ---- the clients' own request shapes ----

def test_lm_eval_local_completions_loglikelihoods_equal_transformers(server):
    """lm-evaluation-harness 0.4.13's `local-completions`, as it talks to vLLM: it probes
    /tokenizer_info (wanting `eos_token`) and /tokenize, tokenizes context and continuation
    through /tokenize, sends the batch as token-id lists with echo, logprobs=1, max_tokens=1,
    temperature 0 and a seed, and sums token_logprobs[ctxlen:-1] (the last is the generated token)."""
    assert "eos_token" in answer(server.get("/tokenizer_info"))
    assert isinstance(answer(server.post("/tokenize", json={"prompt": "test", "add_special_tokens": False}))["tokens"],
                      list)
    pairs = [("The capital of France is", " Paris"), ("def add(a, b):\n    return", " a + b")]
    encode = lambda text: answer(server.post("/tokenize", json={"prompt": text, "add_special_tokens": False}))["tokens"]
    batch = [(encode(ctx), encode(cont)) for ctx, cont in pairs]
    body = {"model": MODEL, "prompt": [c + k for c, k in batch], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    choices = sorted(answer(server.post("/v1/completions", json=body))["choices"], key=lambda c: c["index"])
    hf_model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    for choice, (context, continuation) in zip(choices, batch):
        served = sum(choice["logprobs"]["token_logprobs"][len(context):-1])
        ids = context + continuation
        with torch.no_grad():
            logprobs = hf_model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
        reference = sum(float(logprobs[i - 1, ids[i]]) for i in range(len(context), len(ids)))
        assert served == pytest.approx(reference, abs=1e-4)


def test_guidellm_streaming_request_gets_usage_in_every_chunk(server):
    """guidellm 0.8.1's text-completions request, as it sends it: stream_options with
    continuous_usage_stats, `stop: null`, ignore_eos and max_tokens."""
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": 8, "stop": None, "ignore_eos": True, "prompt": PROMPT}
    with server.stream("POST", "/v1/completions", json=body) as response:
        expect_status(response)
        chunks = list(chunks_of(response.iter_lines()))
    text_chunks, last = chunks[:-1], chunks[-1]
    assert text_chunks and all("usage" in c for c in text_chunks)
    counts = [c["usage"]["completion_tokens"] for c in text_chunks]
    assert counts == sorted(counts) and last["choices"] == [] and last["usage"]["completion_tokens"] == 8
    assert all(c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for c in text_chunks)


# ---- big bodies ----

def test_a_2mb_prompt_does_not_stall_health(server):
    """Tokenizing a 2 MB prompt takes seconds; it happens off the event loop, so /health answers
    meanwhile, and the prompt is then refused (it is far longer than the context)."""
    result = {}

    def send() -> None:
        result["response"] = server.post("/v1/completions", json={"model": MODEL, "prompt": "hello world " * 170_000,
                                                                  "max_tokens": 1})

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(0.3)  # the body is on its way or being tokenized
    waits = []
    while sender.is_alive() and len(waits) < 20:
        start = time.perf_counter()
        expect_status(server.get("/health"))
        waits.append(time.perf_counter() - start)
    sender.join(TIMEOUT)
    expect_status(result["response"], 400)
    assert "max_model_len" in result["response"].json()["error"]["message"]
    assert max(waits, default=0) < 0.5, waits
    assert complete(server, max_tokens=1)["choices"][0]["finish_reason"] == "length"


def test_a_20mb_body_is_refused_before_it_is_read(server):
    start = time.perf_counter()
    response = server.post("/v1/completions", content=b'{"model": "x", "prompt": "' + b"a" * 20_000_000 + b'"}',
                           headers={"content-type": "application/json"})
    elapsed = time.perf_counter() - start
    expect_status(response, 413)
    assert "--max-request-bytes" in response.json()["error"]["message"] and elapsed < 2
    assert complete(server, max_tokens=1)["choices"][0]["finish_reason"] == "length"


def test_metrics_under_vllm_names(server):
    complete(server, max_tokens=3)
    values = metric_values(server)
    label = f"model_name={MODEL}"
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert f"{name}{{{label}}}" in values, name
    assert values[f"vllm:generation_tokens_total{{{label}}}"] == values["minivllm_generation_tokens_total"]
    assert values[f"vllm:prompt_tokens_total{{{label}}}"] == values["minivllm_prompt_tokens_total"]
