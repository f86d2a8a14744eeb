"""Issue 49: vLLM's OpenAI server, field for field. The request fields vLLM accepts do what vLLM's
do (chat's echo, continue_final_message, add_generation_prompt, prompt_logprobs,
return_token_ids, return_tokens_as_token_ids, truncation_side, kv_transfer_params; /tokenize's
continue_final_message and tools; any role, unknown fields inside a message ignored), the
fields vLLM always sends are there (null when unused), stream_options behaves as vLLM's, and
vLLM's routes (/v1/chat/completions/batch, /invocations, /load, /ping) and serve flags
(--root-path, --uds, --return-tokens-as-token-ids, --enable-force-include-usage,
--enable-prompt-tokens-details, --enable-per-request-metrics) and the ORCA load header work.
What cannot be honoured (top_logprobs -1, use_beam_search) is a 400 naming it (logprob_token_ids:
test_ch10_logprob_token_ids.py).

References: the chat template rendered by transformers' own apply_chat_template, logprobs from
transformers' logits in float64, and the server's own answers to the equivalent plain request
(a chat continued from its rendered prompt is the completion of those token ids). Servers run
in a thread on 127.0.0.1 on the embedded model; every wait is bounded.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn
from server_checks import (
    MODEL,
    TIMEOUT,
    answer,
    chunks_of,
    expect_status,
    wait_until_idle,
)
from tiny_models import CHAT_TEMPLATE
from transformers import AutoModelForCausalLM

import minivllm
from minivllm import DEFAULT_MODEL, LLMEngine
from minivllm.entrypoints.openai import threaded
from minivllm.entrypoints.openai.app import build_app

pytestmark = [pytest.mark.ch10, pytest.mark.floors]

ENGINE = {"num_kv_blocks": 128, "max_num_seqs": 16}
# CHAT_TEMPLATE, plus the tool names when a request gives tools (for /tokenize's `tools`)
TEMPLATE = ("{% if tools %}# tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}\n{% endif %}"
            + CHAT_TEMPLATE)
CHAT = [{"role": "user", "content": "write a function"}, {"role": "assistant", "content": "def add(a, b):"}]
KEY = "sk-vllm-fields"


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = minivllm.load_tokenizer()  # its own copy: the template is this module's
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def server(default_model, tokenizer):
    with threaded.running_server(LLMEngine(default_model, tokenizer=tokenizer, **ENGINE), MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0], timeout=TIMEOUT, trust_env=False) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()


def rendered(tokenizer, messages, **options) -> list[int]:
    """transformers' rendering of the messages, as token ids (the template writes its own specials)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
    return tokenizer.encode(text, add_special_tokens=False)


def completion_of(http: httpx.Client, ids: list[int], max_tokens: int) -> dict:
    """The plain completion of these token ids (greedy): what a chat on the same prompt must equal."""
    return answer(http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": max_tokens,
                                                     "temperature": 0, "return_token_ids": True}))["choices"][0]


def chat(client: openai.OpenAI, messages=CHAT, max_tokens: int = 6, **extra):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                          extra_body=extra)


def refused(http: httpx.Client, path: str, body: dict, *fragments: str) -> None:
    response = http.post(path, json=body)
    expect_status(response, 400)
    message = response.json()["error"]["message"]
    assert all(f in message for f in fragments), message


# ---- the chat template's controls ----

def test_continue_final_message_continues_the_last_message_and_echo_returns_it(client, http, tokenizer):
    """The prompt ends inside the assistant's message (transformers' continue_final_message),
    the answer is that prompt's completion, and echo puts the message's text first."""
    ids = rendered(tokenizer, CHAT, continue_final_message=True)
    assert tokenizer.decode(ids).endswith("def add(a, b):")  # not closed: no newline after it
    got = chat(client, continue_final_message=True, add_generation_prompt=False, return_token_ids=True, echo=True)
    expected = completion_of(http, ids, 6)
    assert got.model_extra["prompt_token_ids"] == ids
    choice = got.choices[0]
    assert choice.model_extra["token_ids"] == expected["token_ids"]
    assert choice.message.role == "assistant"
    assert choice.message.content == "def add(a, b):" + expected["text"]
    # continue_final_message alone leaves out the generation prompt too
    assert chat(client, continue_final_message=True, return_token_ids=True).model_extra["prompt_token_ids"] == ids


