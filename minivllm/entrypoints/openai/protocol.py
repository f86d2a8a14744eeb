"""What comes over the wire: OpenAI's request bodies as pydantic models, and how their fields
become the engine's SamplingParams (vLLM's names, so the mapping is mostly one to one). What
goes back (answer bodies, logprobs, errors) is responses.py's.

The models are strict about values, like the rest of minivllm: a string where a number belongs
is refused, not converted, and a name nobody defines is refused too (vLLM ignores any unknown
name with a warning, but a typo such as `max_tokenz` would then silently change nothing). About
the names OpenAI and vLLM define, they accept what vLLM accepts (issue 36: clients send them):
- `null` means "not given" for every field (many client libraries send every field they know);
- OpenAI's fields that change nothing here (`user`, `store`, `metadata`, `service_tier`,
  `parallel_tool_calls`, vLLM's `guided_decoding_backend`, ...) are ignored, with a logged
  warning that names them, as vLLM does (`priority` too: the scheduler has no priorities);
- OpenAI's fields that would change the answer and that minivllm does not implement (`suffix`,
  `tools`, a `best_of` above `n`, ...) are a 400 that names them when given a value, never
  silently dropped.
Besides OpenAI's fields, the requests take vLLM's extra sampling fields (top_k, min_p,
min_tokens, repetition_penalty, ignore_eos, stop_token_ids, truncate_prompt_tokens and
truncation_side, add_special_tokens, request_id, the older guided_* names of
structured_outputs), what vLLM adds to the answer (return_token_ids,
return_tokens_as_token_ids, prompt_logprobs, logprob_token_ids) and, on chat, how the chat
template ends the prompt (add_generation_prompt, continue_final_message), what it renders
(chat_template_kwargs, documents, and the request's own chat_template where the server trusts
it) and echo; the openai client sends them through `extra_body`. A message may have any role (the template decides what it makes of it),
and fields of a message nobody here reads are ignored, as in vLLM.

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

import logging
import re
import types
import typing
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from minivllm.request.sampling_params import SamplingParams
from minivllm.structured_outputs import StructuredOutputsParams

STRICT = ConfigDict(extra="forbid", strict=True)
log = logging.getLogger("minivllm.entrypoints.openai")

# Accepted and ignored, as vLLM ignores them: none changes what the model writes.
IGNORED = ("store", "metadata", "service_tier", "parallel_tool_calls", "guided_decoding_backend",
           "guided_whitespace_pattern", "prompt_cache_key", "safety_identifier", "spaces_between_special_tokens",
           # vLLM's disaggregated-serving handshake: here the connector (--kv-transfer-config) finds a
           # prompt's K/V by its tokens, so there is nothing per request to pass (chapter 17)
           "kv_transfer_params")
# Would change the answer, and minivllm does not implement them: a value is a 400 naming the field.
UNSUPPORTED = {
    "suffix": "text after the insertion point (fill-in-the-middle)",
    "cache_salt": "prefix-cache isolation per salt",
    "tools": "tool calling", "functions": "function calling", "function_call": "function calling",
    "prediction": "predicted outputs", "audio": "audio output", "modalities": "output modalities",
    "use_beam_search": "beam search", "length_penalty": "beam search",
}
# top_logprobs_wanted's value for a request with logprob_token_ids: the answer shows every
# logprob the engine reported for a token (the chosen one, then the listed ids), in that order.
EVERY_REPORTED = -1


def allows_none(annotation: Any) -> bool:
    return annotation is None or (typing.get_origin(annotation) in (typing.Union, types.UnionType)
                                  and type(None) in typing.get_args(annotation))


class Lenient(BaseModel):
    """A request body's part: strict about values and unknown names, but `null` means "not
    given" (where None is not itself a value the field takes: `max_tokens: null` still asks for
    as many tokens as the context leaves), and a value of the `UNSUPPORTED` fields is refused by name."""

    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def null_is_not_given(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        kept = {}
        for key, value in data.items():
            declared = cls.model_fields.get(key)
            if value is None and (declared is None or not allows_none(declared.annotation)):
                continue  # OpenAI-compatible clients send null for "not given"
            kept[key] = value
        return kept


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


def check_logprobs(name: str, value: int | None, limit: int, vocab_size: int, kind: str = "sample") -> int | None:
    """A server caps how many alternatives a token may come with (`--max-logprobs`, vLLM's 20;
    -1: no cap): each one is a row of the top-k the sampler sorts out and a line of JSON for
    every token. Returns the value, with vLLM's -1 ("every token of the vocabulary") as the
    vocabulary's size, which the cap must allow."""
    if value == -1:
        if limit != -1 and vocab_size > limit:
            raise APIError(400, f"{name}=-1 asks for every token of the vocabulary ({vocab_size}), more than the "
                                f"{limit} the server allows (its --max-logprobs; -1 lifts the cap)", param=name)
        return vocab_size
    if value is not None and limit != -1 and value > limit:
        raise APIError(400, f"Requested {kind} logprobs of {value}, which is greater than max allowed: {limit} "
                            f"(the server's --max-logprobs)", param=name)
    return value


