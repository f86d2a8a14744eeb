"""What goes over the wire: OpenAI's request bodies as pydantic models, and how their fields
become the engine's SamplingParams (vLLM's names, so the mapping is mostly one to one).

The models are strict, like the rest of minivllm: a string where a number belongs is refused,
not converted, and a field OpenAI does not know is refused too (OpenAI answers "Unrecognized
request argument"). Fields OpenAI has but minivllm does not implement (tools, logit_bias,
echo, ...) are simply not declared, so they are refused the same way instead of being ignored.
Besides OpenAI's fields, the requests take vLLM's extra sampling fields (top_k, min_p,
min_tokens, repetition_penalty, ignore_eos, stop_token_ids), which the openai client sends
through `extra_body`.

Chapter 13: OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema",
"json_schema": {"name": ..., "schema": {...}}}) and vLLM's extra field `structured_outputs`
({"json": ...}, {"regex": ...}, {"choice": [...]}, {"grammar": ...}) become the request's
StructuredOutputsParams, on both endpoints; at most one of the two per request.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from minivllm.engine.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.engine.sampling_params import SamplingParams
from minivllm.engine.structured_outputs import StructuredOutputsParams

STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False  # one more chunk before [DONE], with the token counts


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: OpenAI's named schema (`strict` is accepted: the grammar
    is always strict)."""

    model_config = STRICT
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # `schema` is a BaseModel method
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: "text" (no constraint), "json_object", or "json_schema"."""

    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('response_format needs "json_schema" exactly when its type is "json_schema"')
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            if self.json_schema.schema_ is None:
                raise ValueError("response_format.json_schema needs a schema")
            return StructuredOutputsParams(json=self.json_schema.schema_)
        return None


class StructuredOutputsField(BaseModel):
    """vLLM's extra field `structured_outputs`: StructuredOutputsParams over the wire."""

    model_config = STRICT
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # `json` is a BaseModel method
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None

    def constraint(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                       json_object=self.json_object,
                                       disable_any_whitespace=self.disable_any_whitespace)


class SamplingFields(BaseModel):
    """The sampling fields both endpoints share, with OpenAI's defaults."""

    model_config = STRICT
    model: str
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own bookkeeping; not used
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    # chapter 13: OpenAI's response_format, or vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams arguments this request sets (the ones it leaves out keep the
        engine's defaults, which are OpenAI's)."""
        names = ("n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                 "min_tokens", "repetition_penalty", "ignore_eos", "stop_token_ids", "include_stop_str_in_output")
        kwargs = {name: getattr(self, name) for name in names if name in self.model_fields_set}
        if self.stop is not None:
            kwargs["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        constraint = self.constraint()
        if constraint is not None:
            kwargs["structured_outputs"] = constraint
        return kwargs

    def constraint(self) -> StructuredOutputsParams | None:
        """Chapter 13: what response_format or structured_outputs asks the output to fit (a
        ValueError for a malformed one, or for both at once)."""
        if self.structured_outputs is not None:
            if self.response_format is not None and self.response_format.type != "text":
                raise ValueError("give response_format or structured_outputs, not both")
            return self.structured_outputs.constraint()
        return self.response_format.constraint() if self.response_format is not None else None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    """POST /v1/completions. One prompt per request: text, or a list of token ids."""

    prompt: str | list[int]
    max_tokens: int | None = 16  # OpenAI's default for completions; None: until the context is full
    logprobs: int | None = None  # also return the top-`logprobs` alternatives of every token
    prompt_logprobs: int | None = None  # vLLM's: log-probabilities of the prompt's own tokens

    @property
    def top_logprobs_wanted(self) -> int | None:
        """How many alternatives to show per token (None: no logprobs at all)."""
        return self.logprobs

    def sampling_params(self) -> SamplingParams:
        """Raises ValueError for values the engine refuses (say temperature=-1)."""
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs cannot be streamed: ask for them without stream=true")
        kwargs = self.sampling_kwargs() | {"max_tokens": self.max_tokens}
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        return SamplingParams(**kwargs)


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        """The {"role", "content"} dict chat templates expect (text parts joined)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": content}


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. The messages go through the checkpoint's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # None: until the context is full
    max_tokens: int | None = None  # the older name of max_completion_tokens
    logprobs: bool = False
    top_logprobs: int | None = None  # alternatives per token; needs logprobs=true

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_params(self) -> SamplingParams:
        """Raises ValueError for values the engine refuses, or contradictory fields."""
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_completion_tokens or max_tokens (its older name), not both")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        kwargs = self.sampling_kwargs() | {"max_tokens": limit}
        if self.logprobs:
            kwargs["logprobs"] = self.top_logprobs_wanted  # 0: the chosen token's log-probability only
        return SamplingParams(**kwargs)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(output: RequestOutput) -> dict[str, int]:
    """OpenAI's token counts: the prompt once, the completions' tokens added up."""
    prompt = len(output.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in output.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def token_text(token_id: int, logprob: Logprob) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"


def completion_logprobs(c: CompletionOutput, first: int, count: int, top: int, offset: int | None = None) -> dict[str, Any]:
    """Tokens first .. first+count-1 of a completion in the legacy completions format:
    parallel lists of tokens, their logprobs, their top alternatives and character offsets.
    offset: the text offset of token `first` (a stream keeps it; None: counted from the start)."""
    entries, ids = c.logprobs[first:first + count], c.token_ids[first:first + count]
    if offset is None:
        offset = sum(len(token_text(t, e[t])) for t, e in zip(c.token_ids[:first], c.logprobs[:first]))
    body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(ids, entries):
        text = token_text(token_id, entry[token_id])
        body["tokens"].append(text)
        body["token_logprobs"].append(entry[token_id].logprob)
        body["top_logprobs"].append({token_text(t, lp): lp.logprob for t, lp in entry.items() if lp.rank <= top})
        body["text_offset"].append(offset)
        offset += len(text)
    return body


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


def completion_response(output: RequestOutput, request_id: str, created: int, model: str,
                        top_logprobs: int | None) -> dict[str, Any]:
    """The body of a /v1/completions answer that does not stream."""
    choices = []
    for c in sorted(output.outputs, key=lambda c: c.index):
        logprobs = None if top_logprobs is None else completion_logprobs(c, 0, len(c.token_ids), top_logprobs)
        choices.append({"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason, "prompt_logprobs": prompt_logprobs(output)})
    return {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(output)}


def chat_response(output: RequestOutput, request_id: str, created: int, model: str,
                  top_logprobs: int | None) -> dict[str, Any]:
    """The body of a /v1/chat/completions answer that does not stream."""
    choices = []
    for c in sorted(output.outputs, key=lambda c: c.index):
        logprobs = None if top_logprobs is None else chat_logprobs(c, 0, len(c.token_ids), top_logprobs)
        choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(output)}
