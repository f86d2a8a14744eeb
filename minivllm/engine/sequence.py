"""One request as the engine sees it: its tokens, how many of them are in the KV cache, the
blocks holding them, and where it is in its life (chapter 7).

The whole scheduler rests on two counters. `num_tokens` is the prompt plus everything sampled
so far; `num_computed_tokens` is how many of those already went through the model (their K
and V sit in the cache). A step moves `num_computed_tokens` forward by whatever the scheduler
grants; when it catches up with `num_tokens`, the last position's logits give a new token and
`num_tokens` moves one ahead again. Prefill, chunked prefill, decode and recompute after a
preemption are all this one rule; nothing in the engine asks "is this a prefill?".
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from minivllm.engine.sampler import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued, nothing (or, after a preemption, nothing any more) in the cache
    RUNNING = "running"  # owns blocks; gets tokens scheduled every step the budget allows
    FINISHED = "finished"  # done; its blocks are back in the pool


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_model_len: int
    arrival_time: float = field(default_factory=time.perf_counter)
    prompt: str | None = None  # the text, when the request came as text
    token_ids: list[int] = field(init=False)  # prompt + output, the whole sequence
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "length", "stop" or "abort"
    num_preemptions: int = 0
    first_token_time: float | None = None  # when its first output token was sampled
    finish_time: float | None = None
    generator: torch.Generator | None = None  # private randomness for sampled requests

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
        compute its final sampled token, hence the - 1)."""
        return min(self.num_prompt_tokens + self.params.max_tokens, self.max_model_len) - 1

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token: int, eos_token_ids: set[int], now: float) -> None:
        """Add a sampled token and decide whether the request is done."""
        self.token_ids.append(token)
        if self.first_token_time is None:
            self.first_token_time = now
        stops = self.params.stop_token_ids
        if token in stops or (token in eos_token_ids and not self.params.ignore_eos):
            self.finish_reason = "stop"  # like vLLM, the stop token stays in the output
        elif self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= self.max_model_len:
            self.finish_reason = "length"
