"""Chapter 8 — paged attention in Triton: three kernels that read the KV pool in place.

Chapter 6's PyTorch paged attention (paged.py) first *copies* every sequence's blocks out of
the pool into a padded [S, L, Hkv, D] tensor and then attends to the copy. Decode attention
does almost no arithmetic per byte (each K/V element is used once per query head that shares
it), so its speed is the speed of reading the cache; an extra copy, plus padding to the
longest context, is most of the cost. The kernels here follow the block table themselves:

    store_kv            the step's new K/V -> their slots in the pool       (one program per token)
    paged_decode        one query token per sequence, split-K "flash-decoding":
                          pass 1: each program attends to one *partition* of one sequence's
                                  context for all query heads of one KV head -> a partial
                                  softmax (max, sum, unnormalised weighted V)
                          pass 2: merge the partitions of each (sequence, head)
                        or, when one partition per sequence already fills the GPU, a single
                        pass that finishes the softmax and writes the output (decode_plan)
    paged_prefill       ragged query chunks of several sequences in one flat run, each
                        attending causally to its cached past plus its own chunk

The kernels share two helpers: `_kv_tile` (where BLOCK_N consecutive tokens of a sequence
live in the pool) and `_online_softmax_step` (fold one tile of scores into a running softmax).

Reading a tile through the block table. Token p of a sequence lives in physical block
table[p // block_size] at offset p % block_size, so a tile of BLOCK_N consecutive tokens is
BLOCK_N rows of D contiguous elements at scattered addresses. We compute one address per row:
the tile never needs to line up with blocks, so block_size 1, 16 or 13 all work, and the tile
stays wide enough (>= 16 tokens) for tensor-core matmuls even when blocks are tiny.

Online softmax. softmax(s) v = sum_j exp(s_j - m) v_j / sum_j exp(s_j - m) for any m; taking
m = max_j s_j keeps every exp() <= 1. Walking the keys tile by tile we keep the running max
m, the running sum l = sum exp(s_j - m) and the running weighted values acc = sum exp(s_j - m)
v_j; when a tile raises the max from m to m', everything so far is rescaled by exp(m - m').
Two partial results over disjoint keys merge by the same rule: `merge_partials`, the chapter's
exercise, is that merge in PyTorch; `_merge_partials_kernel` is the same code in Triton.

Memory traffic of a decode step, per layer: the cached K and V of every sequence, read once
(2 x context x Hkv x D elements per sequence; the Hq / Hkv query heads of a KV head share the
read), plus q and the output, plus the fp32 partials written by pass 1 and read by pass 2
(Hq x P x (D + 2) floats per sequence for P partitions; none when P = 1). At batch 64 x 4,096
tokens with Qwen3-0.6B's heads in bf16 that is 1 GiB of K/V against 4 MiB of partials (P = 8):
the kernel can only be as fast as the GPU reads memory, and a good one gets close.

Why split, and the price (decode_plan, the one rule). Without a split the grid has one program
per (sequence, KV head): too few to fill a GPU at small batches or long contexts, and at large
batches of *uneven* contexts (the nano workload: 256 sequences of 100 to 2,048 tokens) the
programs of the longest contexts finish last while the other SMs idle. Split-K cuts each
sequence's context into P partitions, one program each, so programs are many and short. The
price: P partial softmaxes per query head in fp32, written and then read by the merge (on the
nano batch at P = 2, 8.5 MB against 1.1 GB of K/V), and a second launch; so P = 1, one pass that
writes the output itself, wherever the grid is already full.

What Triton compiles. A kernel is compiled once per *variant*: its constexpr arguments, and
what Triton assumes about the others unless told not to (an int equal to 1 or divisible by 16,
a pointer aligned to 16 bytes). The engine's step inputs are views into one packed buffer
(worker/prepare.py) whose offsets move with the step's numbers of tokens and sequences, and the
tables' row stride is the step's longest table: left to Triton, each new parity or width would
compile a variant in the middle of a run. Those arguments are marked `do_not_specialize` /
`do_not_specialize_on_alignment` below (index arrays, read by scalar or gathering loads that
the assumptions do not speed up), and the merge's tile of partitions is one size up to MAX_PARTITIONS: what is left to
compile is a model's shapes, the dtype, and decode's two paths (one pass or split).

Triton is imported at the top: import this module only where triton is installed. Kernels are
compiled for the GPU unless TRITON_INTERPRET=1 was set before this module was imported, in
which case they run (slowly) on the CPU in Triton's interpreter (see INTERPRETED). The
interpreter gets bfloat16 matmuls wrong (triton-lang/triton#11584), so CPU checks use float32.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from minivllm.triton_support import built_for_interpreter

# ------------------------------------------------------------------------------------------
# The exercise: merging partial softmaxes, in plain PyTorch
# ------------------------------------------------------------------------------------------


def merge_partials(maxes: torch.Tensor, sums: torch.Tensor, accs: torch.Tensor) -> torch.Tensor:
    """Combine P partial attention results over disjoint sets of keys into the full result.

    Partial i saw scores s_j over its keys and kept maxes[..., i] = m_i = max_j s_j,
    sums[..., i] = l_i = sum_j exp(s_j - m_i) and accs[..., i, :] = sum_j exp(s_j - m_i) v_j.
    A partial that saw no keys has m_i = -inf, l_i = 0, acc_i = 0 and must not count.
    maxes, sums: [..., P]; accs: [..., P, D]. Returns softmax(all scores) @ v: [..., D].
    """
    # BEGIN SOLUTION
    m = maxes.amax(dim=-1, keepdim=True)  # the global max (finite: some partial saw a key)
    weights = torch.exp(maxes - m)  # exp(m_i - m) moves partial i to the global max; empty -> 0
    total = (weights * sums).sum(dim=-1)  # sum over all keys of exp(s_j - m)
    return (weights[..., None] * accs).sum(dim=-2) / total[..., None]
    # END SOLUTION


# ------------------------------------------------------------------------------------------
# Shared pieces of the attention kernels
# ------------------------------------------------------------------------------------------


@triton.jit
def _block_ids(table_ptr, positions, context_len, BLOCK_SIZE: tl.constexpr):
    """The physical block of each of `positions` (BLOCK_N logical token positions of one
    sequence): one block-table entry per token (neighbouring tokens share entries; those loads
    hit the L1 cache). Positions past the context read nothing and get block 0, masked later."""
    return tl.load(table_ptr + positions // BLOCK_SIZE, mask=positions < context_len, other=0)


@triton.jit
def _kv_rows(block, positions, context_len, kv_head, dims, dim_ok,
             stride_block, stride_slot, stride_head, BLOCK_SIZE: tl.constexpr):
    """Offsets of the K/V rows of `positions`, whose blocks are `block`, in the pool, for one
    KV head, and which of them exist (position < context_len). K and V pools have the same
    shape, so the same offsets serve both."""
    exists = positions < context_len
    row = block.to(tl.int64) * stride_block + (positions % BLOCK_SIZE) * stride_slot + kv_head * stride_head
    offsets = row[:, None] + dims[None, :]  # [BLOCK_N, BLOCK_D]: D contiguous elements per row
    return offsets, exists[:, None] & dim_ok[None, :], exists


@triton.jit
def _kv_tile(
    table_ptr, positions, context_len, kv_head, dims, dim_ok,
    stride_block, stride_slot, stride_head, BLOCK_SIZE: tl.constexpr,
):
    """_block_ids then _kv_rows: where the K/V rows of `positions` live, and which exist."""
    block = _block_ids(table_ptr, positions, context_len, BLOCK_SIZE)
    return _kv_rows(block, positions, context_len, kv_head, dims, dim_ok, stride_block, stride_slot, stride_head,
                    BLOCK_SIZE)


@triton.jit
def _online_softmax_step(scores, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold one tile into the running softmax of each row: scores [M, BLOCK_N] (fp32, -inf
    where hidden), v [BLOCK_N, BLOCK_D]; m_i, l_i [M] and acc [M, BLOCK_D] in fp32; the p·v
    product in DOT_PRECISION (exact "ieee" for fp32 values, as the scores' product).
    A row that has seen no visible key yet, here included, keeps (-inf, 0, 0): a verify row
    (chapter 12) may find every key of a tile past its own position."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # exp(-inf - -inf) would be NaN
    alpha = tl.exp(m_i - m_safe)  # rescales what was summed under the old max (0 at the start)
    p = tl.exp(scores - m_safe[:, None])  # this tile's unnormalised probabilities, <= 1
    l_i = l_i * alpha + tl.sum(p, 1)
    # p is cast to V's dtype (bf16 on a GPU) so the second matmul runs on tensor cores too.
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 matmuls in exact fp32 ("ieee") rather than TF32, so fp32 runs match PyTorch."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The kernels assume the last dimension is contiguous and K, V share one layout."""
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("paged attention kernels need contiguous head_dim and identical K/V cache layouts")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads cannot share {k_cache.shape[2]} KV heads evenly")


