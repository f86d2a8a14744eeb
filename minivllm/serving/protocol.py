"""What comes over the wire: OpenAI's request bodies as pydantic models, and how their fields
become the engine's SamplingParams (vLLM's names, so the mapping is mostly one to one). What
goes back (answer bodies, logprobs, errors) is responses.py's.

The models are strict, like the rest of minivllm: a string where a number belongs is refused,
not converted, and a field OpenAI does not know is refused too (OpenAI answers "Unrecognized
request argument"). Fields OpenAI has but minivllm does not implement (tools, logit_bias,
suffix, ...) are simply not declared, so they are refused the same way instead of being ignored.
Besides OpenAI's fields, the requests take vLLM's extra sampling fields (top_k, min_p,
min_tokens, repetition_penalty, ignore_eos, stop_token_ids), which the openai client sends
through `extra_body`.

A completion request may carry a batch of prompts (evaluation harnesses send them): each prompt
becomes one engine request, and choice `prompt_index * n + completion_index` answers it. With
`echo`, each choice's text starts with its prompt and, with `logprobs`, so do its logprobs (the
prompt's first token has none: nothing predicts it). `echo` with `max_tokens: 0` scores a prompt
without generating, which is how lm-evaluation-harness asks for loglikelihoods.

Chapter 13: OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema",
"json_schema": {"name": ..., "schema": {...}}}) and vLLM's extra field `structured_outputs`
({"json": ...}, {"regex": ...}, {"choice": [...]}, {"grammar": ...}) become the request's
StructuredOutputsParams, on both endpoints; at most one of the two per request.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from minivllm.engine.sampling_params import SamplingParams
from minivllm.engine.structured_outputs import StructuredOutputsParams

STRICT = ConfigDict(extra="forbid", strict=True)


class APIError(Exception):
    """An answer other than 200: becomes OpenAI's error body with this status."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def check_max_tokens(name: str, max_tokens: int | None, num_prompt_tokens: int, max_model_len: int,
                     where: str = "") -> None:
    """vLLM's rule: the prompt and the tokens asked for must fit in the context, or the request
    is a 400 (never silently capped). None asks for whatever the context leaves. The message is
    vLLM's, word for word (after `where`, which names the prompt of a batch): clients parse it to
    retry with a smaller max_tokens."""
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise APIError(400, f"{where}'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                            f"maximum context length is {max_model_len} tokens and your request has "
                            f"{num_prompt_tokens} input tokens ({max_tokens} > {max_model_len} - {num_prompt_tokens}).",
                       param=name)


def check_logprobs(name: str, value: int | None, limit: int, kind: str = "sample") -> None:
    """A server caps how many alternatives a token may come with (`--max-logprobs`, vLLM's 20):
    each one is a row of the top-k the sampler sorts out and a line of JSON for every token."""
    if value is not None and value > limit:
        raise APIError(400, f"Requested {kind} logprobs of {value}, which is greater than max allowed: {limit} "
                            f"(the server's --max-logprobs)", param=name)


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
    """POST /v1/completions. `prompt` is one prompt (text, or a list of token ids) or a batch of
    them (a list of texts, or a list of token-id lists)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions; None: until the context is full
    echo: bool = False  # the prompt comes back before each completion (and its logprobs, with logprobs)
    logprobs: int | None = None  # also return the top-`logprobs` alternatives of every token
    prompt_logprobs: int | None = None  # vLLM's: log-probabilities of the prompt's own tokens

    @field_validator("prompt", mode="wrap")
    @classmethod
    def one_of_four_shapes(cls, value: Any, handler: Any) -> Any:
        """One message for a prompt of the wrong shape (rather than one per shape it is not)."""
        try:
            value = handler(value)
        except ValidationError:
            raise ValueError("a prompt is a string or a list of token ids; a batch of prompts is a list of "
                             "strings or a list of token-id lists") from None
        if value == []:
            raise ValueError("an empty list holds no prompt")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The batch: `[1, 2, 3]` is one prompt of token ids, `[[1, 2], [3]]` two."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    @property
    def top_logprobs_wanted(self) -> int | None:
        """How many alternatives to show per token (None: no logprobs at all)."""
        return self.logprobs

    @property
    def scores_only(self) -> bool:
        """echo with max_tokens 0: the prompt and its logprobs, nothing generated."""
        return self.echo and self.max_tokens == 0

    def check_logprobs(self, limit: int) -> None:
        check_logprobs("logprobs", self.logprobs, limit)
        check_logprobs("prompt_logprobs", self.prompt_logprobs, limit, kind="prompt")

    def sampling_params(self) -> SamplingParams:
        """Raises ValueError for values the engine refuses (say temperature=-1). The engine
        always generates at least one token: scoring a prompt (echo, max_tokens 0) generates
        one, and the answer leaves it out (prompt_only). Echoed logprobs are the prompt's
        logprobs, with as many alternatives as the completion's."""
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs cannot be streamed: ask for them without stream=true")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo=true, to score the prompt)")
        if self.scores_only and self.min_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} with max_tokens=0: nothing is generated")
        kwargs = self.sampling_kwargs() | {"max_tokens": 1 if self.scores_only else self.max_tokens}
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            kwargs["prompt_logprobs"] = self.logprobs
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

    @property
    def max_tokens_field(self) -> tuple[str, int | None]:
        """The limit on the answer's length, and the name it came under."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def check_logprobs(self, limit: int) -> None:
        check_logprobs("top_logprobs", self.top_logprobs, limit)

    def sampling_params(self) -> SamplingParams:
        """Raises ValueError for values the engine refuses, or contradictory fields."""
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_completion_tokens or max_tokens (its older name), not both")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        kwargs = self.sampling_kwargs() | {"max_tokens": self.max_tokens_field[1]}
        if self.logprobs:
            kwargs["logprobs"] = self.top_logprobs_wanted  # 0: the chosen token's log-probability only
        return SamplingParams(**kwargs)
