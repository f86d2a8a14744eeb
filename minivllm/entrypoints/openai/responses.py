"""What goes back over the wire (chapter 10): OpenAI's answer bodies, chunks' pieces and error
bodies, built from the engine's RequestOutputs. The request side (bodies in, SamplingParams out)
is protocol.py's.

Log-probabilities come in two formats: the legacy completions one (parallel lists of token
texts, logprobs, alternatives and character offsets) and the chat one (a record per token,
alternatives best first). With `echo`, a completion's text and logprobs start with its prompt's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from minivllm.request.outputs import CompletionOutput, Logprob, RequestOutput


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


def usage(outputs: list[RequestOutput]) -> dict[str, int]:
    """OpenAI's token counts over a request's prompts: each prompt once, every completion's tokens."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def token_text(token_id: int, logprob: Logprob) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], top: int, offset: int = 0,
                        unscored_text: str = "") -> dict[str, list]:
    """Tokens in the legacy completions format: parallel lists of the tokens' texts, their
    logprobs, their alternatives and their character offsets in the choice's text, the first
    at `offset`. A token's alternatives are the `top` most likely tokens and the token itself
    (OpenAI's rule: up to top + 1 of them). An entry of None (a prompt's first token, which
    nothing predicts) has a null logprob and null alternatives, and `unscored_text` as its text."""
    body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            text, logprob, alternatives = unscored_text, None, None
        else:
            text, logprob = token_text(token_id, entry[token_id]), entry[token_id].logprob
            alternatives = {token_text(t, lp): lp.logprob for t, lp in entry.items() if lp.rank <= top or t == token_id}
        body["tokens"].append(text)
        body["token_logprobs"].append(logprob)
        body["top_logprobs"].append(alternatives)
        body["text_offset"].append(offset)
        offset += len(text)
    return body


def echoed_logprobs(output: RequestOutput, echo: Echo, top: int) -> dict[str, list]:
    """The prompt's tokens in the legacy format, from offset 0: what echo puts first."""
    return completion_logprobs(output.prompt_token_ids, output.prompt_logprobs, top, 0, echo.first_token)


def joined(*parts: dict[str, list]) -> dict[str, list]:
    """Legacy logprobs of consecutive tokens, as one."""
    return {key: [item for part in parts for item in part[key]] for key in parts[0]}


def chat_logprobs(c: CompletionOutput, first: int, count: int, top: int) -> dict[str, Any]:
    """The same tokens in the chat format: one record per token, alternatives best first."""
    def record(token_id: int, lp: Logprob) -> dict[str, Any]:
        text = token_text(token_id, lp)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    content = []
    for token_id, entry in zip(c.token_ids[first:first + count], c.logprobs[first:first + count]):
        alternatives = sorted((lp.rank, t, lp) for t, lp in entry.items() if lp.rank <= top)
        content.append(record(token_id, entry[token_id]) | {"top_logprobs": [record(t, lp) for _, t, lp in alternatives]})
    return {"content": content}


def prompt_logprobs(output: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's prompt_logprobs field: None for the first token, then token id -> logprob, rank, text."""
    if output.prompt_logprobs is None:
        return None
    return [None if entry is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                        for t, lp in entry.items()} for entry in output.prompt_logprobs]


def completion_response(outputs: list[RequestOutput], request_id: str, created: int, model: str,
                        top_logprobs: int | None, echo: list[Echo] | None = None,
                        show_prompt_logprobs: bool = False) -> dict[str, Any]:
    """The body of a /v1/completions answer that does not stream: outputs[p] answers prompt p,
    and its completion i is choice p * n + i. echo: one per prompt, or None. The vLLM field
    prompt_logprobs is shown when the request asked for it (not when echo did)."""
    choices = []
    for p, output in enumerate(outputs):
        n = len(output.outputs)
        for c in sorted(output.outputs, key=lambda c: c.index):
            text, logprobs = c.text, None
            if top_logprobs is not None:
                start = 0 if echo is None else len(echo[p].text)
                logprobs = completion_logprobs(c.token_ids, c.logprobs, top_logprobs, start)
                if echo is not None:
                    logprobs = joined(echoed_logprobs(output, echo[p], top_logprobs), logprobs)
            if echo is not None:
                text = echo[p].text + text
            choices.append({"index": p * n + c.index, "text": text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                            "prompt_logprobs": prompt_logprobs(output) if show_prompt_logprobs else None})
    return {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(outputs)}


def chat_response(outputs: list[RequestOutput], request_id: str, created: int, model: str,
                  top_logprobs: int | None) -> dict[str, Any]:
    """The body of a /v1/chat/completions answer that does not stream (one conversation)."""
    (output,) = outputs
    choices = []
    for c in sorted(output.outputs, key=lambda c: c.index):
        logprobs = None if top_logprobs is None else chat_logprobs(c, 0, len(c.token_ids), top_logprobs)
        choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(outputs)}
