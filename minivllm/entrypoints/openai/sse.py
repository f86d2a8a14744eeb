"""Streaming: engine outputs become OpenAI chunks, sent as server-sent events (chapter 10).

Every step, the engine hands back a RequestOutput holding *everything* each of the request's
completions has produced so far (vLLM's cumulative outputs). A streaming client wants only
what is new, so the server remembers how much of each completion it has sent and sends the
rest: that difference is a `Delta`. Each delta becomes one JSON chunk, framed as a
server-sent event (`data: {...}` and a blank line), and the stream ends with `data: [DONE]`:

    data: {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": " return", ...}]}

    data: {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "(", "finish_reason": "length"}]}

    data: [DONE]

A request with a batch of prompts is one engine request per prompt, so the stream interleaves
chunks of all their completions, each under its choice index (prompt index x n + completion
index). With `echo`, a choice's first chunk carries its prompt (and the prompt's logprobs) ahead
of its first tokens.

Taking differences is only right because a completion's text never changes what it showed:
the engine (engine/detokenizer.py) holds back the bytes of a character still being generated
and the last characters that might yet start a stop string, so `text` only ever grows. A
chunk goes out for every step that brings tokens, even when they bring no text yet (half a
character, or a model without a tokenizer): a client sees each token's arrival.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from minivllm.entrypoints.openai.responses import (
    Echo,
    chat_logprobs,
    completion_logprobs,
    echoed_logprobs,
    joined,
    request_metrics,
    usage,
)
from minivllm.request.outputs import RequestOutput

DONE = "data: [DONE]\n\n"


@dataclass
class Delta:
    """What one completion of a request produced since the last chunk."""

    index: int  # which completion (0 .. n-1)
    text: str  # the new text
    token_ids: list[int]  # the new tokens (their text may come with a later delta)
    first_token: int  # position of token_ids[0] among the completion's tokens
    finish_reason: str | None = None  # "stop" or "length", once, with the completion's last delta
    stop_reason: int | str | None = None  # the stop string or token id that ended it, if one did


@dataclass
class StreamState:
    """How much of each completion (by index) the client already has."""

    text_sent: dict[int, int] = field(default_factory=dict)  # characters
    tokens_sent: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)


def new_deltas(output: RequestOutput, state: StreamState) -> list[Delta]:
    """The deltas to send for one engine output, updating `state` to say they were sent.

    output: the request's cumulative output: for every completion c in `output.outputs`,
    `c.text` and `c.token_ids` are all it has produced so far (text only ever grows), and
    `c.finish_reason` is None until it ends. state: what earlier calls sent (empty at first).

    For each completion, in index order, skipping those already finished:
    - the new text is c.text past the characters already sent, the new tokens c.token_ids past
      the tokens already sent;
    - emit a Delta when there are new tokens or when c has finished (then carrying
      c.finish_reason and c.stop_reason, and c is marked finished so that it is never emitted
      again); its text may be "" (tokens whose text the engine still holds back: that text
      goes out with c's next delta);
    - after emitting, state records everything in c as sent.
    Returns the deltas in index order; calling it again with the same output returns [].
    """
    # BEGIN SOLUTION
    deltas = []
    for c in sorted(output.outputs, key=lambda c: c.index):
        if c.index in state.finished:
            continue
        sent_text, sent_tokens = state.text_sent.get(c.index, 0), state.tokens_sent.get(c.index, 0)
        finished = c.finish_reason is not None
        if len(c.token_ids) == sent_tokens and not finished:
            continue
        deltas.append(Delta(c.index, c.text[sent_text:], c.token_ids[sent_tokens:], sent_tokens,
                            c.finish_reason, c.stop_reason))
        state.text_sent[c.index], state.tokens_sent[c.index] = len(c.text), len(c.token_ids)
        if finished:
            state.finished.add(c.index)
    return deltas
    # END SOLUTION


# json.dumps(payload, ensure_ascii=False, separators=(",", ":")), without making an encoder per call.
to_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event: `data: <json>` and the blank line that ends an event."""
    return f"data: {to_json(payload)}\n\n"


@dataclass
class Chunks:
    """Renders deltas as the chunks of one stream: `text_completion` chunks for
    /v1/completions, `chat.completion.chunk` ones (a `delta` message) for chat."""

    request_id: str
    created: int  # Unix seconds, the same in every chunk of a stream
    model: str
    chat: bool
    top_logprobs: int | None = None  # alternatives per token; None: the request asked for no logprobs
    n: int = 1  # completions per prompt: choice index = prompt index * n + completion index
    echo: list[Echo] | None = None  # completions only: one per prompt, sent first in each of its choices
    prompts: list[list[int]] = field(default_factory=list)  # the prompts' token ids (usage, return_token_ids)
    role: str = "assistant"  # chat: who speaks in the answer (the last message's role when it is continued)
    chat_echo: str = ""  # chat: echo's start of the answer, sent after the role
    token_ids: bool = False  # vLLM's return_token_ids: the prompt's ids first, then each chunk's new ids
    as_token_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    cached_tokens: bool = False  # --enable-prompt-tokens-details: the usage chunk's prompt_tokens_details
    metrics: bool = False  # --enable-per-request-metrics: the request's timings on the usage chunk (vLLM's place)
    # Per choice, the text offset of its next token's logprobs: counting them again from the
    # first token at every chunk would make a stream's cost grow with the square of its length.
    text_offsets: dict[int, int] = field(default_factory=dict)
    echoed: set[int] = field(default_factory=set)  # the choices whose prompt went out
    _head: str | None = field(default=None, init=False, repr=False)  # plain_event's template, made at its first use

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def opening(self, continuous_usage: bool = False) -> list[dict[str, Any]]:
        """Chat streams first say who speaks, once per completion (with the prompt's ids if asked,
        and, with continuous usage, the counts before any token: vLLM's), then echo's start of
        the answer; completions start with text."""
        if not self.chat:
            return []
        prompt = len(self.prompts[0]) if self.prompts else 0
        counts = {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}
        chunks = []
        for i in range(self.n):
            chunk = self._chunk([{"index": i, "delta": {"role": self.role, "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
            if self.token_ids and self.prompts:
                chunk["prompt_token_ids"] = list(self.prompts[0])
            chunks.append(chunk | ({"usage": counts} if continuous_usage else {}))
        for i in range(self.n if self.chat_echo else 0):
            chunk = self._chunk([{"index": i, "delta": {"content": self.chat_echo}, "logprobs": None,
                                  "finish_reason": None}])
            chunks.append(chunk | ({"usage": counts} if continuous_usage else {}))
        return chunks

    def delta(self, delta: Delta, output: RequestOutput, prompt: int = 0) -> dict[str, Any]:
        """One delta of prompt number `prompt` as a chunk; `output` (the one the delta came
        from) holds its logprobs, and the prompt's."""
        index = prompt * self.n + delta.index
        echo = None
        if self.echo is not None and index not in self.echoed:
            echo = self.echo[prompt]
            self.echoed.add(index)
            self.text_offsets[index] = len(echo.text)  # the completion's text follows the prompt's
        logprobs = None
        if self.top_logprobs is not None:
            completion = next(c for c in output.outputs if c.index == delta.index)
            first, last = delta.first_token, delta.first_token + len(delta.token_ids)
            if self.chat:
                logprobs = chat_logprobs(completion, first, len(delta.token_ids), self.top_logprobs, self.as_token_ids)
            else:
                offset = self.text_offsets.get(index, 0)
                logprobs = completion_logprobs(completion.token_ids[first:last], completion.logprobs[first:last],
                                               self.top_logprobs, offset, as_token_ids=self.as_token_ids)
                self.text_offsets[index] = offset + sum(map(len, logprobs["tokens"]))
                if echo is not None:
                    logprobs = joined(echoed_logprobs(output, echo, self.top_logprobs, self.as_token_ids), logprobs)
        text = delta.text if echo is None else echo.text + delta.text
        if self.chat:
            choice = {"index": index, "delta": {"content": text} if text else {}}
        else:
            choice = {"index": index, "text": text}
        choice |= {"logprobs": logprobs, "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
        if self.token_ids:
            choice["token_ids"] = list(delta.token_ids)
            if not self.chat and delta.first_token == 0:  # a completion's first chunk: its prompt's ids too
                choice["prompt_token_ids"] = list(output.prompt_token_ids)
        return self._chunk([choice])

    def plain_event(self, delta: Delta, prompt: int = 0) -> str | None:
        """sse(self.delta(delta, output, prompt)) for the common chunk, text and no logprobs, made
        from a template: the chunk's fixed part is serialised once per stream and only the text
        (and, at the end, the reasons) per token. None where the chunk is not that plain (logprobs
        asked for, token ids, or an echo still to send): then use delta()."""
        index = prompt * self.n + delta.index
        if self.top_logprobs is not None or self.token_ids or (self.echo is not None and index not in self.echoed):
            return None
        if self._head is None:  # '{"id":...,"choices":[' : the chunk without its choice
            self._head = "data: " + to_json(self._chunk([]))[:-2]
        if self.chat:
            text = f'"delta":{{"content":{to_json(delta.text)}}}' if delta.text else '"delta":{}'
        else:
            text = f'"text":{to_json(delta.text)}'
        end = ("null" if delta.finish_reason is None else to_json(delta.finish_reason),
               "null" if delta.stop_reason is None else to_json(delta.stop_reason))
        return f'{self._head}{{"index":{index},{text},"logprobs":null,"finish_reason":{end[0]},"stop_reason":{end[1]}}}]}}\n\n'

    def usage(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage is set: no choices, the counts of
        every prompt (the last output of each)."""
        chunk = self._chunk([]) | {"usage": usage(outputs, self.cached_tokens)}
        if self.metrics and len(outputs) == 1 and len(outputs[0].outputs) == 1:  # one completion: one request's
            chunk["metrics"] = request_metrics(outputs[0])
        return chunk


async def stream_events(outputs: AsyncIterator[tuple[int, RequestOutput]], chunks: Chunks,
                        include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
    """The whole event stream of one request: the chunks of its prompts' outputs ((prompt
    index, output) pairs, interleaved as they come) as they are produced, the usage chunk if
    asked for, then [DONE]. continuous_usage (vLLM's stream_options.continuous_usage_stats, which
    only counts with include_usage): every chunk also carries its choice's counts so far (its
    prompt's tokens, its own generated tokens), which load generators such as guidellm read to
    time each token."""
    for chunk in chunks.opening(continuous_usage):
        yield sse(chunk)
    states: dict[int, StreamState] = {}  # per prompt
    last: dict[int, RequestOutput] = {}
    async for prompt, output in outputs:
        last[prompt] = output
        state = states.get(prompt)
        if state is None:
            state = states[prompt] = StreamState()
        for delta in new_deltas(output, state):
            event = None if continuous_usage else chunks.plain_event(delta, prompt)
            if event is None:
                chunk = chunks.delta(delta, output, prompt)
                if continuous_usage:
                    chunk["usage"] = choice_usage(output, delta)
                event = sse(chunk)
            yield event
    if include_usage and last:
        yield sse(chunks.usage([last[p] for p in sorted(last)]))
    yield DONE


def choice_usage(output: RequestOutput, delta: Delta) -> dict[str, int]:
    """vLLM's continuous usage of one choice: its prompt's tokens and its own tokens so far."""
    prompt = len(output.prompt_token_ids)
    completion = delta.first_token + len(delta.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
