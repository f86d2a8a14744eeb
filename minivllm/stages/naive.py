"""Chapter 1 — naive decode: recompute everything for every new token.

To produce token n+1 we run the model over all n tokens so far, with a dense causal mask,
and keep only the last row of logits. Generating N tokens costs O(N^2) token-forwards.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from minivllm.attention.dense import attend
from minivllm.attention.masks import causal_mask
from minivllm.model import Decoder
from minivllm.stages.common import StageStats, as_tensor, prepare


class CausalAttention:
    """One sequence, no cache: every token attends to itself and all tokens before it."""

    def __init__(self, num_tokens: int, device: torch.device):
        self.mask = causal_mask(num_tokens, device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(q, k, v, self.mask)


@torch.inference_mode()
def stream(model: Decoder, prompt: list[int], max_new_tokens: int, stats: StageStats | None = None) -> Iterator[int]:
    """Yield the greedy continuation of one prompt, one token at a time."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        ids = as_tensor(tokens, model.device)
        positions = torch.arange(len(tokens), device=model.device)
        hidden = model(ids, positions, CausalAttention(len(tokens), model.device))  # all of it, again
        next_token = int(model.lm_head(hidden[-1]).argmax())
        if stats:
            stats.token_slots += len(tokens)
        tokens.append(next_token)
        yield next_token


def generate(
    model: Decoder, prompts: list[list[int]], max_new_tokens: int | list[int], stats: StageStats | None = None
) -> list[list[int]]:
    lengths = prepare(model, prompts, max_new_tokens)
    return [list(stream(model, p, n, stats)) for p, n in zip(prompts, lengths)]
