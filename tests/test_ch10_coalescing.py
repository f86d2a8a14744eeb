"""Output coalescing (issue 48): a stream whose reader falls behind hands it everything it
missed as one output, so a slow client gets fewer, larger chunks instead of a backlog of one
event per token, and what it assembles (text, tokens, logprobs, usage, finish reason) is what
an unhurried client gets. Also the detokenizer that decodes once per token: the same text as
decoding every window twice. (Merging DELTA outputs and the core-process reader's hold:
tests/test_ch15_coalescing.py.)

A slow client is made by slowing the server's side of its stream: every event waits before the
next is made, as a socket write waits for a client that does not read (uvicorn pauses writing
once the socket's buffers are full; on loopback they hold hundreds of KB, more than a test
stream fills in bounded time).
"""
from __future__ import annotations

import asyncio
import random

import pytest
from server_checks import ENGINE, MODEL, openai_client, running_server

from minivllm import LLM, LLMEngine, SamplingParams
from minivllm.engine.async_engine import RequestStream
from minivllm.engine.detokenizer import IncrementalDetokenizer, plain_decoder
from minivllm.entrypoints.openai import app as app_module
from minivllm.request.outputs import CompletionOutput, RequestOutput

pytestmark = [pytest.mark.ch10, pytest.mark.floors]

PROMPT = "import os\n\ndef list_files(path):\n    return"
TOKENS = 40
LATE = 0.15  # seconds the slow client's every event waits: several engine steps of this model
SERVER_EVENTS = app_module.stream_events  # the server's own, unhurried


def test_a_cumulative_stream_read_late_gets_the_newest_output():
    async def read_late() -> list[RequestOutput]:
        stream = RequestStream("r")
        for n in range(1, 4):
            stream.put(RequestOutput("r", "p", [1], [CompletionOutput(0, "a" * n, [7] * n)], finished=n == 3))
        return [output async for output in stream]

    (only,) = asyncio.run(asyncio.wait_for(read_late(), 5))
    assert only.outputs[0].token_ids == [7, 7, 7] and only.finished


# ---- through the server, with the official openai client ----

@pytest.fixture(scope="module")
def llm(default_model, chat_tokenizer) -> LLM:
    return LLM(default_model, tokenizer=chat_tokenizer, **ENGINE)


@pytest.fixture(scope="module", params=["thread", "process"])
def server(default_model, chat_tokenizer, request):
    """Chapter 10's server, then chapter 15's (the core in its own process)."""
    with running_server(LLMEngine(default_model, tokenizer=chat_tokenizer, **ENGINE),
                        core_process=request.param == "process") as running:
        yield running


@pytest.fixture()
def slow_client(monkeypatch):
    """Every streamed event waits LATE seconds before the next one is made."""
    async def late_events(*args, **kwargs):
        async for event in SERVER_EVENTS(*args, **kwargs):
            yield event
            await asyncio.sleep(LATE)

    monkeypatch.setattr(app_module, "stream_events", late_events)


