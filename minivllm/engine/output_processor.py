"""The way out (chapter 15): the core's per-step news (a few token ids per sequence) turned into
what a user reads, vLLM's RequestOutputs, with text.

Why a piece of its own: the core's output is small and plain on purpose, so that it can cross
a process boundary cheaply; everything that grows with a request's length (its text, its
logprob dicts, the snapshot a CUMULATIVE output copies) is built here, in the frontend, while
the core is already running its next step.

Per request it keeps the state the core does not need: the prompt's text, each completion's
tokens and logprobs so far, and its detokenizer and stop strings (detokenizer.py). A stop
string lives in the text, so it is found here, and the completion it ends must stop in the
core too: `process_outputs` returns those (request id, index) pairs, and the caller aborts them
in the core. The text of a FINAL_ONLY request without stop strings is decoded once, at its end.

The three kinds of output (RequestOutputKind): CUMULATIVE, everything so far at every step
that brings tokens; DELTA, only what is new since the request's last output (`new_delta`);
FINAL_ONLY, once, at the end. A reader that falls behind a DELTA request must not lose any of
its deltas: `merge_deltas` joins two in order, as the server's streams do while unread.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from minivllm.engine.detokenizer import StopChecker
from minivllm.request.logprobs import TopLogprobs
from minivllm.request.messages import EngineCoreOutput, EngineCoreRequest
from minivllm.request.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from minivllm.request.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class CompletionState:
    """One completion as the frontend knows it. Everything before the `sent_*` marks went out
    in an earlier DELTA output."""

    index: int
    text: StopChecker | None  # None without a tokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    scheduled_time: float | None = None  # the core's: when a step first gave it tokens
    first_token_time: float | None = None
    finish_time: float | None = None
    counters: tuple[int, int, int, int] = (0, 0, 0, 0)  # preemptions, cached, draft and accepted tokens
    sent_tokens: int = 0
    sent_chars: int = 0

    def visible_text(self) -> str:
        """The text this completion shows now ("" without a tokenizer)."""
        return self.text.visible(self.finish_reason is not None) if self.text is not None else ""


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    completions: list[CompletionState]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


def new_delta(completion: CompletionState) -> CompletionOutput:
    """What completion `completion` produced since its last DELTA output, as a CompletionOutput,
    and mark it sent.

    completion.token_ids holds every token so far, completion.visible_text() the text it may
    show now (which only ever grows), completion.logprobs one dict per token (or None when the
    request asked for none); sent_tokens and sent_chars say how much of each went out before.
    The delta holds the tokens past sent_tokens, the visible text past sent_chars, their
    logprobs (None if none were asked for), the cumulative logprob, finish and stop reasons.
    Afterwards sent_tokens and sent_chars cover everything: a second call right after gives
    empty text and no tokens. The delta's text may be "" while tokens arrive (half a
    character, or characters that may begin a stop string): it comes with a later delta.
    """
    # BEGIN SOLUTION
    text = completion.visible_text()
    tokens = completion.token_ids[completion.sent_tokens:]
    logprobs = None if completion.logprobs is None else completion.logprobs[completion.sent_tokens:]
    delta = CompletionOutput(completion.index, text[completion.sent_chars:], tokens, completion.cumulative_logprob,
                             logprobs, completion.finish_reason, completion.stop_reason)
    completion.sent_tokens, completion.sent_chars = len(completion.token_ids), len(text)
    return delta
    # END SOLUTION


def merge_deltas(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two DELTA outputs of one request, `first` then `then`, as the one output a reader would
    have got had both steps been one (vLLM's RequestOutputCollector does the same): per
    completion index, the texts and token ids concatenated, the logprobs joined in order, the
    newer cumulative logprob, finish and stop reasons. What is whole in every output rather than
    new (the prompt, its logprobs, the metrics, finished) is taken from `then`. Neither input
    is changed."""
    merged = {c.index: c for c in first.outputs}
    for c in then.outputs:
        before = merged.get(c.index)
        if before is None:
            merged[c.index] = c
            continue
        logprobs = None if before.logprobs is None and c.logprobs is None else (before.logprobs or []) + (c.logprobs or [])
        merged[c.index] = CompletionOutput(c.index, before.text + c.text, before.token_ids + c.token_ids,
                                           c.cumulative_logprob, logprobs, c.finish_reason, c.stop_reason)
    return replace(then, outputs=[merged[i] for i in sorted(merged)])


