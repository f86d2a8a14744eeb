"""Chapter 6: slot mapping, block allocation, paged gather and decode against plain PyTorch, the
paged stage equal to transformers' greedy tokens with admission that never over-commits, and
the KV memory measurement against hand computations."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from tiny_models import raises_runtime_error, reference_attention

import minivllm
from minivllm.attention.paged import KVPool, PagedAttention, PagedBatch, gather_kv, paged_decode, slot_mapping
from minivllm.course.bench.kv_memory import compare
from minivllm.core.block_manager import BlockManager
from minivllm.stages import paged
from minivllm.stages.common import StageStats

pytestmark = [pytest.mark.ch06, pytest.mark.floors]

# p + n - 1 (the most tokens each cache holds) is 12, 9, 32, 32, 32: with 16-token blocks the
# last three fill exactly two blocks; a prompt of 1 token; a request that is all prefill.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [42], list(range(3, 19)), [(7 * i) % 97 for i in range(32)], [3] * 25]
LENGTHS = [6, 9, 17, 1, 8]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def llama(hf_models):
    """One family is enough where only the loop's bookkeeping is checked, not the numbers."""
    return minivllm.load_model(hf_models["llama"], device="cpu")


# --- slot mapping (exercise) --------------------------------------------------------------

@pytest.mark.parametrize("table, start, end, block_size, expected", [
    ([7, 2, 9], 0, 12, 4, [28, 29, 30, 31, 8, 9, 10, 11, 36, 37, 38, 39]),  # the whole table
    ([7, 2, 9], 3, 6, 4, [31, 8, 9]),  # a chunk that crosses a block boundary
    ([7, 2, 9], 9, 10, 4, [37]),  # one decode token
    ([5, 0, 3], 0, 3, 1, [5, 0, 3]),  # block size 1: slot = block
    ([1, 4], 2, 7, 5, [7, 8, 9, 20, 21]),  # a block size that is not a power of two
    ([3], 2, 2, 4, []),  # no tokens
])
def test_slot_mapping_against_hand_computation(table, start, end, block_size, expected):
    got = slot_mapping(table, start, end, block_size)
    assert list(got) == expected, (
        f"slot_mapping(block_table={table}, start={start}, end={end}, block_size={block_size}): position p lives "
        f"in block table[p // {block_size}] at offset p % {block_size}; expected slots {expected}, got {got}")


# --- block allocation (exercise) ----------------------------------------------------------

def test_grow_takes_a_block_only_when_a_token_needs_it():
    blocks = BlockManager(num_blocks=6, block_size=4)
    table: list[int] = []
    for tokens, expected in [(1, 1), (4, 1), (5, 2), (3, 2), (12, 3), (13, 4)]:
        blocks.grow(table, tokens)
        assert len(table) == expected, (
            f"grow(table, {tokens}) with 4-token blocks: the table should hold {expected} block(s) "
            f"(tables never shrink), got {len(table)}: {table}")
        assert len(set(table)) == len(table) and blocks.num_free == 6 - len(table), (
            f"after grow(table, {tokens}): table {table}, {blocks.num_free} free; blocks must come off the free "
            f"list, once each")
    before, free_before = list(table), list(blocks.free)
    with raises_runtime_error("out of KV blocks"):
        blocks.grow(table, 4 * 7)  # needs 7 blocks in all, there are 6
    assert table == before and list(blocks.free) == free_before, (
        "a grow that cannot be served must change nothing (no half-grown table, no lost free blocks): "
        f"table {before} -> {table}, free {free_before} -> {list(blocks.free)}")