def test_a_slow_client_gets_fewer_chunks_that_add_up_to_offline_greedy(server, llm, chat_tokenizer, slow_client):
    expected = llm.generate(PROMPT, SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    chunks = list(openai_client(server[0]).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0, logprobs=2, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    choices = [c for c in chunks if c.choices]
    assert len(choices) < TOKENS // 2, f"{len(choices)} chunks for {TOKENS} tokens: nothing was merged"
    assert "".join(c.choices[0].text for c in choices) == expected.text
    tokens = [t for c in choices for t in c.choices[0].logprobs.tokens]
    assert tokens == [chat_tokenizer.decode([t]) for t in expected.token_ids]
    offsets = [o for c in choices for o in c.choices[0].logprobs.text_offset]
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    assert sum(len(c.choices[0].logprobs.token_logprobs) for c in choices) == TOKENS
    assert [c.choices[0].finish_reason for c in choices] == [None] * (len(choices) - 1) + ["length"]
    so_far = [sum(len(c.choices[0].logprobs.tokens) for c in choices[:j + 1]) for j in range(len(choices))]
    assert [c.usage.completion_tokens for c in choices] == so_far  # continuous usage: the tokens so far
    assert chunks[-1].usage.completion_tokens == TOKENS and not chunks[-1].choices


def test_a_slow_chat_with_n_2_merges_each_choice_apart(server, llm, slow_client):
    """n = 2 seeded completions of a chat: each choice's merged deltas add up to the same
    request read by an unhurried client (the seed fixes every token)."""
    client = openai_client(server[0])
    request = {"model": MODEL, "messages": [{"role": "user", "content": "def add(a, b):"}], "n": 2,
               "max_tokens": TOKENS, "temperature": 1.0, "seed": 11, "logprobs": True, "top_logprobs": 1,
               "stream": True, "stream_options": {"include_usage": True}, "extra_body": {"ignore_eos": True}}

    def assembled(chunks: list) -> tuple[dict, dict, dict, object]:
        text, tokens, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
        for c in chunks:
            for choice in c.choices:
                text[choice.index] += choice.delta.content or ""
                tokens[choice.index] += [t.token for t in (choice.logprobs.content if choice.logprobs else [])]
                if choice.finish_reason is not None:
                    finish[choice.index] = choice.finish_reason
        return text, tokens, finish, chunks[-1].usage

    slow = list(client.chat.completions.create(**request))
    with pytest.MonkeyPatch.context() as undo:  # the unhurried client: the server's own stream_events
        undo.setattr(app_module, "stream_events", SERVER_EVENTS)
        quick = list(client.chat.completions.create(**request))
    assert assembled(slow) == assembled(quick)
    assert assembled(slow)[2] == {0: "length", 1: "length"} and assembled(slow)[3].completion_tokens == 2 * TOKENS
    assert sum(bool(c.choices) for c in slow) < sum(bool(c.choices) for c in quick) // 2



# ---- one decode per token ----

class TwoDecodes:
    """Chapter 10's detokenizer before issue 48: every window decoded twice."""

    def __init__(self, tokenizer, prompt: list[int]):
        self.tokenizer, self.tokens, self.prefix, self.text = tokenizer, prompt[-5:], 0, ""
        self.read = len(self.tokens)

    def add(self, new: list[int], final: bool = False) -> None:
        self.tokens = self.tokens + new
        before = self.tokenizer.decode(self.tokens[self.prefix:self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.tokens[self.prefix:], skip_special_tokens=True)
        if after.endswith("\ufffd") and not final:
            return
        self.text += after[len(before):]
        self.prefix, self.read = self.read, len(self.tokens)


@pytest.mark.parametrize("seed", range(4))
def test_one_decode_per_token_shows_what_two_did(chat_tokenizer, seed):
    """Random token ids (byte pieces that split characters, spaces, specials) and real text, one
    or a few tokens at a time: the text after every call equals the two-decode detokenizer's."""
    rng = random.Random(seed)
    real = chat_tokenizer.encode('def f(x):\n    return "héllo 世界 🙂" + x  # ünïcödé\n' * 3)
    output = real if seed == 0 else [rng.randrange(len(chat_tokenizer)) for _ in range(200)]
    prompt = chat_tokenizer.encode("print(1)\n")
    mine, reference, i = IncrementalDetokenizer(chat_tokenizer, prompt), TwoDecodes(chat_tokenizer, prompt), 0
    decodes = calls = 0
    decode = mine._decode

    def counted(ids):
        nonlocal decodes
        decodes += 1
        return decode(ids)

    mine._decode = counted
    while i < len(output):
        step = output[i:i + rng.choice([1, 1, 1, 2, 3])]
        i += len(step)
        final = i >= len(output)
        calls += 1
        mine.add(step, final)
        reference.add(step, final)
        assert mine.text == reference.text
    assert mine.text == chat_tokenizer.decode(output, skip_special_tokens=True) or seed != 0
    assert decodes < 1.3 * calls  # two per call before


def test_the_plain_decoder_is_the_tokenizers_decode(chat_tokenizer, monkeypatch):
    """The Rust decoder alone (which the embedded tokenizer gets: it cleans up no spaces) gives
    what tokenizer.decode gives (special tokens left out, half characters as U+FFFD), on random
    ids and on the ids of real text; a tokenizer it does not know is called as it is."""
    calls = []
    with monkeypatch.context() as patch:
        patch.setattr(chat_tokenizer, "decode", lambda *args, **kwargs: calls.append(args) or "")
        plain_decoder(chat_tokenizer)([1, 2])
    assert calls == [] or chat_tokenizer.clean_up_tokenization_spaces is not False, "the Rust decoder was not used"
    rng = random.Random(0)
    decode = plain_decoder(chat_tokenizer)
    cases = [[rng.randrange(len(chat_tokenizer)) for _ in range(rng.randint(1, 12))] for _ in range(300)]
    cases += [chat_tokenizer.encode("héllo 世界 🙂 <|endoftext|> x")[i:j] for i in range(6) for j in range(i + 1, 14)]
    for ids in cases:
        assert decode(ids) == chat_tokenizer.decode(ids, skip_special_tokens=True)

    class Spelled:
        def decode(self, ids, skip_special_tokens=False):
            return "-".join(map(str, ids))

    assert plain_decoder(Spelled())([1, 2]) == "1-2"