class StreamOptions(Lenient):
    """OpenAI's stream_options."""

    include_usage: bool = False  # one more chunk before [DONE], with the token counts
    continuous_usage_stats: bool = False  # vLLM's: the counts so far in every chunk too


class JsonSchemaFormat(Lenient):
    """response_format.json_schema: OpenAI's named schema (`strict` is accepted: the grammar
    is always strict)."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # `schema` is a BaseModel method
    strict: bool | None = None


class ResponseFormat(Lenient):
    """OpenAI's response_format: "text" (no constraint), "json_object", or "json_schema"."""

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


class StructuredOutputsField(Lenient):
    """vLLM's extra field `structured_outputs`: StructuredOutputsParams over the wire."""

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


class SamplingFields(Lenient):
    """The sampling fields both endpoints share, with OpenAI's defaults."""

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
    best_of: int | None = None  # OpenAI's; only best_of == n (the default) is served: no completion is thrown away
    skip_special_tokens: bool = True  # the detokenizer always leaves special tokens out of the text
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # keep k prompt tokens (-1: max_model_len)
    truncation_side: Literal["left", "right"] = "left"  # vLLM's: left keeps the last k tokens, right the first k
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the answer
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:<id>" (None: the server's)
    priority: int = 0  # accepted, and ignored: the scheduler serves first come, first served
    request_id: str | None = Field(default=None, min_length=1)  # names the request (ids and logs)
    tool_choice: Literal["none"] | None = None  # "none" asks for no tool: what every answer here is
    # vLLM's older names for structured_outputs' json / regex / choice / grammar
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # chapter 13: OpenAI's response_format, or vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None

    # -- issue 49, vLLM's request fields that edit the logits (worker/logit_bias.py) --------------
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (a JSON key is a string) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be sampled
    bad_words: list[str] | None = None  # vLLM's: words the output must not contain
    # vLLM's: these tokens' logprobs at every generated position, in place of the top alternatives
    logprob_token_ids: list[int] | None = None

    def logit_edits(self) -> dict[str, Any]:
        """The SamplingParams arguments of the three fields above. logit_bias's keys are token ids
        written as JSON strings ("50256"): anything but digits is refused, every such key named."""
        kwargs: dict[str, Any] = {name: getattr(self, name) for name in ("allowed_token_ids", "bad_words")
                                  if getattr(self, name) is not None}
        if self.logit_bias is not None:
            bad = [key for key in self.logit_bias if not re.fullmatch(r"[0-9]+", key)]
            if bad:
                raise ValueError(f"logit_bias keys must be token ids written as strings of digits; these are not: {bad}")
            kwargs["logit_bias"] = {int(key): bias for key, bias in self.logit_bias.items()}
        return kwargs
    # -- end of issue 49's logit fields ------------------------------------------------------------

    @model_validator(mode="before")
    @classmethod
    def names_vllm_accepts(cls, data: Any) -> Any:
        """Fields that change nothing are dropped with a warning (vLLM's); a value for one this
        server cannot honour is refused by name."""
        if not isinstance(data, dict):
            return data
        for key, value in data.items():
            if key in UNSUPPORTED and value is not None and value != [] and value != {}:
                raise ValueError(f"`{key}` ({UNSUPPORTED[key]}) is not supported by minivllm")
        if data.get("stream_options") and not data.get("stream"):
            raise ValueError("stream_options can only be given with stream=true")
        ignored = sorted(k for k, v in data.items() if k in IGNORED and v is not None)
        if ignored:
            log.warning("The following fields were present in the request but ignored: %s", ignored)
        return {k: v for k, v in data.items() if k not in IGNORED and k not in UNSUPPORTED}

    @model_validator(mode="after")
    def served_as_asked(self) -> "SamplingFields":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} with n={self.n}: minivllm returns every completion it "
                             f"samples, so best_of must equal n (or be left out)")
        if not self.skip_special_tokens:
            raise ValueError("skip_special_tokens=false is not supported: the text always leaves special tokens "
                             "out (their ids are in the logprobs)")
        if self.priority:
            log.warning("priority=%d ignored: the scheduler serves requests first come, first served", self.priority)
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams arguments this request sets (the ones it leaves out keep the
        engine's defaults, which are OpenAI's)."""
        names = ("n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                 "min_tokens", "repetition_penalty", "ignore_eos", "stop_token_ids", "include_stop_str_in_output")
        kwargs = {name: getattr(self, name) for name in names if name in self.model_fields_set}
        kwargs |= self.logit_edits()
        if self.logprob_token_ids is not None:
            kwargs["logprob_token_ids"] = self.logprob_token_ids
        if self.stop is not None:
            kwargs["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        constraint = self.constraint()
        if constraint is not None:
            kwargs["structured_outputs"] = constraint
        return kwargs

    def constraint(self) -> StructuredOutputsParams | None:
        """Chapter 13: what response_format or structured_outputs asks the output to fit (a
        ValueError for a malformed one, or for both at once)."""
        guided = {name: getattr(self, f"guided_{name}") for name in ("json", "regex", "choice", "grammar")
                  if getattr(self, f"guided_{name}") is not None}
        given = [name for name, there in (("response_format", self.response_format is not None
                                            and self.response_format.type != "text"),
                                           ("structured_outputs", self.structured_outputs is not None),
                                           ("guided_*", bool(guided))) if there]
        if len(given) > 1:
            raise ValueError(f"give one of response_format, structured_outputs or guided_*, not both "
                             f"({' and '.join(given)})")
        if guided:
            return StructuredOutputsParams(**guided)
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        return self.response_format.constraint() if self.response_format is not None else None

    def stream_usage(self, force: bool = False) -> tuple[bool, bool]:
        """vLLM's rule for usage in a stream: (a usage chunk before [DONE], the counts so far in
        every chunk). continuous_usage_stats only adds to include_usage: alone, it sends nothing.
        force: the server's --enable-force-include-usage, which sends both, whatever was asked."""
        if force:
            return True, True
        options = self.stream_options or StreamOptions()
        return options.include_usage, options.include_usage and options.continuous_usage_stats

    def check_listed(self, asked: bool) -> None:
        """logprob_token_ids within vLLM's rules: the request must ask for logprobs (the list
        replaces their top-k alternatives). SamplingParams checks the list itself (at most 128
        ids, vLLM's bound, not the server's --max-logprobs), and their range against the
        model's vocabulary when the request is added (SamplingParams.for_model)."""
        if self.logprob_token_ids is not None and not asked:
            raise APIError(400, "when using `logprob_token_ids`, `logprobs` must be set", param="logprob_token_ids")

    def logprobs_as_token_ids(self, default: bool) -> bool:
        """return_tokens_as_token_ids, or the server's --return-tokens-as-token-ids when not given."""
        return default if self.return_tokens_as_token_ids is None else self.return_tokens_as_token_ids


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt` is one prompt (text, or a list of token ids) or a batch of
    them (a list of texts, or a list of token-id lists)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions; None: until the context is full
    echo: bool = False  # the prompt comes back before each completion (and its logprobs, with logprobs)
    logprobs: int | None = None  # also return the top-`logprobs` alternatives of every token
    prompt_logprobs: int | None = None  # vLLM's: log-probabilities of the prompt's own tokens
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (and the like) around a text prompt

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
        """How many alternatives to show per token (None: no logprobs at all; EVERY_REPORTED:
        the listed logprob_token_ids)."""
        return EVERY_REPORTED if self.logprob_token_ids is not None else self.logprobs

    @property
    def scores_only(self) -> bool:
        """echo with max_tokens 0: the prompt and its logprobs, nothing generated."""
        return self.echo and self.max_tokens == 0

    def check_logprobs(self, limit: int, vocab_size: int) -> None:
        """The logprobs asked for within the server's cap (check_logprobs); -1 becomes the vocabulary's size."""
        self.logprobs = check_logprobs("logprobs", self.logprobs, limit, vocab_size)
        self.prompt_logprobs = check_logprobs("prompt_logprobs", self.prompt_logprobs, limit, vocab_size, "prompt")
        self.check_listed(self.logprobs is not None)
        if self.logprob_token_ids is not None and self.scores_only:
            raise APIError(400, "logprob_token_ids with max_tokens=0: there is no generated position to report "
                                "(the echoed prompt's logprobs come from prompt_logprobs)", param="logprob_token_ids")

    def sampling_params(self) -> SamplingParams:
        """Raises ValueError for values the engine refuses (say temperature=-1). The engine
        always generates at least one token: scoring a prompt (echo, max_tokens 0) generates
        one, and the answer leaves it out (prompt_only). Echoed logprobs are the prompt's
        logprobs, with as many alternatives as the completion's."""
        if self.stream and self.prompt_logprobs:  # (0, vLLM's too, is accepted: there is nothing to show)
            raise ValueError("prompt_logprobs are not available when stream=true: ask for them without it")
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


class TextPart(Lenient):
    """A part of a message's content: text only (the models here read no images); other fields
    of a part are ignored, as in a message."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(Lenient):
    """One message. Any role goes to the chat template, which decides what it makes of it (vLLM's
    rule: "tool" or a role of the caller's own; a template that cannot render it is a 400). Other
    fields of a message (tool_calls, reasoning, ...) are ignored, as vLLM ignores unknown ones; a
    message without content renders as empty."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        """The content as one string: text parts joined by newlines (vLLM's "string" format)."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)

    def as_template_input(self) -> dict[str, str]:
        """The {"role", "content"} dict chat templates expect."""
        return {"role": self.role, "content": self.text}


class ChatTemplateFields(Lenient):
    """vLLM's fields that shape how the chat template renders (chat and /tokenize). A request's
    own template is a Jinja program the server would run: refused unless the server trusts its
    clients (--trust-request-chat-template, vLLM's rule)."""

    chat_template: str | None = Field(default=None, min_length=1)  # a Jinja template for this request only
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template (say enable_thinking)
    documents: list[dict[str, str]] | None = None  # retrieved documents, for templates that render them (RAG)

    def template_options(self, trusted: bool) -> dict[str, Any]:
        """render_chat's keywords for these fields; a request template the server does not trust is a 400."""
        if self.chat_template is not None and not trusted:
            raise APIError(400, "Chat template is passed with request, but --trust-request-chat-template is not set. "
                                "Refused request with untrusted chat template.", param="chat_template")
        return {"chat_template": self.chat_template, "documents": self.documents,
                "template_kwargs": self.chat_template_kwargs}


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    """POST /v1/chat/completions. The messages go through the checkpoint's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # None: until the context is full
    max_tokens: int | None = None  # the older name of max_completion_tokens
    logprobs: bool = False
    top_logprobs: int | None = None  # alternatives per token; needs logprobs=true
    add_special_tokens: Literal[False] = False  # vLLM's; the chat template already writes them
    # vLLM's chat template controls
    add_generation_prompt: bool = True  # end the prompt where a new assistant message starts
    continue_final_message: bool = False  # leave the last message open: the model continues it (a "prefill")
    echo: bool = False  # the answer starts with the last message's content, when that message has the answer's role
    prompt_logprobs: int | None = None  # log-probabilities of the rendered prompt's tokens

    @model_validator(mode="after")
    def one_way_to_end_the_prompt(self) -> ChatCompletionRequest:
        if self.continue_final_message and "add_generation_prompt" in self.model_fields_set \
                and self.add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to true")
        return self

    @property
    def generation_prompt(self) -> bool:
        """Whether the template adds the assistant's header (continue_final_message leaves it out)."""
        return self.add_generation_prompt and not self.continue_final_message

    @property
    def answer_role(self) -> str:
        """The role of the answer (vLLM's): the assistant's after a generation prompt, otherwise
        the last message's, which the model continues."""
        return "assistant" if self.generation_prompt else self.messages[-1].role

    @property
    def echoed(self) -> str:
        """What echo puts before every answer: the last message's content if it has the answer's
        role (the part of the message the client wrote), else nothing."""
        last = self.messages[-1]
        return last.text if self.echo and last.role == self.answer_role else ""

    @property
    def top_logprobs_wanted(self) -> int | None:
        """Alternatives to show per token (None: no logprobs; EVERY_REPORTED: logprob_token_ids)."""
        if not self.logprobs:
            return None
        return EVERY_REPORTED if self.logprob_token_ids is not None else (self.top_logprobs or 0)

    @property
    def max_tokens_field(self) -> tuple[str, int | None]:
        """The limit on the answer's length, and the name it came under."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def check_logprobs(self, limit: int, vocab_size: int) -> None:
        """The logprobs asked for within the server's cap (check_logprobs); -1 becomes the vocabulary's size."""
        self.top_logprobs = check_logprobs("top_logprobs", self.top_logprobs, limit, vocab_size)
        self.prompt_logprobs = check_logprobs("prompt_logprobs", self.prompt_logprobs, limit, vocab_size, "prompt")
        self.check_listed(self.logprobs)

    def sampling_params(self) -> SamplingParams:
        """Raises ValueError for values the engine refuses, or contradictory fields. With echo
        (and no stream), the prompt's logprobs come too, with top_logprobs alternatives (vLLM's)."""
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_completion_tokens or max_tokens (its older name), not both")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.stream and self.prompt_logprobs:
            raise ValueError("prompt_logprobs are not available when stream=true")
        kwargs = self.sampling_kwargs() | {"max_tokens": self.max_tokens_field[1]}
        if self.logprobs:
            kwargs["logprobs"] = self.top_logprobs or 0  # 0: the chosen token's log-probability only
        if self.prompt_logprobs is not None and not self.stream:
            kwargs["prompt_logprobs"] = self.prompt_logprobs
        elif self.echo and not self.stream:
            kwargs["prompt_logprobs"] = self.top_logprobs or 0
        return SamplingParams(**kwargs)


class BatchChatCompletionRequest(ChatCompletionRequest):
    """POST /v1/chat/completions/batch (vLLM's): the fields of a chat request, with `messages` a
    list of conversations; choice i answers conversation i. One answer each (n=1), no stream."""

    messages: list[list[ChatMessage]] = Field(min_length=1)  # type: ignore[assignment]

    @field_validator("messages")
    @classmethod
    def no_empty_conversation(cls, value: list[list[ChatMessage]]) -> list[list[ChatMessage]]:
        if any(not conversation for conversation in value):
            raise ValueError("every conversation needs at least one message")
        return value

    @model_validator(mode="after")
    def one_answer_each(self) -> BatchChatCompletionRequest:
        if self.stream:
            raise ValueError("batch chat completions do not stream: leave out stream (or set it to false)")
        if self.n != 1:
            raise ValueError(f"batch chat completions answer each conversation once: n must be 1, got {self.n}")
        return self

    def conversations(self) -> list[ChatCompletionRequest]:
        """One chat request per conversation, with every other field as given (already checked)."""
        fields = {name: getattr(self, name) for name in ChatCompletionRequest.model_fields if name != "messages"}
        return [ChatCompletionRequest.model_construct(self.model_fields_set, messages=conversation, **fields)
                for conversation in self.messages]


class TokenizeRequest(ChatTemplateFields):
    """POST /tokenize (vLLM's): a text prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # text prompts only: the chat template writes its own
    add_generation_prompt: bool = True  # messages only: end where the assistant's answer starts
    continue_final_message: bool = False  # messages only: leave the last message open
    tools: list[dict[str, Any]] | None = None  # messages only: tool definitions, for templates that render them
    return_token_strs: bool = False  # also each token's string, as the tokenizer spells it

    @model_validator(mode="after")
    def one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give `prompt` (text) or `messages` (a chat), exactly one of them")
        templating = [name for name in ("chat_template", "chat_template_kwargs", "documents", "tools")
                      if getattr(self, name) is not None]
        if self.prompt is not None and templating:
            raise ValueError(f"{templating} shape how `messages` render: a text `prompt` does not go through the "
                             f"chat template")
        if self.continue_final_message and "add_generation_prompt" in self.model_fields_set \
                and self.add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to true")
        return self


class DetokenizeRequest(Lenient):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int]
