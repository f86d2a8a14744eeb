"""Output coalescing in chapter 15's pieces (issue 48): a DELTA stream whose reader falls behind
merges its pending deltas (text, tokens, logprobs in order) instead of losing the older ones, and
the core-process reader, while the core's messages wait, takes them in before the streams' readers
run, so a stream gets one output for those steps.
"""
from __future__ import annotations

import asyncio
import random

import pytest
from server_checks import ENGINE

from minivllm import LLMEngine, SamplingParams
from minivllm.engine import async_llm
from minivllm.engine.async_engine import RequestStream
from minivllm.engine.output_processor import merge_deltas
from minivllm.request.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineCoreStats,
    StepOutputs,
)
from minivllm.request.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.request.sampling_params import RequestOutputKind

pytestmark = [pytest.mark.ch15, pytest.mark.floors]

PROMPT = "import os\n\ndef list_files(path):\n    return"


def completion(index: int, text: str, tokens: list[int], finish: str | None = None,
               logprobs: bool = True) -> CompletionOutput:
    entries = [{t: Logprob(-float(t), 1, str(t))} for t in tokens] if logprobs else None
    return CompletionOutput(index, text, tokens, -float(sum(tokens)), entries, finish, None if finish is None else "\n")


def test_merge_deltas_joins_each_completion_in_order():
    first = RequestOutput("r", "p", [1, 2], [completion(0, "ab", [3, 4]), completion(1, "x", [5])],
                          prompt_logprobs=[None])
    then = RequestOutput("r", "p", [1, 2], [completion(1, "yz", [6, 7], finish="stop"), completion(0, "c", [8])],
                         finished=False, prompt_logprobs=[None, {2: Logprob(-0.5)}], num_cached_tokens=2)
    merged = merge_deltas(first, then)
    assert [c.index for c in merged.outputs] == [0, 1]
    zero, one = merged.outputs
    assert (zero.text, zero.token_ids, zero.finish_reason) == ("abc", [3, 4, 8], None)
    assert (one.text, one.token_ids, one.finish_reason, one.stop_reason) == ("xyz", [5, 6, 7], "stop", "\n")
    assert [next(iter(e)) for e in zero.logprobs] == [3, 4, 8]
    assert zero.cumulative_logprob == -8.0  # the newer one: it is already a running sum
    assert merged.prompt_logprobs == then.prompt_logprobs and merged.num_cached_tokens == 2  # whole, not deltas
    assert first.outputs[0].text == "ab" and first.outputs[0].token_ids == [3, 4]  # inputs unchanged
    plain = merge_deltas(RequestOutput("r", "p", [1], [completion(0, "a", [3], logprobs=False)]),
                         RequestOutput("r", "p", [1], [completion(0, "b", [4], "length", logprobs=False)], True))
    assert plain.outputs[0].logprobs is None and plain.finished and plain.outputs[0].finish_reason == "length"


def engine_outputs(default_model, chat_tokenizer, kind: RequestOutputKind) -> list[RequestOutput]:
    """Every step's output of one seeded request (n = 2, logprobs, a stop string)."""
    engine = LLMEngine(default_model, tokenizer=chat_tokenizer, **ENGINE)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=24, logprobs=2, stop=["\n\n"], output_kind=kind)
    engine.add_request(request_id="r", prompt=PROMPT, params=params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_delta_stream_read_late_loses_nothing(default_model, chat_tokenizer, seed):
    """DELTA outputs put into a stream whose reader wakes only now and then: the outputs it
    reads add up to the cumulative run's last output, and it reads fewer of them."""
    deltas = engine_outputs(default_model, chat_tokenizer, RequestOutputKind.DELTA)
    final = engine_outputs(default_model, chat_tokenizer, RequestOutputKind.CUMULATIVE)[-1]
    rng = random.Random(seed)

    async def read_late() -> list[RequestOutput]:
        stream, read = RequestStream("r", delta=True), []
        for output in deltas:
            stream.put(output)
            if rng.random() < 0.3 or output.finished:  # the reader's turn comes now and then
                read.append(await asyncio.wait_for(anext(stream), 5))
        return read

    read = asyncio.run(read_late())
    assert len(read) < len(deltas) and read[-1].finished
    for c in final.outputs:
        pieces = [r.outputs[c.index] for r in read]
        assert "".join(p.text for p in pieces) == c.text
        assert [t for p in pieces for t in p.token_ids] == c.token_ids
        assert [lp for p in pieces for lp in p.logprobs] == c.logprobs
        assert pieces[-1].finish_reason == c.finish_reason and pieces[-1].stop_reason == c.stop_reason


class Backlog:
    """A core client whose messages are all there already (a frontend that fell behind its
    core): receive() returns at once until they run out, then waits for ever."""

    alive = True

    def __init__(self, messages: list) -> None:
        self.messages = messages

    async def receive(self):
        if self.messages:
            return self.messages.pop(0)
        await asyncio.get_running_loop().create_future()

    def send(self, message) -> None:
        pass


@pytest.mark.parametrize("hold", [0.0, 60.0])
def test_a_reader_behind_its_core_sends_one_output_for_the_steps_waiting(chat_tokenizer, monkeypatch, hold):
    """Five steps already waiting for a stream: read within HOLD_SECONDS they reach it as one
    output holding all five tokens; with no hold, as five outputs."""
    steps = [StepOutputs([EngineCoreOutput("r", 0, [100 + i], finish_reason="length" if i == 4 else None)],
                         EngineCoreStats(1, 0, 0.0, 0, 0)) for i in range(5)]
    monkeypatch.setattr(async_llm, "make_client", lambda model, config, tokenizer, *a, **k: (Backlog(steps), tokenizer))
    monkeypatch.setattr(async_llm, "HOLD_SECONDS", hold)
    engine = async_llm.AsyncLLM(None, None, chat_tokenizer)
    engine.output_processor.add_request(EngineCoreRequest("r", [1, 2, 3], SamplingParams(max_tokens=5), 0.0), None)
    stream = engine._streams["r"] = RequestStream("r")

    async def read() -> list[RequestOutput]:
        reader = asyncio.create_task(engine._read())
        try:
            return [output async for output in stream]
        finally:
            reader.cancel()

    outputs = asyncio.run(asyncio.wait_for(read(), 10))
    assert [len(o.outputs[0].token_ids) for o in outputs] == ([5] if hold else [1, 2, 3, 4, 5])
    assert outputs[-1].outputs[0].token_ids == [100, 101, 102, 103, 104] and outputs[-1].finished
