"""Chapter 2 — KV cache: prefill once, then decode one token at a time against the cache.

Keys and values of past tokens never change (the model is causal), so we keep them: a
contiguous per-sequence cache [layers, max_len, kv_heads, head_dim] for K and one for V.
Prefill runs the prompt once and fills the cache; each decode step runs ONE token, appends
its K/V, and attends to everything cached. Generating N tokens now costs O(N) token-forwards.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from minivllm.attention.dense import attend
from minivllm.attention.masks import causal_mask
from minivllm.model import Decoder
from minivllm.stages.common import StageStats, as_tensor, prepare


def append_kv(cache: torch.Tensor, new: torch.Tensor, start: int) -> torch.Tensor:
    """Write `new` [T, Hkv, D] into `cache` [max_len, Hkv, D] at rows start..start+T-1, in
    place (the cache is the storage every later step reads), and return the filled part of
    the cache, rows 0..start+T-1: [start + T, Hkv, D]. Rows after start+T-1 stay untouched."""
    # BEGIN SOLUTION
    end = start + new.shape[0]
    cache[start:end] = new
    return cache[:end]
    # END SOLUTION


class KVCache:
    """K and V for every layer of one sequence, preallocated for `max_len` tokens."""

    def __init__(self, model: Decoder, max_len: int):
        cfg = model.config
        shape = (cfg.num_layers, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.empty(shape, device=model.device, dtype=model.dtype)
        self.v = torch.empty(shape, device=model.device, dtype=model.dtype)
        self.length = 0  # tokens cached so far


class CachedAttention:
    """The step's new tokens are appended to the cache, then attend to all of it."""

    def __init__(self, cache: KVCache, num_new: int):
        self.cache, self.start, self.num_new = cache, cache.length, num_new
        # Prefill: the prompt is causal within itself. Decode: one query that sees the whole
        # cache, so the mask is a single row of ones and we can skip it.
        self.mask = causal_mask(num_new, cache.k.device) if num_new > 1 else None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys = append_kv(self.cache.k[layer], k, self.start)
        values = append_kv(self.cache.v[layer], v, self.start)
        return attend(q, keys, values, self.mask)


@torch.inference_mode()
def stream(model: Decoder, prompt: list[int], max_new_tokens: int, stats: StageStats | None = None) -> Iterator[int]:
    """Yield the greedy continuation of one prompt: one prefill, then one token per step."""
    cache = KVCache(model, len(prompt) + max_new_tokens)
    tokens = as_tensor(prompt, model.device)
    for _ in range(max_new_tokens):
        positions = torch.arange(cache.length, cache.length + len(tokens), device=model.device)
        hidden = model(tokens, positions, CachedAttention(cache, len(tokens)))
        cache.length += len(tokens)
        if stats:
            stats.token_slots += len(tokens)
            stats.record_kv(used=cache.length, reserved=cache.k.shape[1])
        next_token = int(model.lm_head(hidden[-1]).argmax())
        tokens = as_tensor([next_token], model.device)  # only the new token goes in next time
        yield next_token


def generate(
    model: Decoder, prompts: list[list[int]], max_new_tokens: int | list[int], stats: StageStats | None = None
) -> list[list[int]]:
    lengths = prepare(model, prompts, max_new_tokens)
    return [list(stream(model, p, n, stats)) for p, n in zip(prompts, lengths)]
