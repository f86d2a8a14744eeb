"""Turn each sequence's logits into its next token: greedy, or sampled with temperature,
top-k and top-p (chapter 7).

Sampled rows draw their randomness from the request's own `torch.Generator`, seeded from
`SamplingParams.seed`, so a request's tokens do not depend on which other requests share the
step. To sample from probabilities p with a private generator we use the "exponential race":
draw E_i ~ Exp(1) for every token and pick argmax p_i / E_i, which picks token i with
probability exactly p_i (the same trick vLLM and nano-vllm use; it needs no cumulative sums).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates, shaped like vLLM's SamplingParams.

    temperature 0 means greedy; top_k=0 and top_p=1 switch those filters off; `seed` makes the
    request's samples reproducible; `ignore_eos` keeps generating past EOS (benchmarks use it
    so every request produces exactly max_tokens); `stop_token_ids` end the request like EOS.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] | list[int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:  # also refuses NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        # A tuple, so the (frozen) params can be shared between requests safely.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep, in each row, the top_k largest logits (0 = all) and then the smallest set of the
    most likely tokens whose probabilities add up to at least top_p; the rest become -inf.

    logits: [S, V] (already divided by the temperature); top_k: [S] int; top_p: [S] float.
    """
    # BEGIN SOLUTION
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, logits.shape[-1])[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # A token is cut when the tokens ranked above it already reach top_p (the top one never is).
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    # END SOLUTION


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """One token per row of logits [S, V]; row s follows params[s] and draws from generators[s]."""
    tokens = logits.argmax(dim=-1)  # right for the greedy rows, overwritten below for the others
    rows = [s for s, p in enumerate(params) if not p.greedy]
    if rows:
        device = logits.device
        chosen = [params[s] for s in rows]
        temperature = torch.tensor([p.temperature for p in chosen], device=device)[:, None]
        top_k = torch.tensor([p.top_k for p in chosen], device=device)
        top_p = torch.tensor([p.top_p for p in chosen], device=device)
        scaled = logits[rows].float() / temperature  # softmax(logits / T), in fp32 even for bf16 models
        probs = filter_logits(scaled, top_k, top_p).softmax(dim=-1)
        # One row of Exp(1) noise per request, each from that request's own generator.
        noise = torch.stack([torch.empty_like(probs[0]).exponential_(generator=generators[s]) for s in rows])
        tokens[rows] = (probs / noise).argmax(dim=-1)
    return tokens.tolist()