@pytest.mark.parametrize("seed", range(3))
def test_block_manager_invariants_under_random_allocate_grow_release(seed):
    rng = random.Random(seed)
    num_blocks, block_size = 24, rng.choice([1, 3, 4, 16])
    blocks = BlockManager(num_blocks, block_size)
    tables: dict[int, tuple[list[int], int]] = {}  # sequence -> (its block table, tokens it holds)
    history: list[str] = []
    for op in range(400):
        kind = rng.choice(["allocate", "grow", "grow", "release"])
        if kind == "allocate" or not tables:
            seq, table, tokens = op, [], 0
        else:
            seq = rng.choice(list(tables))
            table, tokens = tables[seq]
        if kind == "release" and tables:
            blocks.release(table)
            del tables[seq]
            assert table == [], f"release must empty the table, left {table}"
            history.append(f"release {seq}")
        else:
            want = tokens + rng.randint(1, 2 * block_size)
            if blocks.can_grow(table, want):
                blocks.grow(table, want)
                tables[seq] = (table, want)
                history.append(f"grow {seq} to {want} tokens")
            else:
                before = (list(table), blocks.num_free)
                with raises_runtime_error("out of KV blocks"):
                    blocks.grow(table, want)
                assert (table, blocks.num_free) == before, f"a refused grow changed state; ops: {history[-5:]}"
        owned = [b for table, _ in tables.values() for b in table]
        assert len(owned) == len(set(owned)), f"a block is owned twice: {sorted(owned)}; last ops {history[-5:]}"
        assert not set(owned) & set(blocks.free), f"blocks both owned and free; last ops {history[-5:]}"
        assert blocks.num_free + len(owned) == num_blocks, (
            f"{blocks.num_free} free + {len(owned)} owned != {num_blocks} blocks; last ops {history[-5:]}")
        for seq, (table, tokens) in tables.items():
            assert len(table) == ceil_div(tokens, block_size), (
                f"sequence {seq} holds {tokens} tokens in {block_size}-token blocks: expected "
                f"{ceil_div(tokens, block_size)} blocks, has {len(table)}; last ops {history[-5:]}")
    for table, _ in tables.values():
        blocks.release(table)
    assert sorted(blocks.free) == list(range(num_blocks)), "every block must come back when all sequences finish"


# --- paged gather and decode (exercise) against a contiguous cache -------------------------

