"""Chapter 8: the Triton paged-attention kernels, on the CPU in Triton's interpreter.

Kernels are checked against chapter 6's PyTorch paged attention and against a float64
reference on randomised layouts (block sizes 1, 16 and 13, head dims 64 and 128, GQA 1, 2 and
8, contexts from 1 token to several blocks, physical blocks shuffled), then the engine's
`triton` stage against transformers' greedy tokens. The interpreter runs each program in
Python, so shapes are tiny; bf16 is left to the GPU (the interpreter's bf16 matmul is wrong).
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined: import them lazily, below

import random  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from minivllm.attention.masks import chunk_mask  # noqa: E402
from minivllm.attention.paged import KVPool, PagedAttention, PagedBatch, paged_decode, store_kv  # noqa: E402
from tiny_models import reference_attention  # noqa: E402

pytest.importorskip("triton")
pytestmark = pytest.mark.ch08

CPU = torch.device("cpu")
# (block_size, head_dim, query heads, kv heads): every block size, head dim and GQA ratio
# appears at least once without multiplying them out (the interpreter is slow). The last one
# has padding everywhere: 7 query heads per KV head (Qwen2-0.5B's ratio), head_dim 80.
LAYOUTS = [(1, 64, 2, 2), (16, 128, 4, 2), (13, 64, 8, 1), (16, 64, 16, 2), (5, 80, 14, 2)]


@pytest.fixture(scope="module")
def kernels():
    from minivllm.attention import triton_kernels

    if not triton_kernels.INTERPRETED:
        pytest.fail("minivllm.attention.triton_kernels was imported before TRITON_INTERPRET=1 was set")
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
    from minivllm.engine import model_runner
    from minivllm.engine.llm_engine import LLMEngine

    def no_pool(*args):
        raise AssertionError("the KV pool was allocated before the attention backend was checked")

    monkeypatch.setattr(kernels, "INTERPRETED", False)  # as if TRITON_INTERPRET were unset
    monkeypatch.setattr(model_runner, "KVPool", no_pool)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        LLMEngine(model, attention="triton", **ENGINE)


def test_triton_stage_matches_transformers(kernels, model, hf_model, reference):
    from minivllm.stages import STAGES

    assert list(STAGES)[-1] == "triton"
    out = STAGES["triton"](model, PROMPTS, LENGTHS, **ENGINE)
    assert out == [reference(hf_model, p, n) for p, n in zip(PROMPTS, LENGTHS)]