def test_add_generation_prompt_false_and_the_role_of_the_answer(client, http, tokenizer):
    """Without the generation prompt the model continues after the last message, and the answer
    takes that message's role (vLLM's); echo then starts with that message's text. With it, echo
    of a last message from another role than the answer's adds nothing."""
    messages = CHAT[:1]
    ids = rendered(tokenizer, messages, add_generation_prompt=False)
    assert ids != rendered(tokenizer, messages, add_generation_prompt=True)
    got = chat(client, messages, add_generation_prompt=False, echo=True, return_token_ids=True)
    expected = completion_of(http, ids, 6)
    assert got.model_extra["prompt_token_ids"] == ids
    assert got.choices[0].message.role == "user"
    assert got.choices[0].message.content == "write a function" + expected["text"]
    plain, echoed = chat(client, messages), chat(client, messages, echo=True)
    assert echoed.choices[0].message.content == plain.choices[0].message.content


def test_continue_final_message_with_add_generation_prompt_is_a_400(http):
    body = {"model": MODEL, "messages": CHAT, "continue_final_message": True, "add_generation_prompt": True}
    refused(http, "/v1/chat/completions", body, "continue_final_message", "add_generation_prompt")
    refused(http, "/tokenize", {"model": MODEL, "messages": CHAT, "continue_final_message": True,
                                "add_generation_prompt": True}, "continue_final_message")


def test_any_role_reaches_the_template_and_unknown_message_fields_are_ignored(client, http, tokenizer):
    messages = [{"role": "narrator", "content": "once"}, {"role": "user", "content": "go"}]
    ids = rendered(tokenizer, messages, add_generation_prompt=True)
    noisy = [m | {"tool_call_id": "x", "reasoning_content": "hmm", "weight": 1} for m in messages]
    for sent in (messages, noisy):
        got = answer(http.post("/tokenize", json={"model": MODEL, "messages": sent}))
        assert got["tokens"] == ids
        assert chat(client, sent, return_token_ids=True).model_extra["prompt_token_ids"] == ids
    # a message without content renders as empty (vLLM's), and text parts join with newlines
    assert answer(http.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user"}]}))["tokens"] == \
        rendered(tokenizer, [{"role": "user", "content": ""}], add_generation_prompt=True)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                                          {"type": "text", "text": "b"}]}]
    assert answer(http.post("/tokenize", json={"model": MODEL, "messages": parts}))["tokens"] == \
        rendered(tokenizer, [{"role": "user", "content": "a\nb"}], add_generation_prompt=True)


def test_tokenize_takes_continue_final_message_and_tools(http, tokenizer):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    got = answer(http.post("/tokenize", json={"model": MODEL, "messages": CHAT, "tools": tools,
                                              "continue_final_message": True, "add_generation_prompt": False}))
    expected = rendered(tokenizer, CHAT, tools=tools, continue_final_message=True)
    assert got["tokens"] == expected and "get_weather" in tokenizer.decode(expected)
    plain = answer(http.post("/tokenize", json={"model": MODEL, "messages": CHAT}))
    assert plain["tokens"] == rendered(tokenizer, CHAT, add_generation_prompt=True)


# ---- logprobs and token ids ----

def test_chat_prompt_logprobs_equal_transformers(client, tokenizer, hf_model):
    """prompt_logprobs on chat: null for the first token, then each prompt token's logprob under
    the tokens before it, as transformers computes it (float64 reference); echo alone asks for
    them too (with top_logprobs alternatives, 0 by default), as vLLM does."""
    ids = rendered(tokenizer, CHAT[:1], add_generation_prompt=True)
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    for extra in ({"prompt_logprobs": 2}, {"echo": True}):
        got = chat(client, CHAT[:1], max_tokens=2, **extra).model_extra["prompt_logprobs"]
        assert got[0] is None and len(got) == len(ids)
        for j in range(1, len(ids)):
            entry = got[j]
            assert entry[str(ids[j])]["logprob"] == pytest.approx(reference[j - 1, ids[j]].item(), abs=2e-4)
            assert len(entry) <= extra.get("prompt_logprobs", 0) + 1
    assert chat(client, CHAT[:1], max_tokens=2).model_extra["prompt_logprobs"] is None  # always sent, null


def test_return_tokens_as_token_ids_names_every_token_by_its_id(client, http):
    plain = chat(client, CHAT[:1], logprobs=True, top_logprobs=2, return_token_ids=True)
    named = chat(client, CHAT[:1], logprobs=True, top_logprobs=2, return_token_ids=True,
                 return_tokens_as_token_ids=True)
    token_ids = named.choices[0].model_extra["token_ids"]
    assert token_ids == plain.choices[0].model_extra["token_ids"]
    for tid, a, b in zip(token_ids, plain.choices[0].logprobs.content, named.choices[0].logprobs.content, strict=True):
        assert b.token == f"token_id:{tid}" and b.logprob == a.logprob and bytes(b.bytes) == b.token.encode()
        assert [t.logprob for t in b.top_logprobs] == [t.logprob for t in a.top_logprobs]
        assert all(t.token.startswith("token_id:") for t in b.top_logprobs)
    body = {"model": MODEL, "prompt": "x = [", "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = answer(http.post("/v1/completions", json=body))["choices"][0]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert all(all(k.startswith("token_id:") for k in top) for top in choice["logprobs"]["top_logprobs"][1:])


def test_return_token_ids_on_completions_streamed_and_whole(http, tokenizer):
    body = {"model": MODEL, "prompt": "import os\n", "max_tokens": 5, "temperature": 0, "return_token_ids": True}
    whole = answer(http.post("/v1/completions", json=body))["choices"][0]
    assert whole["prompt_token_ids"] == tokenizer.encode("import os\n")
    assert len(whole["token_ids"]) == 5 and tokenizer.decode(whole["token_ids"]) == whole["text"]
    streamed, prompt_ids = [], []
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
        expect_status(response)
        for chunk in chunks_of(response.iter_lines()):
            streamed += chunk["choices"][0]["token_ids"]
            prompt_ids += chunk["choices"][0].get("prompt_token_ids") or []
    assert streamed == whole["token_ids"] and prompt_ids == whole["prompt_token_ids"]  # the prompt's once


def test_fields_vllm_always_sends_are_there_as_null(http):
    chat_body = answer(http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT[:1], "max_tokens": 2}))
    for key in ("prompt_logprobs", "prompt_token_ids", "kv_transfer_params", "system_fingerprint"):
        assert key in chat_body and chat_body[key] is None
    assert "token_ids" in chat_body["choices"][0] and chat_body["choices"][0]["token_ids"] is None
    assert "prompt_tokens_details" in chat_body["usage"] and chat_body["usage"]["prompt_tokens_details"] is None
    completion = answer(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}))
    for key in ("prompt_token_ids", "token_ids", "prompt_logprobs"):
        assert key in completion["choices"][0] and completion["choices"][0][key] is None
    assert "kv_transfer_params" in completion and completion["kv_transfer_params"] is None


