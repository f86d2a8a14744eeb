"""What every stage shares: input checks, per-prompt output lengths, and the counters that
benchmarks read (work done, padding wasted, KV memory reserved vs used)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.model import Decoder


@dataclass
class StageStats:
    """Filled in by a stage while it runs, when the caller passes `stats=StageStats()`.

    token_slots: token positions pushed through the model (real, padding and finished rows).
    wasted_slots: of those, slots spent on padding or on rows whose request had finished.
    kv_used / kv_reserved: token-steps of KV cache holding real tokens / reserved, summed over
    steps, so kv_used / kv_reserved is the time-averaged KV utilisation.
    peak_kv_tokens: the most KV token slots reserved at once.
    """

    token_slots: int = 0
    wasted_slots: int = 0
    kv_used: int = 0
    kv_reserved: int = 0
    peak_kv_tokens: int = 0

    def record_kv(self, used: int, reserved: int) -> None:
        self.kv_used += used
        self.kv_reserved += reserved
        self.peak_kv_tokens = max(self.peak_kv_tokens, reserved)

    @property
    def padding_waste(self) -> float:
        return self.wasted_slots / self.token_slots if self.token_slots else 0.0

    @property
    def kv_utilisation(self) -> float | None:
        return self.kv_used / self.kv_reserved if self.kv_reserved else None


def output_lengths(max_new_tokens: int | list[int], num_prompts: int) -> list[int]:
    """One output length per prompt, from a single int or a list."""
    if isinstance(max_new_tokens, int):
        return [max_new_tokens] * num_prompts
    if len(max_new_tokens) != num_prompts:
        raise ValueError(f"got {len(max_new_tokens)} max_new_tokens values for {num_prompts} prompts")
    return list(max_new_tokens)


def check_requests(model: Decoder, prompts: list[list[int]], lengths: list[int]) -> None:
    """Refuse what cannot be served, with a message that says why (nothing is truncated)."""
    cfg = model.config
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
        if n < 0:
            raise ValueError(f"prompt {i}: max_new_tokens must be >= 0, got {n}")
        bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {cfg.vocab_size}): {bad[:5]}")
        if len(prompt) + n > cfg.max_position_embeddings:
            raise ValueError(
                f"prompt {i}: {len(prompt)} prompt tokens + {n} new tokens exceed the model's context of "
                f"{cfg.max_position_embeddings} tokens"
            )


def prepare(model: Decoder, prompts: list[list[int]], max_new_tokens: int | list[int]) -> list[int]:
    """Validate a stage's inputs and return the output length of each prompt."""
    lengths = output_lengths(max_new_tokens, len(prompts))
    check_requests(model, prompts, lengths)
    return lengths


def as_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
