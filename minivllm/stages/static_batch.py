"""Chapter 3 — static batching: B prompts at once, left-padded into a rectangle.

One sequence at a time leaves the hardware idle: a decode step reads every weight to make
one token. Run B sequences together and the same weight reads make B tokens. The simplest
way: pad every prompt on the LEFT to the longest one, L, so the batch is a [B, L] rectangle,
and run it until its longest request is done.

The model stays flat: the rectangle is B*L tokens in a row, and only attention knows about
rows. It views q, k, v as [B, L, ...] and attends row by row, with a mask that is causal AND
hides the padding. Left padding puts every row's newest token in the last column, so one
slice reads each row's next-token logits and each decode step appends one column to all rows.

The price: padding slots, and rows that keep computing after their request has finished (a
rectangle cannot shrink). `count_waste` measures both.
"""
from __future__ import annotations

import torch

from minivllm.attention.dense import attend
from minivllm.attention.masks import padded_causal_mask
from minivllm.model import Decoder
from minivllm.stages.common import StageStats, prepare

PAD_ID = 0  # any valid token id: padding keys are hidden, so what they hold never matters

# Chapter 1's attention for one sequence, mapped over a leading batch axis: vmap runs all B
# rows in one batched call instead of a Python loop over rows.
batched_attend = torch.vmap(attend)


def left_pad(prompts: list[list[int]], device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and positions of the B prompts left-padded into a rectangle: (ids, positions),
    both [B, L] int64 tensors on `device`, L = the longest prompt. Row b is L - len(prompts[b])
    PAD_ID tokens, then the prompt. Positions count from 0 at each row's first real token (as
    if it ran alone); padding gets position 0, which does not matter since no real token sees it."""
    # BEGIN SOLUTION
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD_ID] * (L - len(p)) + p for p in prompts], device=device)
    pads = torch.tensor([L - len(p) for p in prompts], device=device)
    positions = torch.arange(L, device=device)[None, :] - pads[:, None]  # negative on padding
    return ids, positions.clamp(min=0)
    # END SOLUTION


def count_waste(prompt_lens: list[int], output_lens: list[int]) -> tuple[int, int]:
    """(token_slots, wasted_slots), two ints, of one static batch run to completion: B rows,
    row b with a prompt of prompt_lens[b] tokens and output_lens[b] >= 1 new tokens.

    Prefill computes the whole [B, L] rectangle, L = max(prompt_lens); then each of the
    max(output_lens) - 1 decode steps computes one slot per row, finished or not. Wasted: the
    padding, and the slots of rows whose request already has all its tokens."""
    # BEGIN SOLUTION
    B, L, N = len(prompt_lens), max(prompt_lens), max(output_lens)
    slots = B * L
    wasted = sum(L - p for p in prompt_lens)  # left padding
    for step in range(1, N):  # decode step k feeds token k and produces token k + 1
        slots += B
        wasted += sum(1 for n in output_lens if n <= step)  # rows already done
    return slots, wasted
    # END SOLUTION


class BatchKVCache:
    """K and V of B rows for every layer: [layers, B, max_len, kv_heads, head_dim], one rectangle."""

    def __init__(self, model: Decoder, batch: int, max_len: int):
        cfg = model.config
        shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.empty(shape, device=model.device, dtype=model.dtype)
        self.v = torch.empty(shape, device=model.device, dtype=model.dtype)
        self.length = 0  # columns filled so far: the same for every row


class PaddedBatchAttention:
    """The flat [B*n] tokens are B rows of n new tokens; each row attends to its own cache."""

    def __init__(self, cache: BatchKVCache, mask: torch.Tensor):
        self.cache, self.start, self.mask = cache, cache.length, mask  # mask: [B, n, start + n]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B = self.cache.k.shape[1]
        q, k, v = (x.view(B, -1, *x.shape[1:]) for x in (q, k, v))  # [B, n, heads, head_dim]
        end = self.start + k.shape[1]
        self.cache.k[layer, :, self.start:end] = k
        self.cache.v[layer, :, self.start:end] = v
        out = batched_attend(q, self.cache.k[layer, :, :end], self.cache.v[layer, :, :end], self.mask)
        return out.flatten(0, 1)  # back to flat [B*n, heads, head_dim]


def generate_batch(
    model: Decoder, prompts: list[list[int]], lengths: list[int], stats: StageStats | None
) -> list[list[int]]:
    """Run one static batch until its longest request is done."""
    B, N = len(prompts), max(lengths)
    prompt_lens = [len(p) for p in prompts]
    ids, positions = left_pad(prompts, model.device)
    L = ids.shape[1]
    cache = BatchKVCache(model, B, L + N)
    # Which cache columns of each row hold real tokens: everything right of the padding.
    pads = torch.tensor([L - p for p in prompt_lens], device=model.device)
    is_real_key = torch.arange(L + N, device=model.device)[None, :] >= pads[:, None]  # [B, L + N]
    mask = padded_causal_mask(prompt_lens, model.device)  # prefill: [B, L, L]
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in range(N):  # step 0 is the prefill, then one decode step per token
        hidden = model(ids.flatten(), positions.flatten(), PaddedBatchAttention(cache, mask))
        cache.length += ids.shape[1]
        newest = hidden.view(B, ids.shape[1], -1)[:, -1]  # last column: every row's newest token
        next_tokens = model.lm_head(newest).argmax(-1)  # [B]
        for out, token in zip(outputs, next_tokens.tolist()):
            out.append(token)
        if stats:
            # Real KV: the prompt plus the tokens fed back, up to the request's own length.
            used = sum(p + min(step, n - 1) for p, n in zip(prompt_lens, lengths))
            stats.record_kv(used=used, reserved=B * cache.k.shape[2])
        # Decode: one new column. Its query (a real token) sees every real key cached so far.
        ids, positions = next_tokens[:, None], positions[:, -1:] + 1
        mask = is_real_key[:, None, :cache.length + 1]  # [B, 1, length + 1]
    if stats:
        slots, wasted = count_waste(prompt_lens, lengths)
        stats.token_slots += slots
        stats.wasted_slots += wasted
    return [out[:n] for out, n in zip(outputs, lengths)]  # tokens past a request's end are dropped


@torch.inference_mode()
def generate(
    model: Decoder, prompts: list[list[int]], max_new_tokens: int | list[int], stats: StageStats | None = None,
    batch_size: int = 8,
) -> list[list[int]]:
    """Prompts in input order, `batch_size` at a time; each batch runs to its longest output."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    lengths = prepare(model, prompts, max_new_tokens)
    outputs: list[list[int]] = [[] for _ in prompts]
    todo = [i for i, n in enumerate(lengths) if n > 0]  # a request for 0 tokens needs no forward pass
    for first in range(0, len(todo), batch_size):
        batch = todo[first:first + batch_size]
        results = generate_batch(model, [prompts[i] for i in batch], [lengths[i] for i in batch], stats)
        for i, tokens in zip(batch, results):
            outputs[i] = tokens
    return outputs