def test_truncation_side_right_keeps_the_first_tokens(http, tokenizer):
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n"
    ids = tokenizer.encode(prompt)
    for side, kept in (("right", ids[:5]), ("left", ids[-5:])):
        got = answer(http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                        "temperature": 0, "truncate_prompt_tokens": 5,
                                                        "truncation_side": side, "return_token_ids": True}))
        assert got["choices"][0]["prompt_token_ids"] == kept
        assert got["choices"][0]["text"] == completion_of(http, kept, 4)["text"]
    messages = CHAT[:1]
    full = rendered(tokenizer, messages, add_generation_prompt=True)
    got = answer(http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2,
                                                          "truncate_prompt_tokens": 4, "truncation_side": "right",
                                                          "return_token_ids": True}))
    assert got["prompt_token_ids"] == full[:4]
    refused(http, "/v1/completions", {"model": MODEL, "prompt": "x", "truncation_side": "middle"}, "truncation_side")


def test_kv_transfer_params_are_accepted_and_change_nothing(client):
    plain = chat(client, CHAT[:1]).choices[0].message.content
    assert chat(client, CHAT[:1], kv_transfer_params={"do_remote_decode": True}).choices[0].message.content == plain


def test_what_cannot_be_honoured_is_a_400_naming_it(http):
    base = {"model": MODEL, "messages": CHAT[:1], "max_tokens": 2}
    refused(http, "/v1/chat/completions", base | {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "vocabulary")
    refused(http, "/v1/chat/completions", base | {"prompt_logprobs": -1}, "prompt_logprobs")
    refused(http, "/v1/chat/completions", base | {"use_beam_search": True}, "use_beam_search")
    refused(http, "/v1/chat/completions", base | {"stream": True, "prompt_logprobs": 1}, "prompt_logprobs")


# ---- stream_options ----

def events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body) as response:
        expect_status(response)
        return list(chunks_of(response.iter_lines()))


