"""What goes back over the wire (chapter 10): OpenAI's answer bodies, chunks' pieces and error
bodies, built from the engine's RequestOutputs. The request side (bodies in, SamplingParams out)
is protocol.py's.

Log-probabilities come in two formats: the legacy completions one (parallel lists of token
texts, logprobs, alternatives and character offsets) and the chat one (a record per token,
alternatives best first). With `echo`, a completion's text and logprobs start with its prompt's.
A token is named by its text, or, with vLLM's return_tokens_as_token_ids, as "token_id:<id>"
(text that is not valid UTF-8 on its own, half a character, then still names one token).

The bodies have every field vLLM's have, null when the request did not ask for it (clients
that read `choice["prompt_token_ids"]` find a key), so that vLLM's clients read them unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from minivllm.entrypoints.openai.protocol import EVERY_REPORTED
from minivllm.request.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)

# vLLM's stand-in for a logprob of -inf (a token a grammar or a bias masks): JSON has no infinity.
MASKED_LOGPROB = -9999.0


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class Echo:
    """What `echo` puts before each completion of one prompt: the prompt's text, and the text of
    its first token (whose logprob is null: nothing predicts it, so no logprob entry holds its text)."""

    text: str
    first_token: str


def prompt_only(output: RequestOutput) -> RequestOutput:
    """A request that scores its prompt (echo, max_tokens 0) as the client sees it: the engine
    generated one token per completion, which the answer leaves out, finished by its length."""
    def nothing(c: CompletionOutput) -> CompletionOutput:
        return CompletionOutput(c.index, "", [], None if c.logprobs is None else 0.0,
                                None if c.logprobs is None else [],
                                None if c.finish_reason is None else "length", None)
    return replace(output, outputs=[nothing(c) for c in output.outputs])


def usage(outputs: list[RequestOutput], cached_tokens: bool = False) -> dict[str, Any]:
    """OpenAI's token counts over a request's prompts: each prompt once, every completion's tokens.
    cached_tokens (vLLM's --enable-prompt-tokens-details): also how many prompt tokens the prefix
    cache (or a KV connector) already held, in prompt_tokens_details."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    counts: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion}
    if cached_tokens:
        counts["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens for o in outputs)}
    return counts


def finite(logprob: float) -> float:
    """A logprob JSON can carry: -inf (a masked token) as vLLM's -9999.0."""
    return logprob if math.isfinite(logprob) else MASKED_LOGPROB


def token_text(token_id: int, logprob: Logprob, as_token_id: bool = False) -> str:
    if as_token_id or logprob.decoded_token is None:
        return f"token_id:{token_id}"
    return logprob.decoded_token


def request_metrics(output: RequestOutput) -> dict[str, float | None]:
    """vLLM's per-request timings (--enable-per-request-metrics), in milliseconds, from the
    engine's timestamps of one request: arrival, first scheduled (the first step that ran it),
    first token, last token. queue_time_ms is arrival -> first scheduled, the same interval as
    the /metrics histogram vllm:request_queue_time_seconds; tokens_per_second counts from arrival."""
    m: RequestMetrics | None = output.metrics
    tokens = sum(len(c.token_ids) for c in output.outputs)
    timings: dict[str, float | None] = dict.fromkeys(("time_to_first_token_ms", "generation_time_ms",
                                                     "queue_time_ms", "mean_itl_ms", "tokens_per_second"))
    if m is None or m.first_token_time is None:
        return timings
    timings["time_to_first_token_ms"] = (m.first_token_time - m.arrival_time) * 1000
    if m.first_scheduled_time is not None:
        timings["queue_time_ms"] = (m.first_scheduled_time - m.arrival_time) * 1000
    if m.finished_time is not None:
        timings["generation_time_ms"] = (m.finished_time - m.first_token_time) * 1000
        if tokens > 1:
            timings["mean_itl_ms"] = timings["generation_time_ms"] / (tokens - 1)
        if m.finished_time > m.arrival_time:
            timings["tokens_per_second"] = tokens / (m.finished_time - m.arrival_time)
    return timings


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], top: int, offset: int = 0,
                        unscored_text: str = "", as_token_ids: bool = False) -> dict[str, list]:
    """Tokens in the legacy completions format: parallel lists of the tokens' texts, their
    logprobs, their alternatives and their character offsets in the choice's text, the first
    at `offset`. A token's alternatives are the `top` most likely tokens and the token itself
    (OpenAI's rule: up to top + 1 of them); top EVERY_REPORTED (logprob_token_ids): every
    token the engine reported, the token itself and the listed ones. An entry of None (a prompt's first token, which
    nothing predicts) has a null logprob and null alternatives, and `unscored_text` as its text.
    as_token_ids: name tokens "token_id:<id>" (and count offsets in those names, as vLLM does)."""
    body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            text, logprob, alternatives = unscored_text, None, None
        else:
            text, logprob = token_text(token_id, entry[token_id], as_token_ids), finite(entry[token_id].logprob)
            alternatives = {token_text(t, lp, as_token_ids): finite(lp.logprob) for t, lp in entry.items()
                            if lp.rank <= top or t == token_id or top == EVERY_REPORTED}
        body["tokens"].append(text)
        body["token_logprobs"].append(logprob)
        body["top_logprobs"].append(alternatives)
        body["text_offset"].append(offset)
        offset += len(text)
    return body


