"""One request as the engine sees it: its tokens, how many of them are in the KV cache, the
blocks holding them, and where it is in its life (chapter 7).

The whole scheduler rests on two counters. `num_tokens` is the prompt plus everything sampled
so far; `num_computed_tokens` is how many of those already went through the model (their K
and V sit in the cache). A step moves `num_computed_tokens` forward by whatever the scheduler
grants; when it catches up with `num_tokens`, the last position's logits give a new token and
`num_tokens` moves one ahead again. Prefill, chunked prefill, decode and recompute after a
preemption are all this one rule; nothing in the engine asks "is this a prefill?".

A request for n completions (chapter 10) is a `SequenceGroup` of n plain Sequences with the
same prompt: the scheduler and the block manager see n independent sequences, each with its
own block table, and only the engine knows they answer one request.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from minivllm.request.logprobs import TopLogprobs
from minivllm.request.sampling_params import SamplingParams

if TYPE_CHECKING:  # type hints only
    from minivllm.structured_outputs.matcher import SequenceGrammar


class Status(enum.Enum):
    WAITING = "waiting"  # queued, nothing (or, after a preemption, nothing any more) in the cache
    RUNNING = "running"  # owns blocks; gets tokens scheduled every step the budget allows
    FINISHED = "finished"  # done; its blocks are back in the pool


@dataclass(eq=False)  # compared by identity: `seq in scheduler.running` means this very sequence
class Sequence:
    request_id: str  # the request's id; "<id>#<i>" for completion i of a request with n > 1
    prompt_token_ids: list[int]
    params: SamplingParams
    max_model_len: int
    arrival_time: float = field(default_factory=time.perf_counter)
    prompt: str | None = None  # the text, when the request came as text
    index: int = 0  # which of its request's n completions this is
    group: SequenceGroup | None = field(default=None, repr=False)  # the request it belongs to
    token_ids: list[int] = field(init=False)  # prompt + output, the whole sequence
    num_computed_tokens: int = 0
    # Chapter 12: guesses appended to token_ids for this step's verification, at its end. They
    # live only inside one EngineCore.step (proposed, scheduled, verified, rolled back) and are
    # never output, counted as output, or cached under a prefix hash.
    num_spec_tokens: int = 0
    # Chapter 16 (async scheduling): tokens sampled by a step whose results the host has not read
    # yet, appended as core/async_scheduling.PLACEHOLDER at its end so that the scheduler plans
    # the next step. Never output, never cached under a prefix hash.
    num_output_placeholders: int = 0
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "length", "stop" or "abort"
    stop_reason: int | None = None  # the stop token id that ended it
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted (chapter 11)
    num_draft_tokens: int = 0  # guesses verified for it (chapter 12)
    num_accepted_tokens: int = 0  # of those, the ones the target kept
    first_scheduled_time: float | None = None  # when a step first gave it tokens (its queueing ended)
    first_token_time: float | None = None  # when its first output token was sampled
    finish_time: float | None = None
    generator: torch.Generator | None = None  # private randomness for sampled requests
    grammar: SequenceGrammar | None = None  # chapter 13: the grammar its output must fit, and its place in it

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this sequence can ever hold in the cache (it is never asked to
        compute its final sampled token, hence the - 1). max_tokens=None: up to the context."""
        limit = self.max_model_len
        if self.params.max_tokens is not None:
            limit = min(self.num_prompt_tokens + self.params.max_tokens, limit)
        return limit - 1

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token: int, eos_token_ids: set[int], now: float) -> None:
        """Add a sampled token and decide whether the sequence is done by its tokens: a stop
        token, EOS, or its length. (Stop strings are text: the output processor's.)"""
        self.token_ids.append(token)
        if self.first_token_time is None:
            self.first_token_time = now
        max_tokens = self.params.max_tokens
        if token in self.params.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token  # like vLLM, the stop token stays in the output
        elif token in eos_token_ids and not self.params.ignore_eos:
            self.finish_reason = "stop"
        elif (max_tokens is not None and self.num_output_tokens >= max_tokens) or self.num_tokens >= self.max_model_len:
            self.finish_reason = "length"


@dataclass(eq=False)
class SequenceGroup:
    """One request: the n sequences that complete the same prompt. It is finished when all of
    them are; an abort finishes all of them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    # Filled as the prompt is computed (by whichever sequence computes it first): None for the
    # first token, then one TopLogprobs per prompt token. None unless the request asked.
    prompt_logprobs: list[TopLogprobs | None] | None = None
    num_prompt_logprobs_sent: int = 0  # how many of them the core has put in an output already

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


@dataclass
class SchedulerOutput:
    """One step's plan: seqs[i] computes its next num_new_tokens[i] tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    kv_connector_metadata: Any = None  # chapter 17: the step's K/V loads and saves (kv_transfer/base.py)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_tokens)