def test_stream_options_as_vllm(client, http):
    chat_body = {"model": MODEL, "messages": CHAT[:1], "max_tokens": 4, "temperature": 0.8, "seed": 1, "stream": True, "n": 2}
    # continuous_usage_stats without include_usage: no usage anywhere (vLLM's rule)
    alone = events(http, "/v1/chat/completions", chat_body | {"stream_options": {"continuous_usage_stats": True}})
    assert alone and all("usage" not in c for c in alone)
    both = events(http, "/v1/chat/completions",
                  chat_body | {"stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    prompt_tokens = both[-1]["usage"]["prompt_tokens"]
    openers = [c for c in both if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert len(openers) == 2  # the role-only chunk of each choice carries the counts before any token
    assert all(c["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}
               for c in openers)
    counts = {0: [], 1: []}  # each choice's own tokens so far
    for chunk in both[:-1]:
        assert chunk["usage"]["prompt_tokens"] == prompt_tokens
        counts[chunk["choices"][0]["index"]].append(chunk["usage"]["completion_tokens"])
    assert all(c == sorted(c) and c[-1] == 4 for c in counts.values())
    assert both[-1]["choices"] == [] and both[-1]["usage"]["completion_tokens"] == 8
    # stream_options without stream: a 400, through the official client too
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream_options={"include_usage": True})
    refused(http, "/v1/chat/completions", {"model": MODEL, "messages": CHAT[:1], "stream": False,
                                           "stream_options": {"include_usage": True}}, "stream_options")


def test_streamed_chat_echo_and_token_ids(client, http, tokenizer):
    ids = rendered(tokenizer, CHAT, continue_final_message=True)
    whole = chat(client, continue_final_message=True, echo=True, return_token_ids=True)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, stream=True,
        extra_body={"continue_final_message": True, "echo": True, "return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == ids and chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].delta.content == "def add(a, b):"  # echo: right after the role
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    streamed = [t for c in chunks[2:] for t in c.choices[0].model_extra["token_ids"]]
    assert streamed == whole.choices[0].model_extra["token_ids"]


# ---- routes ----

def test_batch_chat_answers_each_conversation_as_alone(client, http):
    conversations = [CHAT[:1], [{"role": "user", "content": "say hi"}], CHAT]
    body = {"model": MODEL, "messages": conversations, "max_tokens": 5, "temperature": 0, "echo": True}
    got = answer(http.post("/v1/chat/completions/batch", json=body))
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    total = 0
    for conversation, choice in zip(conversations, got["choices"]):
        alone = chat(client, conversation, max_tokens=5, echo=True)
        assert choice["message"]["content"] == alone.choices[0].message.content
        assert choice["message"]["role"] == alone.choices[0].message.role
        total += alone.usage.prompt_tokens
    assert got["usage"]["prompt_tokens"] == total and got["usage"]["completion_tokens"] == 15
    refused(http, "/v1/chat/completions/batch", body | {"n": 2}, "n must be 1")
    refused(http, "/v1/chat/completions/batch", body | {"stream": True}, "stream")
    refused(http, "/v1/chat/completions/batch", body | {"messages": [[]]}, "conversation")


def test_invocations_dispatch_by_the_body(http):
    chat_body = {"model": MODEL, "messages": CHAT[:1], "max_tokens": 4, "temperature": 0}
    completion_body = {"model": MODEL, "prompt": "x = [", "max_tokens": 4, "temperature": 0}
    for body, path, kind in ((chat_body, "/v1/chat/completions", "chat.completion"),
                             (completion_body, "/v1/completions", "text_completion")):
        via, direct = answer(http.post("/invocations", json=body)), answer(http.post(path, json=body))
        assert via["object"] == kind and via["choices"] == direct["choices"]
    refused(http, "/invocations", {"model": MODEL, "input": "x"}, "messages", "prompt")
    refused(http, "/invocations", chat_body | {"temperature": "hot"}, "temperature")
    expect_status(http.get("/ping"))
    expect_status(http.post("/ping"))


def test_load_counts_requests_in_flight_and_orca_reports_the_engines_load(http):
    assert answer(http.get("/load")) == {"server_load": 0}
    body = {"model": MODEL, "prompt": "x = ", "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        expect_status(response)
        lines = response.iter_lines()
        first = next(lines)  # the stream has begun: the request is in flight
        assert '"error"' not in first, first  # (a failed request says why, a stub's name included)
        assert answer(http.get("/load")) == {"server_load": 1}
    deadline = time.monotonic() + TIMEOUT  # the server notices the closed stream, then releases it
    while answer(http.get("/load"))["server_load"] != 0:
        assert time.monotonic() < deadline, "a finished request still counts in /load"
        time.sleep(0.05)
    plain = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert "endpoint-load-metrics" not in http.post("/v1/completions", json=plain).headers
    text = http.post("/v1/completions", json=plain, headers={"endpoint-load-metrics-format": "text"})
    report = text.headers["endpoint-load-metrics"]
    assert report.startswith("TEXT ")
    named = dict(item.removeprefix("named_metrics.").split("=") for item in report.removeprefix("TEXT ").split(", "))
    assert set(named) == {"kv_cache_usage_perc", "num_requests_waiting"}
    assert 0.0 <= float(named["kv_cache_usage_perc"]) <= 1.0 and float(named["num_requests_waiting"]) >= 0
    report = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT[:1], "max_tokens": 2},
                       headers={"endpoint-load-metrics-format": "json"}).headers["endpoint-load-metrics"]
    assert set(json.loads(report.removeprefix("JSON "))["named_metrics"]) == set(named)


# ---- serve's flags ----

@pytest.mark.ch11  # --enable-prompt-tokens-details counts what chapter 11's prefix cache held
def test_server_flags(default_model, tokenizer):
    """--root-path (routes with and without the prefix, the key still wanted under it),
    --return-tokens-as-token-ids (the default a request may override), --enable-force-include-usage,
    --enable-prompt-tokens-details (cached tokens: the prompt's full blocks, the second time),
    --enable-per-request-metrics and --max-logprobs -1 (no cap: -1 asks for the whole vocabulary),
    through build_app's keywords (what the CLI passes)."""
    engine = LLMEngine(default_model, tokenizer=tokenizer, block_size=16, enable_prefix_caching=True, **ENGINE)
    with threaded.running_server(engine, MODEL, api_key=KEY, root_path="/api", max_logprobs=-1,
                                 return_tokens_as_token_ids=True,
                                 enable_force_include_usage=True, enable_prompt_tokens_details=True,
                                 enable_per_request_metrics=True) as (url, _), \
            httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False,
                         headers={"Authorization": f"Bearer {KEY}"}) as http:
        for path in ("/v1/models", "/api/v1/models"):
            expect_status(http.get(path))
            expect_status(httpx.get(url + path, timeout=TIMEOUT), 401)
        expect_status(httpx.post(url + "/invocations", json={"model": MODEL, "prompt": "x"}, timeout=TIMEOUT), 401)
        api = openai.OpenAI(base_url=f"{url}/api/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)
        got = api.completions.create(model=MODEL, prompt="x = [", max_tokens=3, temperature=0, logprobs=1,
                                     extra_body={"return_token_ids": True})
        assert got.choices[0].logprobs.tokens == [f"token_id:{t}" for t in got.choices[0].model_extra["token_ids"]]
        texts = api.completions.create(model=MODEL, prompt="x = [", max_tokens=3, temperature=0, logprobs=1,
                                       extra_body={"return_tokens_as_token_ids": False})
        assert "".join(texts.choices[0].logprobs.tokens) == texts.choices[0].text
        streamed = list(api.chat.completions.create(model=MODEL, messages=CHAT[:1], max_tokens=3, stream=True))
        assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == 3  # not asked for
        assert [c.usage.completion_tokens for c in streamed] == [0, 1, 2, 3, 3]  # in every chunk, as vLLM's
        prompt = "import os\nimport sys\n\ndef main(argv):\n    for name in argv:\n        print(name)\n" * 2
        first, second = (api.completions.create(model=MODEL, prompt=prompt, max_tokens=2) for _ in range(2))
        prompt_tokens = first.usage.prompt_tokens
        assert prompt_tokens >= 32 and first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16
        queued = "vllm:request_queue_time_seconds_sum{model_name=" + MODEL + "}"
        before = wait_until_idle(http)[queued]
        start = time.perf_counter()
        timed = answer(http.post("/api/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 6,
                                                              "ignore_eos": True}))
        elapsed_ms = (time.perf_counter() - start) * 1000
        m = timed["metrics"]
        assert 0 < m["time_to_first_token_ms"] <= elapsed_ms and 0 <= m["generation_time_ms"] <= elapsed_ms
        # arrival -> first scheduled: within the time to the first token, and the /metrics queue histogram's sample
        assert 0 <= m["queue_time_ms"] <= m["time_to_first_token_ms"]
        assert (wait_until_idle(http)[queued] - before) * 1000 == pytest.approx(m["queue_time_ms"], abs=1e-6)
        assert m["mean_itl_ms"] == pytest.approx(m["generation_time_ms"] / 5) and m["tokens_per_second"] > 0
        # --max-logprobs -1 lifts the cap: -1 then asks for the whole distribution (vLLM's)
        vocab = answer(http.get("/server_info"))["vocab_size"]
        whole = api.chat.completions.create(model=MODEL, messages=CHAT[:1], max_tokens=2, logprobs=True, top_logprobs=-1,
                                            extra_body={"prompt_logprobs": -1})
        for token in whole.choices[0].logprobs.content:
            assert len(token.top_logprobs) == vocab
            assert sum(torch.tensor([t.logprob for t in token.top_logprobs], dtype=torch.float64).exp()) == \
                pytest.approx(1.0, abs=1e-4)
        assert all(len(entry) == vocab for entry in whole.model_extra["prompt_logprobs"][1:])
        last = list(chunks_of(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3,
                                                                   "stream": True}).iter_lines()))[-1]
        assert last["choices"] == [] and last["metrics"]["time_to_first_token_ms"] > 0  # on the usage chunk