def echoed_logprobs(output: RequestOutput, echo: Echo, top: int, as_token_ids: bool = False) -> dict[str, list]:
    """The prompt's tokens in the legacy format, from offset 0: what echo puts first."""
    first = f"token_id:{output.prompt_token_ids[0]}" if as_token_ids else echo.first_token
    return completion_logprobs(output.prompt_token_ids, output.prompt_logprobs, top, 0, first, as_token_ids)


def joined(*parts: dict[str, list]) -> dict[str, list]:
    """Legacy logprobs of consecutive tokens, as one."""
    return {key: [item for part in parts for item in part[key]] for key in parts[0]}


def chat_logprobs(c: CompletionOutput, first: int, count: int, top: int, as_token_ids: bool = False) -> dict[str, Any]:
    """The same tokens in the chat format: one record per token, alternatives best first (top
    EVERY_REPORTED, logprob_token_ids: the token itself, then the listed ones in their order, vLLM's)."""
    def record(token_id: int, lp: Logprob) -> dict[str, Any]:
        text = token_text(token_id, lp, as_token_ids)
        return {"token": text, "logprob": finite(lp.logprob), "bytes": list(text.encode())}

    content = []
    for token_id, entry in zip(c.token_ids[first:first + count], c.logprobs[first:first + count]):
        if top == EVERY_REPORTED:
            alternatives = list(entry.items())
        else:
            alternatives = [(t, lp) for _, t, lp in sorted((lp.rank, t, lp) for t, lp in entry.items() if lp.rank <= top)]
        content.append(record(token_id, entry[token_id]) | {"top_logprobs": [record(t, lp) for t, lp in alternatives]})
    return {"content": content}


