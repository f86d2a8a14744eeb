"""Chapter 8: the Triton paged-attention kernels, on the CPU in Triton's interpreter.

Kernels are checked against chapter 6's PyTorch paged attention and against a float64
reference on randomised layouts (block sizes 1, 16 and 13, head dims 64 and 128, GQA 1, 2 and
8, contexts from 1 token to several blocks, physical blocks shuffled), then the engine's
`triton` stage against transformers' greedy tokens. The interpreter runs each program in
Python, so shapes are tiny; bf16 is left to the GPU (the interpreter's bf16 matmul is wrong).
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from minivllm.attention.masks import chunk_mask
from minivllm.attention.paged import KVPool, PagedAttention, PagedBatch, paged_decode, store_kv
from tiny_models import reference_attention, unspecialised

pytest.importorskip("triton")
pytestmark = [pytest.mark.ch08, pytest.mark.floors]

CPU = torch.device("cpu")
# (block_size, head_dim, query heads, kv heads): every block size, head dim and GQA ratio
# appears at least once without multiplying them out (the interpreter is slow). The last one
# has padding everywhere: 7 query heads per KV head (Qwen2-0.5B's ratio), head_dim 80.
LAYOUTS = [(1, 64, 2, 2), (16, 128, 4, 2), (13, 64, 8, 1), (16, 64, 16, 2), (5, 80, 14, 2)]


@pytest.fixture(scope="module")
def kernels(triton_interpreter):
    """The attention kernels, run by Triton's interpreter for this module's checks only (conftest.py)."""
    from minivllm.attention import triton_kernels

    assert triton_kernels.INTERPRETED, "minivllm.attention.triton_kernels was not imported under TRITON_INTERPRET=1"
    return triton_kernels


def make_pool(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, seed: int) -> KVPool:
    """A one-layer pool filled with random K/V (stale values where no sequence has written)."""
    shape = SimpleNamespace(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim)
    pool = KVPool(SimpleNamespace(config=shape, device=CPU, dtype=torch.float32), num_blocks, block_size)
    generator = torch.Generator().manual_seed(seed)
    pool.k.copy_(torch.randn(pool.k.shape, generator=generator))
    pool.v.copy_(torch.randn(pool.v.shape, generator=generator))
    return pool


def make_batch(past_lens: list[int], query_lens: list[int], block_size: int, seed: int) -> tuple[PagedBatch, int]:
    """A step over sequences with these cached/new lengths, whose blocks are scattered at
    random over a pool with a few spare blocks. Returns the batch and the pool's block count."""
    needed = [-(-(p + q) // block_size) for p, q in zip(past_lens, query_lens)]
    num_blocks = sum(needed) + 3
    physical = random.Random(seed).sample(range(num_blocks), sum(needed))
    tables, start = [], 0
    for n in needed:
        tables.append(physical[start:start + n])
        start += n
    return PagedBatch.build(tables, past_lens, query_lens, block_size, CPU), num_blocks


def reference(q: torch.Tensor, pool: KVPool, batch: PagedBatch) -> torch.Tensor:
    """Float64 attention of each sequence's queries to its cached tokens, read slot by slot."""
    k_slots = pool.k[0].flatten(0, 1)  # [num_blocks * block_size, Hkv, D]
    v_slots = pool.v[0].flatten(0, 1)
    out, start = torch.empty(q.shape, dtype=torch.float64), 0
    for s, (q_len, ctx) in enumerate(zip(batch.query_lens, batch.context_lens)):
        table = batch.block_tables[s].tolist()
        slots = [table[p // pool.block_size] * pool.block_size + p % pool.block_size for p in range(ctx)]
        out[start:start + q_len] = reference_attention(q[start:start + q_len], k_slots[slots], v_slots[slots],
                                                       chunk_mask(q_len, ctx - q_len))
        start += q_len
    return out


# What changes from one engine step to the next, by kernel: views into the step's packed inputs
# (their offsets move with its token and sequence counts) and the tables' row stride (its
# longest table). Specialising on them would compile new variants in the middle of a run.
PER_STEP = {
    "_store_kv_kernel": ({"slots_ptr"}, set()),
    "_paged_decode_kernel": ({"block_tables_ptr", "context_lens_ptr"}, {"stride_table"}),
    "_paged_prefill_kernel": ({"block_tables_ptr", "query_start_ptr", "context_lens_ptr"}, {"stride_table"}),
    "_merge_partials_kernel": (set(), {"num_partitions"}),
}


@pytest.mark.parametrize("name", sorted(PER_STEP))
def test_per_step_arguments_are_not_specialised(kernels, name):
    pointers, ints = PER_STEP[name]
    value, alignment = unspecialised(getattr(kernels, name))
    assert ints <= value, f"{name} would compile a variant for an int equal to 1: {sorted(ints - value)}"
    assert pointers | ints <= alignment, f"{name} would compile a variant per alignment: {sorted(pointers | ints - alignment)}"


def test_the_merge_compiles_one_tile_for_every_split_the_engine_chooses(kernels, monkeypatch):
    """BLOCK_P is a constexpr: one value for every P up to MAX_PARTITIONS, the ones decode_plan gives."""
    seen = []
    launch = kernels._merge_partials_kernel

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(kwargs["BLOCK_P"]) or launch[grid](*args, **kwargs)

    monkeypatch.setattr(kernels, "_merge_partials_kernel", Recorder())
    for P in (2, 5, 16, kernels.MAX_PARTITIONS):
        maxes, sums = torch.zeros(1, 1, P), torch.ones(1, 1, P)
        kernels.merge_partials_triton(maxes, sums, torch.zeros(1, 1, P, 16), dtype=torch.float32)
    assert len(set(seen)) == 1, f"tile sizes {seen} for 2 to {kernels.MAX_PARTITIONS} partitions"


def test_store_kv_matches_torch(kernels):
    batch, num_blocks = make_batch([0, 5, 17], [9, 1, 4], block_size=4, seed=0)
    expected, got = make_pool(num_blocks, 4, 2, 64, seed=1), make_pool(num_blocks, 4, 2, 64, seed=1)
    k, v = torch.randn(2, 14, 2, 64).unbind(0)
    store_kv(expected.k[0], expected.v[0], k, v, batch.slot_mapping)
    kernels.store_kv(got.k[0], got.v[0], k, v, batch.slot_mapping)
    assert torch.equal(got.k, expected.k) and torch.equal(got.v, expected.v)


@pytest.mark.parametrize("block_size, head_dim, heads, kv_heads", LAYOUTS)
def test_decode_matches_torch_and_float64(kernels, block_size, head_dim, heads, kv_heads):
    rng = random.Random(block_size + heads)
    # 1 token, just past a block boundary, several 32-token partitions, and one at random.
    contexts = [1, block_size + 1, 70, rng.randint(2, 4 * block_size + 8)]
    batch, num_blocks = make_batch([c - 1 for c in contexts], [1] * len(contexts), block_size, seed=block_size)
    pool = make_pool(num_blocks, block_size, kv_heads, head_dim, seed=2)
    q = torch.randn(len(contexts), heads, head_dim)
    args = (q, pool.k[0], pool.v[0], batch.block_tables, batch.context_lens_tensor)
    # Small partitions and tiles so that these short contexts still split across programs.
    got = kernels.paged_decode(*args, max(contexts), partition_size=32, block_n=16)
    torch.testing.assert_close(got, paged_decode(*args, max(contexts)), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.double(), reference(q, pool, batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size, head_dim, heads, kv_heads", LAYOUTS)
def test_prefill_step_matches_torch_and_float64(kernels, block_size, head_dim, heads, kv_heads):
    # A mixed step: a fresh prompt, a decode token, a chunk after a cached past, a 1-token
    # prompt, and a chunk of random length after a random past.
    rng = random.Random(block_size + heads)
    past_lens, query_lens = [0, 23, 11, 0, rng.randint(0, 40)], [19, 1, 30, 1, rng.randint(1, 20)]
    batch, num_blocks = make_batch(past_lens, query_lens, block_size, seed=block_size)
    torch_pool = make_pool(num_blocks, block_size, kv_heads, head_dim, seed=3)
    triton_pool = make_pool(num_blocks, block_size, kv_heads, head_dim, seed=3)
    T = sum(query_lens)
    q, k, v = torch.randn(T, heads, head_dim), torch.randn(T, kv_heads, head_dim), torch.randn(T, kv_heads, head_dim)

    from minivllm.attention.triton_paged import TritonPagedAttention

    expected = PagedAttention(torch_pool, batch)(0, q, k, v)
    got = TritonPagedAttention(triton_pool, batch)(0, q, k, v)  # stores, then the prefill kernel
    assert torch.equal(triton_pool.k, torch_pool.k) and torch.equal(triton_pool.v, torch_pool.v)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.double(), reference(q, triton_pool, batch), atol=1e-5, rtol=1e-5)


# Chapter 12's verify step under a CUDA graph: Q = 1 + k query rows per sequence, contexts that
# count all Q (the last real token, its guesses and padding rows), one launch grid for the batch.
@pytest.mark.parametrize("block_size, head_dim, heads, kv_heads, Q, partition_size", [
    (16, 64, 4, 2, 5, None),  # Qwen3-0.6B's ratio, k = 4: 5 x 2 rows in one 16-row tile; one pass
    (13, 64, 8, 1, 3, 16),  # 8 heads per KV head x 3 tokens: a 32-row tile; split
    (5, 80, 14, 2, 2, 8),  # padding everywhere: head_dim 80, 7 x 2 rows, tiny blocks, many partitions
])
def test_verify_rows_match_torch_and_float64(kernels, block_size, head_dim, heads, kv_heads, Q, partition_size):
    # The first: every key in the step; 33: the last partition holds only key 32, past the newest
    # key of all rows but the last (their whole tile hidden: the online softmax must stay finite).
    contexts = [Q, Q + 1, 33, 70]
    batch, num_blocks = make_batch([c - Q for c in contexts], [Q] * len(contexts), block_size, seed=block_size)
    pool = make_pool(num_blocks, block_size, kv_heads, head_dim, seed=4)
    q = torch.randn(Q * len(contexts), heads, head_dim, generator=torch.Generator().manual_seed(Q))
    args = (q, pool.k[0], pool.v[0], batch.block_tables, batch.context_lens_tensor, 80)
    got = kernels.paged_decode(*args, partition_size=partition_size, block_n=16, query_len=Q)
    torch.testing.assert_close(got, paged_decode(*args, query_len=Q), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.double(), reference(q, pool, batch), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="query_len"):
        kernels.paged_decode(*args, query_len=len(q) + 1)


def test_decode_partials_merge_to_full_attention(kernels):
    """Pass 1's partials, merged by the PyTorch exercise, give full attention: the kernel and
    merge_partials agree on what a partial is. One partition of the short sequence is empty."""
    batch, num_blocks = make_batch([2, 60], [1, 1], block_size=16, seed=0)
    pool = make_pool(num_blocks, 16, 2, 64, seed=4)
    q = torch.randn(2, 4, 64)
    maxes, sums, accs = kernels.paged_decode_partials(q, pool.k[0], pool.v[0], batch.block_tables,
                                                      batch.context_lens_tensor, 61, partition_size=32, block_n=16)
    assert maxes.shape == (2, 4, 2) and torch.isinf(maxes[0, :, 1]).all()  # 3 tokens: 2nd partition empty
    torch.testing.assert_close(kernels.merge_partials(maxes, sums, accs).double(), reference(q, pool, batch),
                               atol=1e-5, rtol=1e-5)


def decode_problem(contexts: list[int], block_size: int = 16, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
                   seed: int = 0):
    """q and a pool holding one decode step's sequences with these context lengths."""
    batch, num_blocks = make_batch([c - 1 for c in contexts], [1] * len(contexts), block_size, seed=seed)
    pool = make_pool(num_blocks, block_size, kv_heads, head_dim, seed=seed + 5)
    q = torch.randn(len(contexts), heads, head_dim, generator=torch.Generator().manual_seed(seed))
    return q, pool, batch


def test_decode_plan_fills_the_gpu_and_stays_bounded(kernels):
    """The split is chosen from host integers: one partition where the (sequence, KV head)
    pairs already fill the GPU or contexts are short, more where they do not, never partitions
    shorter than MIN_PARTITION_TILES tiles nor more than MAX_PARTITIONS, whatever max_context_len."""
    plan, h100 = kernels.decode_plan, 132
    assert plan(64, 8, 256, 64, h100) == 1  # 4 tiles: one short partition, a single pass
    assert plan(1024, 8, 4096, 64, h100) == 1  # 8,192 pairs already fill 132 SMs
    # The nano workload's batch: 2,048 pairs of contexts up to 2,048 tokens, uneven, split so
    # that the longest ones do not finish alone; the same split under a CUDA graph's grid.
    assert plan(256, 8, 2048, 64, h100) >= 2
    assert plan(256, 8, 40960, 64, h100) == plan(256, 8, 2048, 64, h100)
    assert 256 * 8 * plan(256, 8, 2048, 64, h100) >= kernels.PROGRAMS_PER_SM * h100 // 2
    p = plan(64, 8, 4096, 64, h100)
    assert 1 < p <= 4096 // (64 * kernels.MIN_PARTITION_TILES)
    assert 64 * 8 * p >= kernels.PROGRAMS_PER_SM * h100 // 2  # enough programs for every SM
    for batch in (1, 4, 64, 256):
        for context in (1, 16, 128, 1000, 40960):
            p = plan(batch, 8, context, 64, h100)
            assert 1 <= p <= kernels.MAX_PARTITIONS
            assert p == 1 or -(-context // 64) >= p * kernels.MIN_PARTITION_TILES
    assert plan(64, 8, 4096, 64, h100, partition_size=512) == 8  # asked for explicitly
    for head_dim in (32, 64, 80, 128, 256):
        for element_size in (2, 4):
            block_n, warps, stages = kernels.decode_tiles(head_dim, element_size)
            assert 16 <= block_n <= 128 and block_n & (block_n - 1) == 0 and warps in (4, 8) and stages >= 2
            block_d = 1 << (head_dim - 1).bit_length()  # the tile's padded width
            assert block_n * block_d * element_size <= 16384  # a K or V tile fits 16 KiB


# Block sizes 1 and 13, GQA 1 and 8, and the padded layout: what an uneven batch could break.
@pytest.mark.parametrize("block_size, head_dim, heads, kv_heads", [LAYOUTS[0], LAYOUTS[2], LAYOUTS[4]])
@pytest.mark.parametrize("longest, path", [(100, "single"), (170, "split")])
def test_uneven_contexts_match_torch_and_float64_on_the_path_the_rule_takes(kernels, block_size, head_dim, heads,
                                                                            kv_heads, longest, path):
    """A decode batch of uneven contexts (uniform from 1 to `longest`, few of them whole tiles,
    partitions or blocks) with no split asked for: decode_plan picks one pass for contexts of
    under MIN_PARTITION_TILES x 2 tiles and a split for longer ones, and both are exact."""
    rng = random.Random(longest + block_size + heads)
    contexts = [longest] + [rng.randint(1, longest) for _ in range(4)]
    batch, num_blocks = make_batch([c - 1 for c in contexts], [1] * len(contexts), block_size, seed=longest)
    pool = make_pool(num_blocks, block_size, kv_heads, head_dim, seed=6)
    q = torch.randn(len(contexts), heads, head_dim, generator=torch.Generator().manual_seed(longest))
    args = (q, pool.k[0], pool.v[0], batch.block_tables, batch.context_lens_tensor, longest)
    P = kernels.decode_plan(len(contexts), kv_heads, longest, 16, kernels.sm_count(CPU))
    assert (P == 1) == (path == "single")
    assert path == "single" or any(-(-c // 16) % P for c in contexts)  # partitions of unequal length
    got = kernels.paged_decode(*args, block_n=16)
    torch.testing.assert_close(got, paged_decode(*args), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.double(), reference(q, pool, batch), atol=1e-5, rtol=1e-5)


def test_the_uneven_benchmark_times_the_same_attention_every_way(kernels):
    """The kernel benchmark's uneven batch (course/bench/kernels.py), shrunk to 3 sequences: every
    method it times (the kernel in one pass, split, as decode_plan splits it, and SDPA on padded
    dense K/V with the padding masked) computes the float64 attention, so its bandwidths compare
    the same work."""
    from minivllm.course.bench import kernels as bench

    contexts = bench.uneven_contexts(batch=3, bounds=(5, 45), seed=1)
    assert all(5 <= c <= 45 for c in contexts) and len(set(contexts)) == 3
    problem = bench.make_decode_problem(contexts, CPU, torch.float32)
    expected = bench.reference_decode(problem)
    methods = bench.uneven_methods(kernels, problem, [2])  # decode_plan: one pass here
    partitions = sorted(P for P, _ in methods.values())
    assert partitions == [0, 1, 2]  # SDPA, one pass, a split
    for name, (_, fn) in methods.items():
        torch.testing.assert_close(fn().double(), expected, atol=1e-5, rtol=1e-5, msg=name)


# Contexts far shorter than the grid's max_context_len (as in a CUDA graph sized for the
# engine's longest context), of mixed lengths, one of them a single token.
MIXED = [1, 40, 7, 23, 16]


@pytest.mark.parametrize("max_context_len, partition_size, path", [
    (40, None, "single"),  # auto: 5 x 2 pairs fill the interpreter's pretend GPU; one pass
    (4096, 4096, "single"),  # one partition of the longest allowed context: a single pass
    (4096, 1024, "split"),  # 4 partitions of each sequence's own context: some empty
    pytest.param(4096, 64, "split", marks=pytest.mark.slow),  # 64 partitions, nearly all empty (44 s interpreted)
    (64, 16, "split"),  # one-tile partitions
])
def test_decode_paths_match_float64(kernels, max_context_len, partition_size, path):
    q, pool, batch = decode_problem(MIXED)
    args = (q, pool.k[0], pool.v[0], batch.block_tables, batch.context_lens_tensor, max_context_len)
    P = kernels.decode_plan(len(MIXED), 2, max_context_len, 16, kernels.INTERPRETER_SMS, partition_size)
    assert (P == 1) == (path == "single")
    got = kernels.paged_decode(*args, partition_size=partition_size, block_n=16)
    torch.testing.assert_close(got.double(), reference(q, pool, batch), atol=1e-5, rtol=1e-5)


def test_decode_partials_of_short_contexts_are_empty(kernels):
    """Under a grid sized for 4,096 tokens, each sequence's own context is cut into the P
    partitions; those past its end hold (-inf, 0, 0), and all of them merge to full attention."""
    q, pool, batch = decode_problem(MIXED, seed=1)
    maxes, sums, accs = kernels.paged_decode_partials(q, pool.k[0], pool.v[0], batch.block_tables,
                                                      batch.context_lens_tensor, 4096, partition_size=512, block_n=16)
    assert maxes.shape == (5, 4, 8) and accs.shape == (5, 4, 8, 64)
    for s, context in enumerate(MIXED):
        used = -(-context // 16)  # one tile per partition: 8 partitions, at most 3 tiles here
        assert torch.isfinite(maxes[s, :, :used]).all() and torch.isinf(maxes[s, :, used:]).all()
        assert (sums[s, :, used:] == 0).all() and (accs[s, :, used:] == 0).all()
    torch.testing.assert_close(kernels.merge_partials(maxes, sums, accs).double(), reference(q, pool, batch),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("partition_size", [None, 16])
def test_decode_of_an_empty_context_is_zero(kernels, partition_size):
    """A row with no context at all (which no real sequence has) gives zeros, not NaN, in
    both passes; its neighbours are untouched."""
    q, pool, batch = decode_problem([5, 30], seed=2)
    lens = batch.context_lens_tensor.clone()
    lens[0] = 0
    got = kernels.paged_decode(q, pool.k[0], pool.v[0], batch.block_tables, lens, 30,
                               partition_size=partition_size, block_n=16)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    torch.testing.assert_close(got[1].double(), reference(q, pool, batch)[1], atol=1e-5, rtol=1e-5)


def random_partials(scores: torch.Tensor, values: torch.Tensor, bounds: list[int]):
    """Split keys at `bounds` and compute each part's (max, sum, acc) in float64."""
    maxes, sums, accs = [], [], []
    for lo, hi in zip(bounds, bounds[1:]):
        s, v = scores[..., lo:hi], values[lo:hi]
        m = s.amax(-1) if hi > lo else torch.full(s.shape[:-1], float("-inf"), dtype=s.dtype)
        p = torch.exp(s - m[..., None]) if hi > lo else s
        maxes.append(m)
        sums.append(p.sum(-1))
        accs.append(p @ v)
    return torch.stack(maxes, -1), torch.stack(sums, -1), torch.stack(accs, -2)


def test_merge_partials_exercise(kernels):
    """The exercise against float64 softmax, with very different maxes and an empty partial;
    the Triton merge kernel against the exercise."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 5, 40, generator=generator, dtype=torch.float64) * 4
    scores[..., 30:] += 50  # the last partial dominates: the others must be rescaled, not lost
    values = torch.randn(40, 64, generator=generator, dtype=torch.float64)
    partials = random_partials(scores, values, [0, 7, 7, 30, 40])  # the second one is empty
    expected = scores.softmax(-1) @ values
    torch.testing.assert_close(kernels.merge_partials(*partials), expected)
    fp32 = [x.float().contiguous() for x in partials]
    torch.testing.assert_close(kernels.merge_partials_triton(*fp32, dtype=torch.float32),
                               kernels.merge_partials(*fp32), atol=1e-6, rtol=1e-5)


def test_refuses_to_run_where_triton_cannot(kernels, monkeypatch):
    from minivllm.attention.triton_paged import TritonPagedAttention

    batch, num_blocks = make_batch([0], [3], block_size=4, seed=0)
    monkeypatch.setattr(kernels, "INTERPRETED", False)  # as if TRITON_INTERPRET were unset
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        TritonPagedAttention(make_pool(num_blocks, 4, 1, 64, seed=0), batch)
    monkeypatch.setattr(kernels, "INTERPRETED", True)
    bf16_pool = make_pool(num_blocks, 4, 1, 64, seed=0)
    bf16_pool.k, bf16_pool.v = bf16_pool.k.bfloat16(), bf16_pool.v.bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16"):
        TritonPagedAttention(bf16_pool, batch)


# Chunked prompts (8-token budget) mixed with decodes, 4-token blocks: every kernel path runs.
ENGINE = dict(block_size=4, num_kv_blocks=32, max_num_batched_tokens=8)
PROMPTS, LENGTHS = [[5, 17, 9, 30, 12, 23, 3, 41, 7, 66, 2], [88, 4], [19, 60, 33, 8, 71]], [4, 6, 3]


def test_engine_refuses_triton_before_allocating_its_kv_pool(kernels, model, monkeypatch):
    from minivllm.worker import model_runner
    from minivllm.engine.llm_engine import LLMEngine

    def no_pool(*args):
        raise AssertionError("the KV pool was allocated before the attention backend was checked")

    monkeypatch.setattr(kernels, "INTERPRETED", False)  # as if TRITON_INTERPRET were unset
    monkeypatch.setattr(model_runner, "KVPool", no_pool)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        LLMEngine(model, attention="triton", **ENGINE)


def test_triton_stage_matches_transformers(kernels, model, hf_model, reference):
    from minivllm.stages import STAGES

    out = STAGES["triton"](model, PROMPTS, LENGTHS, **ENGINE)
    assert out == [reference(hf_model, p, n) for p, n in zip(PROMPTS, LENGTHS)]

