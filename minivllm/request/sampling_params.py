"""How one request wants its tokens chosen: vLLM's SamplingParams, validated once, when made.

Every field is checked here, with the strictness of the whole engine: a value of the wrong type
is refused like a value out of range, never converted. The sampler (sampler.py) only reads them.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from minivllm.request.bad_words import tokenize_bad_words
from minivllm.structured_outputs.params import StructuredOutputsParams

# Temperatures below this are greedy (vLLM's threshold): dividing logits by 1e-30 overflows
# to inf and the softmax of inf is NaN, while the distribution it stands for is the argmax.
GREEDY_BELOW = 1e-5
# The most logprob_token_ids one request may list (vLLM's bound): each is a column of every
# generated position's report, gathered, copied to the host and sent to the client.
MAX_LOGPROB_TOKEN_IDS = 128


class RequestOutputKind(enum.Enum):
    """When the engine reports a request (vLLM's names). CUMULATIVE: every step that gives it
    a token, everything so far; DELTA: every step that gives it a token, only what is new since
    its last output (for streaming: chapter 15); FINAL_ONLY: once, when it finishes (LLM.generate)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _integer(name: str, value: Any, low: int | None = None, high: int | None = None, none: bool = False) -> int | None:
    """value as an int in [low, high]; a bool, a float, a string or (unless none) None is refused."""
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer{' or None' if none else ''}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be in [{low}, {'inf' if high is None else high}], got {value}")
    return int(value)


def _number(name: str, value: Any) -> float:
    """value as a finite float; a bool, a string, None or inf/NaN is refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def _items(name: str, value: Any, check) -> tuple:
    """A list or tuple (None: empty) with every item passed through check; a lone string, a
    dict or a set where a list belongs is refused."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise ValueError(f"{name} must be a list, got {type(value).__name__} {value!r}")
    return tuple(check(f"{name}[{i}]", item) for i, item in enumerate(value))


def _stop_string(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return value


def _is_token_id(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= 0


def _token_ids(name: str, value: Any, empty: str) -> tuple[int, ...] | None:
    """None, or a non-empty list of token ids (every bad item named at once; `empty` says why
    an empty list is refused)."""
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise ValueError(f"{name} must be a list of token ids, got {type(value).__name__} {value!r}")
    bad = [item for item in value if not _is_token_id(item)]
    if bad:
        raise ValueError(f"{name} must hold token ids (integers >= 0); these are not: {bad!r}")
    if not value:
        raise ValueError(f"{name} is empty: {empty}")
    return tuple(int(t) for t in value)


def _logit_bias(value: Any) -> dict[int, float] | None:
    """logit_bias: None, or a dict token id -> bias in [-100, 100] (OpenAI's range; vLLM clamps
    to it silently, here a bias outside it is refused). Every bad key and value is named at once."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(value).__name__} {value!r}")
    bad_keys = [key for key in value if not _is_token_id(key)]
    if bad_keys:
        raise ValueError(f"logit_bias keys must be token ids (integers >= 0); these are not: {bad_keys!r}")
    bad_values = {key: bias for key, bias in value.items()
                  if isinstance(bias, bool) or not isinstance(bias, numbers.Real) or not -100 <= bias <= 100}
    if bad_values:  # NaN fails the range check too
        raise ValueError(f"logit_bias values must be numbers in [-100, 100]; these are not: {bad_values!r}")
    return {int(key): float(bias) for key, bias in value.items()} or None


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates: vLLM's SamplingParams, with its names, defaults and meanings.

    n: completions of the prompt, sampled independently (one RequestOutput with n outputs).
    temperature: 0 (or anything below 1e-5) is greedy; top_k: 0 or -1 keep every token;
    top_p: 1 keeps every token; min_p: drop tokens less likely than min_p x the top token.
    presence_penalty, frequency_penalty (in [-2, 2]): subtracted from the logit of every token
    the output already holds, once / once per occurrence; repetition_penalty (> 0, 1 = off):
    divides the positive (multiplies the negative) logits of every token of the prompt and
    the output. seed: makes the request reproducible (completion i uses seed + i).
    stop: strings that end the request; the text stops before them (include_stop_str_in_output
    keeps them) and the output's stop_reason names the one found. stop_token_ids end it like
    EOS, and stay in the output. ignore_eos: generate past EOS (benchmarks use it so every
    request produces exactly max_tokens). max_tokens: None means until the context is full;
    min_tokens: EOS and stop tokens cannot be sampled before this many tokens.
    logprobs: also report, for every output token, its log-probability and the top `logprobs`
    alternatives; prompt_logprobs: the same for the prompt's tokens (0: the token's own only).
    logprob_token_ids (vLLM's): report these tokens' log-probabilities at every generated
    position in place of the top `logprobs` alternatives, whatever their rank (scoring a fixed
    set of labels); asking for them asks for logprobs (a `logprobs` left None becomes 0).
    output_kind: see RequestOutputKind.
    structured_outputs (chapter 13): a StructuredOutputsParams that the output must fit (a JSON
    schema, a regex, a list of choices, a grammar); the grammar decides where the output may
    end, so min_tokens must stay 0.
    logit_bias: token id -> a number in [-100, 100] added to that token's logit before
    sampling (-100 all but bans it, 100 all but forces it); allowed_token_ids: only these
    tokens may be sampled; bad_words: words that must not appear in the output: a word's last
    token is banned wherever the output already ends with the tokens before it (each word
    tokenized with and without a leading space, as vLLM does; see request/bad_words.py).
    All three change what is sampled, not the reported logprobs, which stay the model's
    (vLLM's default). Token ids are checked against the model's vocabulary when a request is
    added (`for_model`), where the tokenizer turns bad_words into `bad_words_token_ids`.

    Every field is checked when the params are made: a value of the wrong type (a float for
    an integer, a string for a number, None where None means nothing, a dict for a list) is a
    ValueError like a value out of range, never silently converted.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | Seq[str] | None = None
    stop_token_ids: Seq[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: Seq[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: Seq[int] | None = None
    bad_words: Seq[str] | None = None
    # Each bad word as the token sequences to ban (for_model fills it: only the frontend has the
    # tokenizer); it crosses to the engine core with the rest of the params.
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = field(default=None, init=False, repr=False)
    # Greedy, nothing changes the logits, nothing to report: the sampler's fast path (min_tokens
    # is checked per sequence: it stops mattering once min_tokens are out). Worked out once
    # here, because the sampler asks for every row of every step.
    argmax_only: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:  # the dataclass is frozen: normalise in place once
            object.__setattr__(self, name, value)

        put("n", _integer("n", self.n, low=1))
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            put(name, value)
        put("repetition_penalty", _number("repetition_penalty", self.repetition_penalty))
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 switches it off), got {self.repetition_penalty}")
        put("temperature", _number("temperature", self.temperature))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        put("top_p", _number("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        put("top_k", _integer("top_k", self.top_k, low=-1))  # -1 (vLLM) and 0 both switch it off
        put("min_p", _number("min_p", self.min_p))
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        put("seed", _integer("seed", self.seed, low=-2**63, high=2**63 - 1, none=True))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        put("stop", _items("stop", stop, _stop_string))
        put("stop_token_ids", _items("stop_token_ids", self.stop_token_ids, lambda name, t: _integer(name, t, low=0)))
        put("include_stop_str_in_output", _flag("include_stop_str_in_output", self.include_stop_str_in_output))
        put("ignore_eos", _flag("ignore_eos", self.ignore_eos))
        put("max_tokens", _integer("max_tokens", self.max_tokens, low=1, none=True))
        put("min_tokens", _integer("min_tokens", self.min_tokens, low=0, high=self.max_tokens))
        put("logprobs", _integer("logprobs", self.logprobs, low=0, none=True))
        put("prompt_logprobs", _integer("prompt_logprobs", self.prompt_logprobs, low=0, none=True))
        put("logprob_token_ids", _token_ids("logprob_token_ids", self.logprob_token_ids,
                                            "name the tokens to report (leave it out for the top-k alternatives)"))
        if self.logprob_token_ids is not None and len(self.logprob_token_ids) > MAX_LOGPROB_TOKEN_IDS:
            raise ValueError(f"logprob_token_ids lists {len(self.logprob_token_ids)} tokens, more than the "
                             f"{MAX_LOGPROB_TOKEN_IDS} a request may (vLLM's bound)")
        if self.logprob_token_ids is not None and self.logprobs is None:
            put("logprobs", 0)  # the listed ids replace the alternatives; the chosen token's own is reported too
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        # Chapter 13: the constraint itself was checked when it was made; here only how it fits the rest.
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__} {self.structured_outputs!r}")
            if self.min_tokens:
                raise ValueError(f"min_tokens={self.min_tokens} cannot be combined with structured_outputs: the "
                                 f"grammar alone decides where the output may end")
        put("logit_bias", _logit_bias(self.logit_bias))
        put("allowed_token_ids", _token_ids("allowed_token_ids", self.allowed_token_ids,
                                            "no token could ever be generated (leave it out to allow every token)"))
        put("bad_words", _items("bad_words", self.bad_words, _stop_string))
        if self.greedy and self.n > 1:
            raise ValueError(f"n must be 1 when sampling greedily (the {self.n} completions would be identical)")
        put("argmax_only", self.greedy and not self.penalised and not self.edits_logits and self.logprobs is None)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def logprob_columns(self) -> int | tuple[int, ...] | None:
        """What every generated position reports besides the chosen token: the listed
        logprob_token_ids (a tuple), else the top `logprobs` alternatives (an int); None: nothing."""
        return self.logprob_token_ids if self.logprob_token_ids is not None else self.logprobs

    @property
    def edits_logits(self) -> bool:
        """Whether the request changes its logits itself: a bias, a whitelist or bad words."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words)

    def for_model(self, tokenizer: Any, vocab_size: int) -> SamplingParams:
        """These params for one model (the input processor calls it when a request is added):
        bad_words tokenized into bad_words_token_ids, and every token id they name checked
        against the vocabulary [0, vocab_size), with a ValueError that lists each id outside it."""
        params = self
        if self.bad_words:
            if tokenizer is None:
                raise ValueError("bad_words need the model's tokenizer (they are text), and this model has none")
            params = dataclasses.replace(self)
            object.__setattr__(params, "bad_words_token_ids", tokenize_bad_words(self.bad_words, tokenizer))
        named = {"logit_bias": list(params.logit_bias or ()), "allowed_token_ids": list(params.allowed_token_ids or ()),
                 "logprob_token_ids": list(params.logprob_token_ids or ()),
                 "bad_words": [t for word in params.bad_words_token_ids or () for t in word]}
        outside = {name: sorted({t for t in ids if t >= vocab_size}) for name, ids in named.items()}
        if any(outside.values()):
            raise ValueError(f"token ids outside the model's vocabulary [0, {vocab_size}): "
                             + "; ".join(f"{ids} in {name}" for name, ids in outside.items() if ids))
        return params