def scatter(
    contiguous: torch.Tensor, block_size: int, num_blocks: int, rng: torch.Generator
) -> tuple[torch.Tensor, list[int]]:
    """Copy a contiguous cache [L, Hkv, D] into random, out-of-order blocks of a pool filled with
    noise; return the pool [num_blocks, block_size, Hkv, D] and the block table."""
    length = contiguous.shape[0]
    pool = torch.randn(num_blocks, block_size, *contiguous.shape[1:], generator=rng, dtype=contiguous.dtype)
    table = torch.randperm(num_blocks, generator=rng)[:ceil_div(length, block_size)].tolist()
    for p in range(length):
        pool[table[p // block_size], p % block_size] = contiguous[p]
    return pool, table


@pytest.mark.parametrize("block_size, context_len", [(4, 1), (4, 4), (4, 9), (1, 6), (5, 12), (16, 16)])
def test_gather_kv_reads_scattered_blocks_in_order(block_size, context_len):
    rng = torch.Generator().manual_seed(context_len)
    contiguous = torch.randn(context_len, 2, 3, generator=rng)
    pool, table = scatter(contiguous, block_size, num_blocks=12, rng=rng)
    padded = torch.tensor(table + [-1] * 3, dtype=torch.int32)  # rows of a batch's tables are padded with -1
    got = gather_kv(pool, padded, context_len)
    assert got.shape == contiguous.shape, (
        f"gather_kv(block_size={block_size}, block_table={table}, context_len={context_len}): expected shape "
        f"{list(contiguous.shape)}, got {list(got.shape)}")
    wrong = (got != contiguous).any(-1).any(-1).nonzero().flatten().tolist()
    assert not wrong, (f"gather_kv(block_size={block_size}, block_table={table}, context_len={context_len}): "
                       f"tokens at positions {wrong} differ from the contiguous cache")


def test_paged_decode_equals_attention_over_contiguous_caches():
    rng = torch.Generator().manual_seed(0)
    block_size, num_blocks, Hq, Hkv, D = 4, 16, 4, 2, 8
    context_lens = [1, 7, 16]
    caches = [(torch.randn(n, Hkv, D, generator=rng), torch.randn(n, Hkv, D, generator=rng)) for n in context_lens]
    k_pool = torch.randn(num_blocks, block_size, Hkv, D, generator=rng)
    v_pool = torch.randn(num_blocks, block_size, Hkv, D, generator=rng)
    physical = torch.randperm(num_blocks, generator=rng).tolist()  # disjoint, out-of-order blocks
    tables = []
    for (k, v), n in zip(caches, context_lens):
        table = [physical.pop() for _ in range(ceil_div(n, block_size))]
        for p in range(n):
            k_pool[table[p // block_size], p % block_size] = k[p]
            v_pool[table[p // block_size], p % block_size] = v[p]
        tables.append(table + [-1] * (4 - len(table)))
    q = torch.randn(len(context_lens), Hq, D, generator=rng)
    got = paged_decode(q, k_pool, v_pool, torch.tensor(tables, dtype=torch.int32), torch.tensor(context_lens),
                       max(context_lens))
    for s, ((k, v), n) in enumerate(zip(caches, context_lens)):
        expected = reference_attention(q[s:s + 1], k, v, torch.ones(1, n, dtype=torch.bool))[0]
        torch.testing.assert_close(got[s].double(), expected, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"sequence {s} ({n} cached tokens): {m}")


def test_paged_attention_mixes_a_prefill_chunk_and_a_decode():
    """Store the step's K/V through the slot mapping, then attend through the block tables."""
    rng = torch.Generator().manual_seed(1)
    Hq, Hkv, D, block_size = 4, 2, 8, 4
    fake_model = SimpleNamespace(config=SimpleNamespace(num_layers=1, num_kv_heads=Hkv, head_dim=D),
                                 device=torch.device("cpu"), dtype=torch.float64)
    pool = KVPool(fake_model, num_blocks=10, block_size=block_size)
    blocks = BlockManager(10, block_size)
    past_lens, query_lens = [5, 9], [3, 1]  # a chunk of 3 after 5 cached tokens; one decode token after 9
    full_k = [torch.randn(p + q, Hkv, D, generator=rng, dtype=torch.float64) for p, q in zip(past_lens, query_lens)]
    full_v = [torch.randn(p + q, Hkv, D, generator=rng, dtype=torch.float64) for p, q in zip(past_lens, query_lens)]
    tables = [[], []]
    blocks.grow(tables[1], 2)  # interleave the two sequences' blocks
    blocks.grow(tables[0], 8)
    blocks.grow(tables[1], 10)
    for table, k, v, p in zip(tables, full_k, full_v, past_lens):  # the past, already cached
        for pos in range(p):
            pool.k[0, table[pos // block_size], pos % block_size] = k[pos]
            pool.v[0, table[pos // block_size], pos % block_size] = v[pos]
    batch = PagedBatch.build(tables, past_lens, query_lens, block_size, torch.device("cpu"))
    q = torch.randn(sum(query_lens), Hq, D, generator=rng, dtype=torch.float64)
    new_k = torch.cat([k[p:] for k, p in zip(full_k, past_lens)])
    new_v = torch.cat([v[p:] for v, p in zip(full_v, past_lens)])
    got = PagedAttention(pool, batch)(0, q, new_k, new_v)
    start = 0
    for s, (p, n) in enumerate(zip(past_lens, query_lens)):
        mask = torch.tensor([[j <= p + i for j in range(p + n)] for i in range(n)])  # the chunk's causal mask
        expected = reference_attention(q[start:start + n], full_k[s], full_v[s], mask)
        torch.testing.assert_close(got[start:start + n], expected, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"sequence {s} ({p} cached + {n} new tokens): {m}")
        start += n


# --- the stage -----------------------------------------------------------------------------

@pytest.mark.parametrize("block_size, num_blocks, chunk_size, budget", [
    (1, None, 64, 256),  # one token per block
    (16, None, 64, 256),  # the usual block size; three caches end exactly on a block boundary
    (5, 7, 4, 10),  # a block size that divides nothing, small chunks, a pool that runs requests in groups
    (16, 2, 16, 16),  # a pool of exactly the largest request's two blocks: one request at a time
])
def test_paged_equals_transformers(model, hf_model, reference, block_size, num_blocks, chunk_size, budget):
    got = paged.generate(model, PROMPTS, LENGTHS, block_size=block_size, num_blocks=num_blocks,
                         chunk_size=chunk_size, max_num_batched_tokens=budget)
    for prompt, n, out in zip(PROMPTS, LENGTHS, got):
        expected = reference(hf_model, prompt, n)
        assert out == expected, f"prompt of {len(prompt)} tokens, {n} new, block size {block_size}: " \
                                f"expected {expected}, got {out}"


@pytest.mark.timeout(30, func_only=True)  # fixtures built once per session are not timed
def test_a_plan_without_tokens_fails_at_once_instead_of_hanging(llama, monkeypatch):
    monkeypatch.setattr(paged, "plan_step", lambda prompt_left, chunk_size, budget: [])
    with pytest.raises(ValueError, match="no tokens planned"):
        paged.generate(llama, PROMPTS[:2], 3, block_size=4)


def test_a_request_that_can_never_fit_is_refused_up_front(llama):
    prompts = [[1, 2, 3], list(range(16))]
    with pytest.raises(ValueError, match=r"request 1: .*2 blocks of 16.*only 1 block"):
        # 16 prompt + 2 new tokens cache up to 17 tokens: 2 blocks, in a 1-block pool. The first
        # request fits, but the error comes before any step runs, not when request 1's turn comes.
        next(paged.steps(llama, prompts, [2, 2], block_size=16, num_blocks=1))
    # 16 + 1 new tokens cache only 16 (the last token is never fed back): exactly one block.
    assert [len(o) for o in paged.generate(llama, prompts, [2, 1], block_size=16, num_blocks=1)] == [2, 1]


def test_admission_never_over_commits_the_pool(llama):
    rng = random.Random(0)
    prompts = [[rng.randrange(97) for _ in range(rng.randint(1, 40))] for _ in range(12)]
    lengths = [rng.randint(1, 20) for _ in prompts]
    block_size, num_blocks = 4, 20
    worst = [ceil_div(len(p) + n - 1, block_size) for p, n in zip(prompts, lengths)]
    started, waited = set(), False
    for step in paged.steps(llama, prompts, lengths, block_size, num_blocks, chunk_size=8, max_num_batched_tokens=24):
        live = step.block_tables
        started |= set(live)
        waited |= len(started) < len(prompts)
        assert sum(worst[r] for r in live) <= num_blocks, (
            f"requests {sorted(live)} run together but their worst cases need {sum(worst[r] for r in live)} "
            f"blocks, the pool has {num_blocks}")
        owned = [b for table in live.values() for b in table]
        assert len(owned) == len(set(owned)) and all(0 <= b < num_blocks for b in owned), f"bad tables {live}"
        for r, table in live.items():
            assert len(table) == ceil_div(step.num_cached[r], block_size), (
                f"request {r} caches {step.num_cached[r]} tokens but holds {len(table)} blocks: a block is taken "
                f"when a token needs it, not before")
    assert waited and started == set(range(len(prompts))), "the pool should make some requests wait, then run them all"


def test_stats_count_tokens_and_whole_blocks(llama):
    """One request, prompt 5, 3 new tokens, 4-token blocks. Cached after each step: 5, 6, 7
    tokens, held in 2 blocks = 8 slots each time."""
    stats = StageStats()
    paged.generate(llama, [[1, 2, 3, 4, 5]], 3, stats=stats, block_size=4)
    assert stats.token_slots == 5 + 1 + 1, f"prompt once, then one token per step: expected 7, got {stats.token_slots}"
    got = (stats.kv_used, stats.kv_reserved, stats.peak_kv_tokens)
    assert got == (5 + 6 + 7, 8 + 8 + 8, 8), f"expected used 18, reserved 24 token-steps, peak 8 slots; got {got}"
    stats = StageStats()
    paged.generate(llama, PROMPTS, LENGTHS, stats=stats, block_size=1)
    assert stats.kv_utilisation == 1.0, f"with 1-token blocks nothing is held empty, got {stats.kv_utilisation}"


# --- the memory measurement -----------------------------------------------------------------

def test_kv_memory_utilisation_against_hand_computation():
    """Requests (prompt 3, 3 new) and (prompt 5, 1 new), 2-token blocks. Cached per step: 3 + 5,
    then 4, then 5 (the second request is done after its prefill) = 17 token-steps."""
    traces = compare([3, 5], [3, 1], budget=16, block_size=2, max_model_len=8)
    expected = {"max_model_len": (8 + 8) + 8 + 8,  # every request holds 8 slots
                "prompt+max_tokens": (6 + 6) + 6 + 6,  # every request holds prompt + new
                "paged": (4 + 6) + 4 + 6,  # whole 2-token blocks around what is cached
                "paged+preemption": (4 + 6) + 4 + 6}
    for scheme, reserved in expected.items():
        t = traces[scheme]
        assert (t.used, sum(t.reserved)) == ([8, 4, 5], reserved), (
            f"{scheme}: expected used [8, 4, 5] and {reserved} reserved token-steps, got {t.used}, {sum(t.reserved)}")
        assert t.utilisation == 17 / reserved


def test_kv_memory_requests_that_fit_in_one_budget():
    """Four requests of 4 + 4 tokens (7 cached at most) in 16 slots of 4-token blocks."""
    traces = compare([4] * 4, [4] * 4, budget=16, block_size=4, max_model_len=16)
    peaks = {name: t.peak_running for name, t in traces.items()}
    # max_model_len reserves 16 each; prompt+max_tokens 8; paged promises 2 blocks; preemption
    # lets all four prefill (one block each) and takes blocks back as they grow.
    assert peaks == {"max_model_len": 1, "prompt+max_tokens": 2, "paged": 2, "paged+preemption": 4}, peaks
    for name, t in traces.items():
        assert max(t.reserved) <= 16, f"{name} reserved {max(t.reserved)} of a 16-slot budget"
    assert traces["paged+preemption"].preemptions > 0


def test_what_notebook_6_says_about_the_classroom_budget():
    """Notebook 06's reading of its table: paging alone keeps more of the memory busy but runs
    about as many requests at once as caches sized to each request; only with preemption do
    more requests run at once, in fewer steps. (4,096: the default model's vocabulary, which
    the notebook's workload is drawn with.)"""
    from minivllm.course.bench.workloads import make_workload

    workload = make_workload("classroom", 4096, seed=0)
    t = compare([len(p) for p in workload.prompts], workload.output_lens, budget=4096, block_size=16, max_model_len=512)
    sized, paged, preempting = t["prompt+max_tokens"], t["paged"], t["paged+preemption"]
    assert paged.utilisation > sized.utilisation + 0.1, (paged.utilisation, sized.utilisation)
    assert abs(paged.fit_at_once - sized.fit_at_once) < 0.1 * sized.fit_at_once, (paged.fit_at_once, sized.fit_at_once)
    assert preempting.fit_at_once > 1.1 * max(paged.fit_at_once, sized.fit_at_once), preempting.fit_at_once
    assert preempting.steps < min(paged.steps, sized.steps) and 0 < preempting.preemptions <= 5