class OutputProcessor:
    """The frontend's state of every unfinished request; tokenizer: None for a model without one
    (outputs then have no text, and logprobs name no tokens)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None) -> None:
        params = request.params
        completions = []
        for i in range(params.n):
            text = (StopChecker(self.tokenizer, request.prompt_token_ids, params.stop, params.include_stop_str_in_output)
                    if self.tokenizer is not None else None)
            completions.append(CompletionState(i, text, logprobs=None if params.logprobs is None else [],
                                               cumulative_logprob=None if params.logprobs is None else 0.0))
        self.requests[request.request_id] = RequestState(
            request.request_id, prompt, request.prompt_token_ids, params, request.arrival_time, completions,
            None if params.prompt_logprobs is None else [None])

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, outputs: list[EngineCoreOutput],
                        now: float | None = None) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """One core step's outputs -> (a RequestOutput for every request that answers this step,
        the (request id, index) of completions a stop string ended, which the core must stop).
        A request answers when one of its completions got tokens (CUMULATIVE, DELTA) or when it
        finishes (all kinds). Outputs for requests that are no longer here (aborted, or already
        ended by a stop string) are ignored."""
        now = time.perf_counter() if now is None else now
        answering: dict[str, RequestState] = {}
        stopped: list[tuple[str, int]] = []
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None or state.completions[out.index].finish_reason is not None:
                continue
            completion = state.completions[out.index]
            if out.prompt_logprobs is not None:
                # (position 0's None is in both: the frontend's list starts with it)
                state.prompt_logprobs += [self._logprob_dict(top) for top in out.prompt_logprobs if top is not None]
            completion.counters = (out.num_preemptions, out.num_cached_tokens, out.num_draft_tokens,
                                   out.num_accepted_tokens)
            if completion.first_token_time is None:
                completion.first_token_time, completion.scheduled_time = out.first_token_time, out.scheduled_time
            if self._take(state, completion, out):
                stopped.append((out.request_id, out.index))
            if completion.finish_reason is not None:
                completion.finish_time = now
                answering[out.request_id] = state
            elif state.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                answering[out.request_id] = state
        results = []
        for state in answering.values():
            finished = state.finished
            if finished:
                del self.requests[state.request_id]
            if finished or state.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                results.append(self._output(state, finished))
        return results, stopped

    def _take(self, state: RequestState, completion: CompletionState, out: EngineCoreOutput) -> bool:
        """Take in a step's tokens one at a time, so that a stop string ends the completion
        exactly where one-token-a-step decoding would: nothing after. True if a stop string did."""
        params = state.params
        streamed = params.stop or params.output_kind is not RequestOutputKind.FINAL_ONLY
        tokens = out.new_token_ids
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            completion.token_ids.append(token)
            if out.new_logprobs is not None:
                entry = self._logprob_dict(out.new_logprobs[i])
                completion.logprobs.append(entry)
                completion.cumulative_logprob += entry[token].logprob
            if last and out.finish_reason is not None:  # the core stops a sequence at its last token
                completion.finish_reason, completion.stop_reason = out.finish_reason, out.stop_reason
            if completion.text is not None and (params.stop or (last and (streamed or completion.finish_reason))):
                if self._update_text(params, completion):
                    return True
        return False

    @staticmethod
    def _update_text(params: SamplingParams, completion: CompletionState) -> bool:
        """Decode the tokens the text has not seen yet and look for stop strings in the new text
        (not before min_tokens are out, like vLLM). True if a stop string ended the completion."""
        text = completion.text
        search = len(completion.token_ids) >= params.min_tokens
        stop = text.update(completion.token_ids[text.num_output_tokens:], final=completion.finish_reason is not None,
                           search=search)
        if stop is None:
            return False
        completion.finish_reason, completion.stop_reason = "stop", stop
        return True

    def _logprob_dict(self, top: TopLogprobs) -> dict[int, Logprob]:
        """vLLM's form of one position's logprobs: token id -> Logprob, the chosen token first."""
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        return {t: Logprob(lp, rank, decode([t]) if decode else None)
                for t, lp, rank in zip(top.token_ids, top.logprobs, top.ranks)}

    def _output(self, state: RequestState, finished: bool) -> RequestOutput:
        """A snapshot of the request (CUMULATIVE, FINAL_ONLY) or what is new in it (DELTA):
        later steps do not change it."""
        completions = state.completions
        if state.params.output_kind is RequestOutputKind.DELTA:
            outputs = [new_delta(c) for c in completions]
        else:
            outputs = [CompletionOutput(c.index, c.visible_text(), list(c.token_ids), c.cumulative_logprob,
                                        None if c.logprobs is None else list(c.logprobs), c.finish_reason,
                                        c.stop_reason) for c in completions]
        first_tokens = [c.first_token_time for c in completions if c.first_token_time is not None]
        scheduled = [c.scheduled_time for c in completions if c.scheduled_time]
        totals = [sum(column) for column in zip(*(c.counters for c in completions))]
        metrics = RequestMetrics(state.arrival_time, min(first_tokens, default=None),
                                 max(c.finish_time for c in completions) if finished else None,
                                 totals[0], totals[2], totals[3], min(scheduled, default=None))
        prompt_logprobs = None if state.prompt_logprobs is None else list(state.prompt_logprobs)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outputs, finished, metrics,
                             prompt_logprobs, totals[1])
