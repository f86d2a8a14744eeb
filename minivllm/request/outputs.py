"""What the engine hands back for a request, shaped like vLLM's outputs (chapters 7 and 10).

A request with n completions gets one RequestOutput whose `outputs[i]` is completion i.
Log-probabilities come as vLLM gives them: for every position, a dict from token id to
`Logprob`, holding the chosen token (sampled, or the prompt's own) and the top alternatives.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float  # natural log of the probability the model gave the token (before any sampling setting)
    rank: int | None = None  # 1 for the model's most likely token
    decoded_token: str | None = None  # the token alone as text (None without a tokenizer)


@dataclass
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str  # the decoded output ("" when the checkpoint has no tokenizer), without the stop string
    token_ids: list[int]
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs (only with logprobs)
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per output token, when asked for
    finish_reason: str | None = None  # "length", "stop", "abort", or None while still generating
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (None for EOS)


@dataclass
class RequestMetrics:
    """perf_counter() times, in seconds. TTFT = first_token_time - arrival_time."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0  # times its KV cache was thrown away and recomputed
    # Speculative decoding (chapter 12), over the request's completions: guesses the target
    # verified, and how many it kept (each kept guess is a token that cost no forward pass of its own).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # When a step first gave it tokens (its first completion to run): arrival -> here is its time
    # in the queue, here -> first_token_time its prefill (vLLM's name and meaning).
    first_scheduled_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False  # every completion is done
    metrics: RequestMetrics | None = None
    # One entry per prompt token: None for the first (nothing predicts it), then a dict as in
    # CompletionOutput.logprobs. None unless SamplingParams.prompt_logprobs was set.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Prompt tokens whose K/V came from the prefix cache instead of being computed (chapter 11),
    # summed over the request's completions (each of the n looks the prompt up).
    num_cached_tokens: int = 0