def prompt_logprobs(output: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's prompt_logprobs field: None for the first token, then token id -> logprob, rank, text."""
    if output.prompt_logprobs is None:
        return None
    return [None if entry is None else {str(t): {"logprob": finite(lp.logprob), "rank": lp.rank,
                                                 "decoded_token": lp.decoded_token}
                                        for t, lp in entry.items()} for entry in output.prompt_logprobs]


@dataclass(frozen=True)
class Shown:
    """What an answer shows besides the text, as the request and the server's flags ask (the
    fields vLLM always sends are null when not asked for)."""

    top_logprobs: int | None = None  # alternatives per token; None: no logprobs
    token_ids: bool = False  # return_token_ids: the prompt's and each choice's token ids
    as_token_ids: bool = False  # return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    prompt_logprobs: bool = False  # the prompt_logprobs field (not when only echo asked for them)
    cached_tokens: bool = False  # --enable-prompt-tokens-details: usage.prompt_tokens_details
    metrics: bool = False  # --enable-per-request-metrics: the answer's timings (one completion only)


def answer_usage(outputs: list[RequestOutput], shown: Shown) -> dict[str, Any]:
    """A whole answer's usage: prompt_tokens_details is always there, null unless asked for
    (vLLM's; stream chunks leave nulls out)."""
    counts = usage(outputs, shown.cached_tokens)
    counts.setdefault("prompt_tokens_details", None)
    return counts


def answer_metrics(outputs: list[RequestOutput], shown: Shown) -> dict[str, float | None] | None:
    """The per-request timings, when asked for and one completion makes them one request's."""
    if not shown.metrics or len(outputs) != 1 or len(outputs[0].outputs) != 1:
        return None
    return request_metrics(outputs[0])


def completion_response(outputs: list[RequestOutput], request_id: str, created: int, model: str,
                        top_logprobs: int | None, echo: list[Echo] | None = None,
                        show_prompt_logprobs: bool = False, shown: Shown | None = None) -> dict[str, Any]:
    """The body of a /v1/completions answer that does not stream: outputs[p] answers prompt p,
    and its completion i is choice p * n + i. echo: one per prompt, or None. The vLLM field
    prompt_logprobs is shown when the request asked for it (not when echo did). shown: the rest
    of what the request asked to see (top_logprobs and show_prompt_logprobs override its own)."""
    shown = replace(shown or Shown(), top_logprobs=top_logprobs, prompt_logprobs=show_prompt_logprobs)
    choices = []
    for p, output in enumerate(outputs):
        n = len(output.outputs)
        for c in sorted(output.outputs, key=lambda c: c.index):
            text, logprobs = c.text, None
            if top_logprobs is not None:
                start = 0 if echo is None else len(echo[p].text)
                logprobs = completion_logprobs(c.token_ids, c.logprobs, top_logprobs, start,
                                               as_token_ids=shown.as_token_ids)
                if echo is not None:
                    logprobs = joined(echoed_logprobs(output, echo[p], top_logprobs, shown.as_token_ids), logprobs)
            if echo is not None:
                text = echo[p].text + text
            choices.append({"index": p * n + c.index, "text": text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                            "token_ids": list(c.token_ids) if shown.token_ids else None,
                            "prompt_logprobs": prompt_logprobs(output) if shown.prompt_logprobs else None,
                            "prompt_token_ids": list(output.prompt_token_ids) if shown.token_ids else None})
    body = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "service_tier": None, "system_fingerprint": None, "usage": answer_usage(outputs, shown),
            "kv_transfer_params": None}
    metrics = answer_metrics(outputs, shown)
    return body if metrics is None else body | {"metrics": metrics}


def chat_response(outputs: list[RequestOutput], request_id: str, created: int, model: str,
                  top_logprobs: int | None, shown: Shown | None = None, role: str | list[str] = "assistant",
                  echo: str | list[str] = "") -> dict[str, Any]:
    """The body of a /v1/chat/completions answer that does not stream: one conversation, or a
    batch of them (/v1/chat/completions/batch: role and echo then one per conversation, choice
    p * n + i answering completion i of conversation p). role: the answer's; echo: what each
    answer's content starts with. prompt_logprobs and prompt_token_ids are the one
    conversation's (null for a batch, as vLLM's)."""
    shown = replace(shown or Shown(), top_logprobs=top_logprobs)
    roles = [role] * len(outputs) if isinstance(role, str) else role
    echoes = [echo] * len(outputs) if isinstance(echo, str) else echo
    choices = []
    for p, output in enumerate(outputs):
        n = len(output.outputs)
        for c in sorted(output.outputs, key=lambda c: c.index):
            logprobs = None if top_logprobs is None else chat_logprobs(c, 0, len(c.token_ids), top_logprobs,
                                                                       shown.as_token_ids)
            message = {"role": roles[p], "content": echoes[p] + c.text, "refusal": None, "annotations": None,
                       "audio": None, "function_call": None, "reasoning": None}
            choices.append({"index": p * n + c.index, "message": message, "logprobs": logprobs,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                            "token_ids": list(c.token_ids) if shown.token_ids else None})
    one = outputs[0] if len(outputs) == 1 else None
    body = {"id": request_id, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "service_tier": None, "system_fingerprint": None, "usage": answer_usage(outputs, shown),
            "prompt_logprobs": prompt_logprobs(one) if one is not None and shown.prompt_logprobs else None,
            "prompt_token_ids": list(one.prompt_token_ids) if one is not None and shown.token_ids else None,
            "kv_transfer_params": None}
    metrics = answer_metrics(outputs, shown)
    return body if metrics is None else body | {"metrics": metrics}