def test_the_app_serves_on_a_unix_socket(default_model, tokenizer, tmp_path):
    """--uds: uvicorn listens on a socket file (what `minivllm serve --uds PATH` configures)."""
    path = str(tmp_path / "minivllm.sock")
    app = build_app(LLMEngine(default_model, tokenizer=tokenizer, **ENGINE), MODEL)
    server = uvicorn.Server(uvicorn.Config(app, uds=path, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + TIMEOUT
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        with httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://minivllm", timeout=TIMEOUT) as http:
            got = answer(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}))
            assert got["usage"]["completion_tokens"] == 2
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
    assert not thread.is_alive()


@pytest.mark.slow
@pytest.mark.parametrize("servers", [  # serve's default engine has chapter 11's prefix cache
    pytest.param(["--engine-core", "thread"], id="one server, engine thread", marks=pytest.mark.ch11),
    # (chapter 15's engine: without chapter 16's persistent batch, which a copy at chapter 16 has as a stub)
    pytest.param(["--api-server-count", "2", "--no-persistent-batch"], id="two API servers", marks=pytest.mark.ch15)])
def test_minivllm_serve_on_a_unix_socket_under_a_root_path(tmp_path, servers):
    """The CLI end to end: `minivllm serve --uds PATH --root-path /api` answers on the socket,
    under the prefix (with two API server processes too: they share the socket); SIGTERM stops it
    and leaves no socket file."""
    path = tmp_path / "serve.sock"
    command = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", "--uds", str(path), "--root-path", "/api",
               "--device", "cpu", *servers, "--num-kv-blocks", "64", "--served-model-name", MODEL]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env=os.environ | {"PYTHONPATH": str(Path(minivllm.__file__).parents[1])})
    try:
        deadline = time.monotonic() + 120
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://minivllm",
                          timeout=TIMEOUT) as http:
            while True:
                assert process.poll() is None, process.stdout.read().decode()
                assert time.monotonic() < deadline, "minivllm serve did not start"
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            got = answer(http.post("/api/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}))
            assert got["usage"]["completion_tokens"] == 2
    finally:
        process.terminate()
        process.wait(60)
    assert process.returncode == 0, process.stdout.read().decode()
    assert not path.exists()


def test_vllms_api_key_variable_is_read_after_minivllms(monkeypatch):
    from minivllm.entrypoints.cli import build_parser, server_options

    def key() -> str | None:
        return server_options(build_parser().parse_args(["serve"]))["api_key"]

    monkeypatch.delenv("MINIVLLM_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    assert key() == KEY
    monkeypatch.setenv("MINIVLLM_API_KEY", "ours")
    assert key() == "ours"
    monkeypatch.setenv("MINIVLLM_API_KEY", "")  # set and empty: an open server, as before
    assert key() is None
