"""Attention over a paged KV cache, in plain PyTorch (chapter 6; Triton comes in chapter 8).

The cache is a pool of fixed-size blocks per layer:

    k, v: [layers, num_blocks, block_size, kv_heads, head_dim]

A sequence owns a *block table*, the list of physical blocks holding its tokens in order:
token p lives in block table[p // block_size] at offset p % block_size, i.e. in *slot*
table[p // block_size] * block_size + p % block_size of the flattened pool. Blocks need not
be contiguous or in order, so memory is reserved one block at a time, not one max-length
sequence at a time.

A step is a flat run of T tokens from S sequences (prefill chunks and decode tokens mixed).
`PagedBatch` describes it; `PagedAttention` stores the step's K/V into their slots, then lets
each sequence's queries attend to its cached past through its block table.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from minivllm.attention.dense import attend
from minivllm.attention.masks import chunk_mask


class PooledModel(Protocol):
    """What the pool reads of a model (a Decoder, or anything shaped like one): its config's
    num_layers, num_kv_heads and head_dim, its device and its dtype. Attention sits below the
    model that calls it, so it names no model class."""

    config: Any
    device: torch.device
    dtype: torch.dtype


class KVPool:
    """The physical KV memory: `num_blocks` blocks of `block_size` token slots, per layer, for
    `model` (read for its config's layers, KV heads and head_dim, its device and its dtype)."""

    def __init__(self, model: PooledModel, num_blocks: int, block_size: int):
        cfg = model.config
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=model.device, dtype=model.dtype)
        self.v = torch.zeros(shape, device=model.device, dtype=model.dtype)
        self.num_blocks, self.block_size = num_blocks, block_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat pool slots of token positions start..end-1 of a sequence with this block table.

    block_table: the sequence's physical block ids in logical order (long enough to hold
    position end - 1); start <= end: token positions; block_size: tokens per block. Returns a
    list of end - start ints: position p lives in block block_table[p // block_size] at offset
    p % block_size, i.e. in slot block_table[p // block_size] * block_size + p % block_size of
    the pool seen as one long row of slots. start == end gives []."""
    # BEGIN SOLUTION
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
    # END SOLUTION


@dataclass
class PagedBatch:
    """One step's layout. Sequence s contributes tokens query_start[s]:query_start[s+1] of the
    flat run; after this step its cache holds context_lens[s] tokens (past + new), found
    through block_tables[s] (padded with -1, never read past context_lens[s])."""

    query_lens: list[int]
    query_start: list[int]  # [S + 1], cumulative query_lens (cu_seqlens)
    context_lens: list[int]
    block_tables: torch.Tensor  # [S, max_blocks] int32 (int64 from the chapter-9 runner)
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K and V are written
    query_start_tensor: torch.Tensor  # [S + 1], query_start on the device
    context_lens_tensor: torch.Tensor  # [S], context_lens on the device
    # Sizes gathers and kernel grids, known on the host so nothing waits for the GPU. It is
    # max(context_lens) unless given: a CUDA graph (chapter 9) fixes it at the longest context
    # the engine allows, because a replayed graph cannot change its shapes.
    max_context_len: int | None = None
    # Set by a CUDA graph (chapters 9 and 12): every sequence brings exactly this many rows, the
    # real tokens first (a verify chunk padded to 1 + k), so row j of a sequence sees the keys up
    # to context - query_len + j. A graph replays with other lengths than it was captured with, so
    # attention must then size its work from this and read the lengths from the device tensors only.
    query_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_context_len is None:
            self.max_context_len = max(self.context_lens)

    @classmethod
    def build(
        cls, tables: list[list[int]], past_lens: list[int], query_lens: list[int], block_size: int,
        device: torch.device,
    ) -> PagedBatch:
        """From each sequence's block table, tokens already cached, and tokens in this step."""
        context_lens = [p + q for p, q in zip(past_lens, query_lens)]
        slots = [s for t, p, c in zip(tables, past_lens, context_lens) for s in slot_mapping(t, p, c, block_size)]
        width = max(len(t) for t in tables)
        padded = [t + [-1] * (width - len(t)) for t in tables]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            query_lens, starts, context_lens, torch.tensor(padded, **i32),
            torch.tensor(slots, dtype=torch.int64, device=device), torch.tensor(starts, **i32),
            torch.tensor(context_lens, **i32),
        )

    @cached_property  # read by every layer
    def is_decode(self) -> bool:
        """Every sequence brings exactly one new token (the common case once prompts are in)."""
        return all(q == 1 for q in self.query_lens)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write the step's k, v [T, Hkv, D] into the pool [num_blocks, block_size, Hkv, D]."""
    k_cache.view(-1, *k.shape[1:])[slots] = k  # the pool seen as one long row of slots
    v_cache.view(-1, *v.shape[1:])[slots] = v


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first `context_len` cached tokens of one sequence, in order: [context_len, Hkv, D].

    cache: one layer's K (or V) pool, [num_blocks, block_size, Hkv, D]; block_table: the
    sequence's physical block ids as a 1-D integer tensor, possibly padded with -1 past its
    last block (entries past ceil(context_len / block_size) must never be read); context_len:
    how many tokens to read, >= 1. Token p comes from block block_table[p // block_size] at
    offset p % block_size. Returns a new tensor (the pool is not changed)."""
    # BEGIN SOLUTION
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)  # ceil
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:context_len]
    # END SOLUTION


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, max_context_len: int, query_len: int = 1,
) -> torch.Tensor:
    """One query token per sequence, all sequences at once: q [S, Hq, D] -> [S, Hq, D].
    max_context_len (= max(context_lens), known on the host) sizes the gather without
    reading the device tensor back, which on a GPU would stall every layer.

    query_len Q > 1 (chapter 12's verify step): Q query rows per sequence, q [S * Q, Hq, D],
    sequence s owning rows s * Q .. s * Q + Q - 1; row j sees keys 0 .. context_lens[s] - Q + j.

    Gathers every sequence's blocks into a padded [S, L, Hkv, D] tensor (L = longest context,
    rounded up to whole blocks) and masks the padding: simple and batched, but it copies the
    whole context out of the pool first. The Triton kernel of chapter 8 reads it in place.
    """
    T, Hq, D = q.shape
    Q = query_len
    S = T // Q
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    num_blocks = -(-max_context_len // block_size)
    tables = block_tables[:, :num_blocks].clamp(min=0).long()  # padding -1 -> block 0, masked below
    # Same as k_cache[tables], but index_select on the pool seen as one row per block is a
    # plain copy of whole rows, several times faster than general indexing on CPU.
    keys = k_cache.flatten(1).index_select(0, tables.flatten()).view(S, -1, Hkv, D).transpose(1, 2)  # [S, Hkv, L, D]
    values = v_cache.flatten(1).index_select(0, tables.flatten()).view(S, -1, Hkv, D).transpose(1, 2)
    last = context_lens[:, None] - Q + torch.arange(Q, device=q.device)[None, :]  # [S, Q]: each row's newest key
    visible = torch.arange(keys.shape[2], device=q.device)[None, None, :] <= last[:, :, None]  # [S, Q, L]
    # softmax(q k^T / sqrt(D)) v, with the Q x G query rows that share a KV head (G query heads
    # per KV head, grouped-query attention) as Q x G rows of that head, without copying K and V.
    # PyTorch's fused kernel is the same math as attend() in dense.py, about twice as fast as two
    # einsums on CPU.
    G = Hq // Hkv
    qg = q.view(S, Q, Hkv, G, D).transpose(1, 2).reshape(S, Hkv, Q * G, D)
    mask = visible[:, None, :, None, :].expand(S, 1, Q, G, visible.shape[-1]).reshape(S, 1, Q * G, -1)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
    return out.view(S, Hkv, Q, G, D).transpose(1, 2).reshape(T, Hq, D)


class PagedAttention:
    """Chapter 6's attention: store into the pool, then attend through the block tables.

    Decode rows (sequences bringing one token) are batched into one paged_decode call; the
    prefill chunks, each with its own [chunk, context] mask, are attended one by one."""

    def __init__(self, pool: KVPool, batch: PagedBatch):
        self.pool, self.batch = pool, batch
        if batch.is_decode or batch.query_len:  # uniform rows, in order: the batch's tensors serve as they are
            return
        device = pool.k.device
        starts = batch.query_start  # the host copy: reading the device one back would wait for the GPU
        decodes = [s for s, q_len in enumerate(batch.query_lens) if q_len == 1]
        self.decode_rows = torch.tensor([starts[s] for s in decodes], dtype=torch.long, device=device)
        self.decode_tables = batch.block_tables[decodes]
        self.decode_lens = batch.context_lens_tensor[decodes]
        self.max_decode_len = max((batch.context_lens[s] for s in decodes), default=0)
        # (sequence, first row, mask) of each prefill chunk; masks built once, used by every layer
        self.chunks = [(s, starts[s], chunk_mask(q_len, ctx - q_len, device))
                       for s, (q_len, ctx) in enumerate(zip(batch.query_lens, batch.context_lens)) if q_len > 1]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache, batch = self.pool.k[layer], self.pool.v[layer], self.batch
        store_kv(k_cache, v_cache, k, v, batch.slot_mapping)
        if batch.is_decode or batch.query_len:
            return paged_decode(q, k_cache, v_cache, batch.block_tables, batch.context_lens_tensor,
                                batch.max_context_len, batch.query_len or 1)
        out = torch.empty_like(q)
        if len(self.decode_rows):
            out[self.decode_rows] = paged_decode(q[self.decode_rows], k_cache, v_cache, self.decode_tables,
                                                 self.decode_lens, self.max_decode_len)
        for s, start, mask in self.chunks:
            ctx, end = batch.context_lens[s], start + mask.shape[0]
            keys = gather_kv(k_cache, batch.block_tables[s], ctx)
            values = gather_kv(v_cache, batch.block_tables[s], ctx)
            out[start:end] = attend(q[start:end], keys, values, mask)
        return out