# ------------------------------------------------------------------------------------------
# 1. Store: the step's new K and V into their slots
# ------------------------------------------------------------------------------------------


# Arguments that change from step to step are not specialised on (see the module doc): here the
# slots, a view into the step's packed inputs.
@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    stride_k_token, stride_k_head, stride_v_token, stride_v_head, stride_cache_slot, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per new token: read its [Hkv, D] keys and values, write them to its slot.
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)  # int64: slots of a large pool can pass 2**31 elements
    heads = tl.arange(0, BLOCK_H)[:, None]  # BLOCK_H, BLOCK_D: powers of two >= Hkv, D
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    destination = slot * stride_cache_slot + heads * stride_cache_head + dims
    k = tl.load(k_ptr + token * stride_k_token + heads * stride_k_head + dims, mask=mask)
    tl.store(k_cache_ptr + destination, k, mask=mask)
    v = tl.load(v_ptr + token * stride_v_token + heads * stride_v_head + dims, mask=mask)
    tl.store(v_cache_ptr + destination, v, mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Triton version of paged.store_kv: k, v [T, Hkv, D] into the pool [num_blocks,
    block_size, Hkv, D] at flat slots [T] (int64)."""
    T, Hkv, D = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or not k_cache.is_contiguous() or k_cache.stride() != v_cache.stride():
        raise ValueError("store_kv needs contiguous head_dim in k, v and one contiguous layout for both caches")
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=Hkv, HEAD_DIM=D, BLOCK_H=triton.next_power_of_2(Hkv), BLOCK_D=triton.next_power_of_2(D),
    )


# ------------------------------------------------------------------------------------------
# 2. Decode: split-K ("flash-decoding") over the paged context
# ------------------------------------------------------------------------------------------

# How the decode work is cut (decode_plan). A (sequence, KV head) pair is the natural unit:
# its query heads share every K/V byte it reads. At batch 64 with 8 KV heads that is 512
# programs, about four per SM of an H100 (132 SMs): too few to keep enough loads in flight,
# so each pair's context is split into P partitions, one program each, and a second kernel
# merges the P partial softmaxes. Splitting has a price: P partial results in fp32 written
# and read back, and a second launch. So:
# - P comes from the grid: enough programs for PROGRAMS_PER_SM on every SM, never partitions
#   shorter than MIN_PARTITION_TILES tiles (their partials and merge would cost more than the
#   parallelism buys), and never more than MAX_PARTITIONS.
# - PROGRAMS_PER_SM is set for *uneven* contexts, such as the nano workload's 100 to 2,048
#   tokens at batch 256. The GPU hands programs to SMs as SMs free up, and the launch ends when
#   its last program does: with n programs per SM the idle tail is about one program's work out
#   of n, and a program's work is its share of its own sequence's context. Even contexts give
#   equal programs and no tail beyond the last wave; uneven ones leave SMs idle while the longest
#   sequences finish. Measured on an H100 at batch 64 x 4,096 (even): 2,048 to 4,096 programs
#   reach 93-95 % of copy bandwidth and 1,024 reach 81 %, so 32 per SM (4,224 on 132 SMs)
#   should cost even batches nothing and halve the tail of uneven ones: batch 256 x 8 KV heads,
#   2,048 pairs, splits in two, where 16 per SM kept it in one pass (the kernel benchmark's
#   uneven batch measures both, and 4 and 8 partitions). The rule cannot look at the contexts
#   themselves (next point), so it takes every batch to be uneven.
# - P == 1 (big batches, short contexts) is a single pass: the kernel normalises its own
#   result and writes the output; no partials, no merge launch.
# - P depends on host integers only (batch, KV heads, max_context_len, the GPU's SM count),
#   never on the contexts themselves, so a CUDA graph can capture the launch. The kernel then
#   cuts *each sequence's own* context into P equal partitions (whole tiles): a sequence much
#   shorter than max_context_len (a graph sizes the grid for the longest context the engine
#   allows) is still shared by all P programs of its pair, and programs with nothing left to
#   read write an empty partial (-inf, 0, 0) that the merge weighs by 0.
# Chapter 8's first version cut fixed 512-token partitions of max_context_len. At batch 64 x
# 256 tokens that was one partition per pair, still followed by a merge launch over fp32
# partials (236 us measured on an H100, launches included, where SDPA on dense K/V took 37);
# and under a CUDA graph sized for Qwen3-0.6B's 40,960 tokens every pair would have had 80
# partitions, nearly all empty, each writing a partial for the merge to read back.
PROGRAMS_PER_SM = 32
MIN_PARTITION_TILES = 4
MAX_PARTITIONS = 64
INTERPRETER_SMS = 4  # the CPU interpreter has no SMs; only the speed of a check depends on this


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the GPU (132 on an H100 SXM); INTERPRETER_SMS on a CPU."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_tiles(head_dim: int, element_size: int = 2) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for a head size and K/V element size: a K or V tile of
    16 KiB (64 tokens x 128 dims in bf16, the best measured on an H100, with 128 tokens as
    good), so each load is large enough to stream memory, and three pipeline stages, which keep
    two K/V tiles in flight per program (about 70 KiB of shared memory in bf16: three programs
    fit on an SM). head_dim 64 -> 128 tokens, 256 -> 32 tokens and 8 warps."""
    block_d = triton.next_power_of_2(head_dim)
    block_n = max(16, min(128, 16384 // (block_d * element_size)))
    return block_n, 4 if block_d <= 128 else 8, 3


def decode_plan(num_seqs: int, num_kv_heads: int, max_context_len: int, block_n: int, num_sms: int,
                partition_size: int | None = None) -> int:
    """The number of partitions P each (sequence, KV head) pair's context is split into.
    partition_size, if given, asks for partitions of that many tokens of a max_context_len-long
    context: P = ceil(max_context_len / partition_size). Otherwise P fills the GPU (see above)."""
    if partition_size is not None:
        return triton.cdiv(max_context_len, partition_size)
    tiles = triton.cdiv(max_context_len, block_n)  # tiles of the longest context
    to_fill = PROGRAMS_PER_SM * num_sms // (num_seqs * num_kv_heads)
    return max(1, min(to_fill, tiles // MIN_PARTITION_TILES, MAX_PARTITIONS))


@triton.jit(do_not_specialize=["stride_table"],
            do_not_specialize_on_alignment=["block_tables_ptr", "context_lens_ptr", "stride_table"])
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, max_ptr, sum_ptr, acc_ptr, scale,
    stride_q_seq, stride_q_head, stride_block, stride_slot, stride_head, stride_table,
    stride_out_seq, stride_out_head, stride_part_seq, stride_part_head, stride_acc_seq, stride_acc_head,
    stride_acc_part,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr, QUERY_LEN: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    SINGLE_PASS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Program (sequence, KV head, partition) reads one partition of the sequence's context,
    # BLOCK_N tokens at a time, for the QUERIES_PER_KV query heads that share this KV head, of
    # each of the sequence's QUERY_LEN query tokens (1 for decode; 1 + k for chapter 12's verify
    # step): each K/V byte is read from memory once and used by all of them (grouped-query
    # attention without copying K/V; a verify step reads no more K/V than a decode step).
    seq, kv_head, partition = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_partitions = tl.num_programs(2)
    context_len = tl.load(context_lens_ptr + seq)

    # The queries as the rows of a [BLOCK_G, BLOCK_D] tile, row r = (token r // QUERIES_PER_KV,
    # head r % QUERIES_PER_KV of the group). BLOCK_G >= 16 because tensor-core matmuls need 16
    # rows; the padding rows (zeros) cost no memory traffic.
    group = tl.arange(0, BLOCK_G)
    token = seq * QUERY_LEN + group // QUERIES_PER_KV  # the row's query token in the flat run
    heads = kv_head * QUERIES_PER_KV + group % QUERIES_PER_KV
    head_ok = group < QUERY_LEN * QUERIES_PER_KV
    # Token j of the sequence's QUERY_LEN sees the keys up to context - QUERY_LEN + j (causal).
    newest = context_len - QUERY_LEN + group // QUERIES_PER_KV
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_mask = head_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + token[:, None] * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :], mask=q_mask,
                other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of each head's scores
    l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)  # running sum of exp(score - m_i) * v
    # This sequence's context in num_partitions equal runs of whole tiles: partition sizes
    # follow the real context, not the grid's max_context_len. Late partitions of a short
    # context are empty (start >= end) and read nothing.
    per_partition = tl.cdiv(tl.cdiv(context_len, BLOCK_N), num_partitions) * BLOCK_N
    start = partition * per_partition
    end = tl.minimum(start + per_partition, context_len)
    table = block_tables_ptr + seq * stride_table
    # The block-table entries of the *next* tile are loaded one iteration ahead. Without that,
    # each tile's K/V addresses would wait on a table load of the same iteration, and Triton's
    # software pipeliner would keep a single K/V tile in flight (fetched, then waited for at
    # once); with it, the addresses come from the previous iteration and num_stages=3 keeps two
    # tiles in flight per program: one being read from memory while the other is computed on.
    positions = start + tl.arange(0, BLOCK_N)
    block = _block_ids(table, positions, end, BLOCK_SIZE)
    for tile in range(start, end, BLOCK_N):
        offsets, kv_mask, exists = _kv_rows(block, positions, context_len, kv_head, dims, dim_ok,
                                            stride_block, stride_slot, stride_head, BLOCK_SIZE)
        k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0)
        visible = exists[None, :] & (positions[None, :] <= newest[:, None])  # [BLOCK_G, BLOCK_N]
        positions += BLOCK_N
        block = _block_ids(table, positions, end, BLOCK_SIZE)  # the next tile's, read past nothing
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_G, BLOCK_N]
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(scores, v, m_i, l_i, acc, DOT_PRECISION)

    if SINGLE_PASS:
        # One partition saw the whole context: finish the softmax here. (A context of 0
        # tokens, which no real sequence has, gives zeros rather than 0 / 0.)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # Unnormalised partial results: the merge needs max and sum to weigh partitions. An
        # empty partition stores (-inf, 0, 0), which the merge weighs by exp(-inf) = 0.
        part = token * stride_part_seq + heads * stride_part_head + partition
        tl.store(max_ptr + part, m_i, mask=head_ok)
        tl.store(sum_ptr + part, l_i, mask=head_ok)
        acc_offsets = (token[:, None] * stride_acc_seq + heads[:, None] * stride_acc_head + partition * stride_acc_part
                       + dims[None, :])
        tl.store(acc_ptr + acc_offsets, acc, mask=q_mask)


@triton.jit(do_not_specialize=["num_partitions"], do_not_specialize_on_alignment=["num_partitions"])
def _merge_partials_kernel(
    max_ptr, sum_ptr, acc_ptr, out_ptr, num_partitions,
    stride_part_seq, stride_part_head, stride_acc_seq, stride_acc_head, stride_acc_part,
    stride_out_seq, stride_out_head,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):
    # One program per (sequence, query head): merge_partials over its partitions, in Triton.
    seq, head = tl.program_id(0), tl.program_id(1)
    parts = tl.arange(0, BLOCK_P)
    part_ok = parts < num_partitions
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    base = seq * stride_part_seq + head * stride_part_head + parts
    maxes = tl.load(max_ptr + base, mask=part_ok, other=float("-inf"))
    sums = tl.load(sum_ptr + base, mask=part_ok, other=0.0)
    acc_offsets = (seq * stride_acc_seq + head * stride_acc_head + parts[:, None] * stride_acc_part
                   + dims[None, :])
    accs = tl.load(acc_ptr + acc_offsets, mask=part_ok[:, None] & dim_ok[None, :], other=0.0)
    m = tl.max(maxes, 0)
    m = tl.where(m > float("-inf"), m, 0.0)  # every partial empty (a 0-token context): zeros, not NaN
    weights = tl.exp(maxes - m)  # [BLOCK_P]
    total = tl.sum(weights * sums, 0)
    out = tl.sum(weights[:, None] * accs, 0) / tl.where(total > 0, total, 1.0)  # [BLOCK_D]
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def _decode_config(q: torch.Tensor, k_cache: torch.Tensor, max_context_len: int, partition_size: int | None,
                   block_n: int | None, num_warps: int | None,
                   num_stages: int | None, query_len: int = 1) -> tuple[int, int, int, int]:
    """(P, BLOCK_N, num_warps, num_stages) for a decode launch: the given ones, or the defaults."""
    if max_context_len < 1 or (partition_size is not None and partition_size < 1):
        raise ValueError(f"max_context_len and partition_size must be positive numbers of tokens, "
                         f"got {max_context_len} and {partition_size}")
    if isinstance(query_len, bool) or not isinstance(query_len, int) or query_len < 1 or q.shape[0] % query_len:
        raise ValueError(f"query_len must be an integer >= 1 that divides the {q.shape[0]} query rows, got {query_len!r}")
    default_block_n, default_warps, default_stages = decode_tiles(q.shape[2], k_cache.element_size())
    block_n, num_warps, num_stages = block_n or default_block_n, num_warps or default_warps, num_stages or default_stages
    P = decode_plan(q.shape[0] // query_len, k_cache.shape[2], max_context_len, block_n, sm_count(q.device),
                    partition_size)
    return P, block_n, num_warps, num_stages


def _launch_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, num_partitions: int, block_n: int, num_warps: int, num_stages: int,
    single_pass: bool, query_len: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pass 1 over a (sequences, Hkv, P) grid: the output [T, Hq, D] if single_pass (P = 1),
    else the partials (maxes, sums, accs), for T = sequences x query_len query rows."""
    _check_layout(q, k_cache, v_cache)
    S, Hq, D = q.shape  # S: query rows here, query_len of them per sequence
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    P = num_partitions
    if single_pass:
        out = torch.empty(S, Hq, D, dtype=q.dtype, device=q.device)
        maxes = sums = accs = out  # not written by the single pass
        strides = (out.stride(0), out.stride(1), 0, 0, 0, 0, 0)
    else:
        maxes = torch.empty(S, Hq, P, dtype=torch.float32, device=q.device)
        sums = torch.empty_like(maxes)
        accs = torch.empty(S, Hq, P, D, dtype=torch.float32, device=q.device)
        out = maxes  # not written by the split pass
        strides = (0, 0, maxes.stride(0), maxes.stride(1), accs.stride(0), accs.stride(1), accs.stride(2))
    _paged_decode_kernel[(S // query_len, Hkv, P)](
        q, k_cache, v_cache, block_tables, context_lens, out, maxes, sums, accs, D**-0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        *strides,
        BLOCK_SIZE=block_size, HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
        QUERIES_PER_KV=Hq // Hkv, QUERY_LEN=query_len, BLOCK_G=max(16, triton.next_power_of_2(query_len * Hq // Hkv)),
        BLOCK_N=block_n,
        SINGLE_PASS=single_pass, DOT_PRECISION=_dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    return out if single_pass else (maxes, sums, accs)


def paged_decode_partials(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, max_context_len: int, partition_size: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, query_len: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pass 1 of decode: q [S, Hq, D] against each sequence's paged context, split into P
    partitions (decode_plan) read by one program each. Returns the partials (fp32): maxes
    [S, Hq, P], sums [S, Hq, P], accs [S, Hq, P, D]; an empty partition holds (-inf, 0, 0).

    max_context_len is a Python int (the scheduler knows it; a CUDA graph fixes it at the
    longest context the engine allows) so that sizing the grid never waits for the GPU;
    every context_lens[s] must be <= max_context_len. block_n, num_warps and num_stages
    default to decode_tiles. query_len Q > 1: Q query rows per sequence (see paged_decode)."""
    P, block_n, num_warps, num_stages = _decode_config(q, k_cache, max_context_len, partition_size, block_n,
                                                       num_warps, num_stages, query_len)
    return _launch_decode(q, k_cache, v_cache, block_tables, context_lens, P, block_n, num_warps, num_stages,
                          single_pass=False, query_len=query_len)


def merge_partials_triton(maxes: torch.Tensor, sums: torch.Tensor, accs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pass 2 of decode: merge_partials in Triton. maxes, sums [S, H, P], accs [S, H, P, D]
    (fp32, contiguous) -> [S, H, D] in `dtype`."""
    S, H, P, D = accs.shape
    out = torch.empty(S, H, D, dtype=dtype, device=accs.device)
    # One tile size for every P the engine chooses (P <= MAX_PARTITIONS): the partitions past P
    # are masked, and a step whose batch changes P compiles nothing new.
    _merge_partials_kernel[(S, H)](
        maxes, sums, accs, out, P,
        maxes.stride(0), maxes.stride(1), accs.stride(0), accs.stride(1), accs.stride(2),
        out.stride(0), out.stride(1),
        HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_P=triton.next_power_of_2(max(P, MAX_PARTITIONS)),
    )
    return out


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, max_context_len: int, partition_size: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, query_len: int = 1,
) -> torch.Tensor:
    """Triton version of paged.paged_decode: q [S, Hq, D] -> [S, Hq, D], reading K/V in place.
    One launch when decode_plan gives one partition (the kernel writes the output itself),
    else pass 1 into fp32 partials and pass 2 to merge them. Arguments as paged_decode_partials.

    query_len Q > 1 (chapter 12's verify step): q [S * Q, Hq, D], Q query rows per sequence,
    row j of sequence s seeing keys 0 .. context_lens[s] - Q + j. The grid is (S, Hkv, P) as
    for decode, each program holding all Q x Hq / Hkv rows of its KV head, so it depends on the
    batch and max_context_len alone, never on the step's lengths: a CUDA graph can capture it.

    Memory traffic: every cached K/V byte of every sequence is read exactly once (shared by
    the Hq / Hkv query heads of its KV head), plus q, the output and, when split, the partials
    (P x (D + 2) floats per query head, P <= MAX_PARTITIONS unless partition_size asks for more)."""
    P, block_n, num_warps, num_stages = _decode_config(q, k_cache, max_context_len, partition_size, block_n,
                                                       num_warps, num_stages, query_len)
    if P == 1:
        return _launch_decode(q, k_cache, v_cache, block_tables, context_lens, 1, block_n, num_warps, num_stages,
                              single_pass=True, query_len=query_len)
    partials = _launch_decode(q, k_cache, v_cache, block_tables, context_lens, P, block_n, num_warps, num_stages,
                              single_pass=False, query_len=query_len)
    return merge_partials_triton(*partials, dtype=q.dtype)


# ------------------------------------------------------------------------------------------
# 3. Prefill: ragged query chunks, causal over the paged past plus the chunk itself
# ------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_table"],
            do_not_specialize_on_alignment=["block_tables_ptr", "query_start_ptr", "context_lens_ptr", "stride_table"])
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr, scale,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head,
    stride_block, stride_slot, stride_head, stride_table,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, QUERIES_PER_KV: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Program (sequence, KV head, query tile) handles BLOCK_Q consecutive tokens of the
    # sequence's chunk for the QUERIES_PER_KV query heads of one KV head: BLOCK_M =
    # BLOCK_Q * QUERIES_PER_KV (padded to a power of two) rows of (token, head) pairs that
    # all read the same K/V tiles. Decode tokens are chunks of length 1.
    seq, kv_head, q_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:  # the grid is sized for the longest chunk in the step
        return
    context_len = tl.load(context_lens_ptr + seq)
    past = context_len - q_len  # tokens cached before this step

    rows = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + rows // QUERIES_PER_KV  # index of the row's token in the chunk
    heads = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_ok = (rows < BLOCK_Q * QUERIES_PER_KV) & (token < q_len)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    io_mask = row_ok[:, None] & dim_ok[None, :]
    q_offsets = (q_start + token)[:, None] * stride_q_token + heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=io_mask, other=0.0)
    query_pos = past + token  # absolute position: the row may see keys 0 .. query_pos

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys up to the last query of this tile; key 0 is visible to every row, so each row's
    # running max is finite after the first tile.
    kv_end = past + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    table = block_tables_ptr + seq * stride_table
    for tile in range(0, kv_end, BLOCK_N):
        positions = tile + tl.arange(0, BLOCK_N)
        offsets, kv_mask, exists = _kv_tile(table, positions, context_len, kv_head, dims, dim_ok,
                                            stride_block, stride_slot, stride_head, BLOCK_SIZE)
        k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        causal = exists[None, :] & (positions[None, :] <= query_pos[:, None])
        scores = tl.where(causal, scores, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(scores, v, m_i, l_i, acc, DOT_PRECISION)

    out = acc / l_i[:, None]
    out_offsets = (q_start + token)[:, None] * stride_out_token + heads[:, None] * stride_out_head + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start: torch.Tensor, context_lens: torch.Tensor, max_query_len: int, block_m: int = 64,
    block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
) -> torch.Tensor:
    """Attention for a flat run of query chunks: q [T, Hq, D] where sequence s owns rows
    query_start[s]:query_start[s+1], the last tokens of its context_lens[s] cached tokens
    (their K/V already stored). Returns [T, Hq, D]."""
    _check_layout(q, k_cache, v_cache)
    T, Hq, D = q.shape
    S = block_tables.shape[0]
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    block_m = max(block_m, 16, triton.next_power_of_2(group))
    block_q = block_m // group  # tokens per program; rows beyond block_q * group are padding
    out = torch.empty_like(q)
    _paged_prefill_kernel[(S, Hkv, triton.cdiv(max_query_len, block_q))](
        q, k_cache, v_cache, out, block_tables, query_start, context_lens, D**-0.5,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=block_size, HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D), QUERIES_PER_KV=group,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


# Whether Triton built the kernels above for its CPU interpreter (TRITON_INTERPRET=1 at import
# time) rather than for a GPU: interpreted kernels run on CPU tensors, compiled ones need CUDA.
# (A RuntimeError here if Triton's own library was built for the other: the variable came too late.)
INTERPRETED = built_for_interpreter(_store_kv_kernel)
