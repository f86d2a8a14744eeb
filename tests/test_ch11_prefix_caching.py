"""Chapter 11: prefix caching. The hash chain, the longest-prefix lookup and reference-counted
release against hand-built expectations; greedy tokens equal transformers' with caching on and
off under starvation (tiny blocks, a pool that forces eviction and preemption, small budgets)
for prompts that share none, one, many and all of their full blocks; the block invariants
after random sequences of add / step / abort; and the hits as the server's /metrics counts them."""
from __future__ import annotations

import random
from collections import Counter

import httpx
import pytest
import torch
from server_checks import ENGINE, MODEL, TIMEOUT, expect_status, running_server, wait_until_idle

from minivllm import LLM, LLMEngine, SamplingParams, load_model, load_tokenizer
from minivllm.core.block_manager import BlockManager
from minivllm.core.prefix_cache import PrefixCachingBlockManager, block_hashes, hash_block
from minivllm.request.sequence import Sequence
from minivllm.core.trace import Trace
from tiny_models import random_prompts

pytestmark = [pytest.mark.ch11, pytest.mark.floors]

GREEDY = dict(temperature=0.0, ignore_eos=True)


def short(h: bytes) -> str:
    return h.hex()[:12] if isinstance(h, bytes) else repr(h)


def test_block_hashes_chain_the_full_blocks():
    tokens = list(range(10))
    got = block_hashes(tokens, 4)
    assert isinstance(got, list) and len(got) == 2, \
        f"block_hashes(10 tokens, block_size=4): 2 full blocks; the last 2 tokens are a partial block with no hash. Got {len(got)} hashes"
    first = hash_block(None, tokens[0:4])
    assert got[0] == first, f"hashes[0] must be hash_block(None, tokens[0:4]) = {short(first)}..., got {short(got[0])}..."
    second = hash_block(first, tokens[4:8])
    if got[1] == hash_block(None, tokens[4:8]):
        pytest.fail("hashes[1] must be hash_block(hashes[0], tokens[4:8]): it got hash_block(None, tokens[4:8]), "
                    "so it ignores the block before it (whose tokens its K/V depend on)")
    assert got[1] == second, f"hashes[1] must be hash_block(hashes[0], tokens[4:8]) = {short(second)}..., got {short(got[1])}..."
    assert block_hashes(tokens[:3], 4) == [], "3 tokens fill no block of 4: no hash"
    ones = block_hashes(tokens[:3], 1)
    assert ones == [hash_block(None, [0]), hash_block(hash_block(None, [0]), [1]),
                    hash_block(hash_block(hash_block(None, [0]), [1]), [2])], "block_size=1: every token is a block"
    # What the chain buys: the same tokens after a different first block are different content.
    other = block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4)
    assert other[0] != got[0] and other[1] != got[1], "a different first block changes every hash after it"


def test_longest_cached_prefix_stops_at_the_first_miss():
    """Only the lookup: the cache is filled by hand with hash_block's names."""
    manager = PrefixCachingBlockManager(8, 2)
    h0 = hash_block(None, [1, 2])
    h1 = hash_block(h0, [3, 4])
    h2 = hash_block(h1, [5, 6])
    other = hash_block(None, [9, 9])
    manager.cached.update({h0: 5, h1: 2, h2: 7})
    cases = {
        "all three found": ([h0, h1, h2], [5, 2, 7]),
        "only the first asked for": ([h0], [5]),
        "the first hash is missing": ([other, h1, h2], []),
        "a miss in the middle: never skip a gap": ([h0, other, h2], [5]),
        "a longer request: found up to the first hash not cached": ([h0, h1, h2, hash_block(h2, [7, 8])], [5, 2, 7]),
        "no hashes": ([], []),
    }
    free, counts = list(manager.free), list(manager.ref_counts)
    for case, (hashes, expected) in cases.items():
        got = manager.longest_cached_prefix(hashes)
        assert got == expected, f"{case}: cached = {{h0: 5, h1: 2, h2: 7}}, expected blocks {expected}, got {got}"
    assert list(manager.free) == free and manager.ref_counts == counts, "longest_cached_prefix reads only"


def seq_of(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(max_tokens=8), max_model_len=1000)


def admit(manager: PrefixCachingBlockManager, tokens: list[int], request_id: str = "r") -> tuple[Sequence, int]:
    """What the scheduler does at admission: reuse the cached prefix, then grow for the rest."""
    seq = seq_of(tokens, request_id)
    cached = manager.reuse_prefix(seq)
    manager.grow(seq.block_table, seq.num_tokens)
    return seq, cached


def test_release_drops_counts_and_frees_the_last_owners_blocks_last_block_first():
    """Only release, on a state set by hand: block 0 is shared by two tables, block 1 holds
    named content, block 2 is private."""
    manager = PrefixCachingBlockManager(6, 2)
    for block, count in ((0, 2), (1, 1), (2, 1)):
        manager.free.remove(block)
        manager.ref_counts[block] = count
    named = hash_block(None, [7, 7])
    manager.cached[named], manager.block_hash[1] = 1, named
    a, b = [0, 1], [0, 2]
    manager.release(a)
    assert a == [], "release empties the table"
    assert manager.ref_counts[:3] == [1, 0, 1], f"each block's count drops by one: expected [1, 0, 1], got {manager.ref_counts[:3]}"
    assert list(manager.free) == [3, 4, 5, 1], \
        f"block 1 has no owner left: it goes to the young end of the free list; block 0 is still b's. Free list: {list(manager.free)}"
    assert manager.cached == {named: 1}, "a freed block keeps its content: it stays findable until evicted"
    manager.release(b)
    assert list(manager.free) == [3, 4, 5, 1, 2, 0], \
        f"release([0, 2]) lets go last block first, so block 0, the prefix, is evicted last: free list {list(manager.free)}"
    assert manager.ref_counts == [0] * 6 and b == []


def test_sharing_counts_and_release_order():
    manager = PrefixCachingBlockManager(6, 2)
    a, cached_a = admit(manager, [1, 2, 3, 4, 5], "a")  # blocks: [1 2] [3 4] [5 _]
    b, cached_b = admit(manager, [1, 2, 3, 4, 6, 7, 8], "b")  # shares two full blocks
    assert (cached_a, cached_b) == (0, 4)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [manager.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    c, cached_c = admit(manager, [1, 2, 3, 4], "c")  # all its blocks are cached, yet the last token is computed
    assert cached_c == 2 and c.block_table[0] == a.block_table[0] and c.block_table[1] not in a.block_table
    shared = a.block_table[:2]
    manager.release(a.block_table)
    assert [manager.ref_counts[x] for x in shared] == [2, 1], "b and c still hold them"
    assert not set(shared) & set(manager.free)
    manager.release(b.block_table)
    manager.release(c.block_table)
    assert manager.num_free == 6 and all(n == 0 for n in manager.ref_counts)
    # Freed, the content stays findable until the pool needs the memory...
    d, cached_d = admit(manager, [1, 2, 3, 4, 5, 9], "d")
    assert cached_d == 4 and d.block_table[:2] == shared
    manager.release(d.block_table)
    # ...and when it does, the least recently freed blocks go first: a request's tail before its prefix.
    order = list(manager.free)
    assert order[-1] == shared[0] and order[-2] == shared[1], "the prefix is freed last, so evicted last"


def test_only_blocks_the_granted_tokens_fill_are_named():
    """A block is findable once the tokens granted to it fill it (their K/V are written this
    step), never earlier: a chunked prompt's half-computed block must not be shared."""
    manager = PrefixCachingBlockManager(8, 4)
    seq = seq_of(list(range(16)))
    assert manager.reuse_prefix(seq) == 0
    manager.grow(seq.block_table, 6)  # a first chunk of 6 tokens: block 0 full, block 1 half
    assert list(manager.cached.values()) == seq.block_table[:1]
    manager.grow(seq.block_table, 12)
    assert list(manager.cached.values()) == seq.block_table[:3]
    other = seq_of(list(range(16)), "other")
    assert manager.reuse_prefix(other) == 12


def test_eviction_takes_the_oldest_free_block_and_forgets_it():
    manager = PrefixCachingBlockManager(3, 2)
    a, _ = admit(manager, [1, 2, 3, 4, 5])
    manager.release(a.block_table)
    assert len(manager.cached) == 2
    b, cached = admit(manager, [7, 7, 7, 7, 7])  # needs all three blocks: both cached ones are evicted
    assert cached == 0 and manager.cached.keys() == set(block_hashes(b.token_ids, 2))
    c = seq_of([1, 2, 3, 4, 5])
    assert manager.reuse_prefix(c) == 0, "evicted content is not found any more"


def check_invariants(engine: LLMEngine) -> None:
    """Reference counts match the live tables; free + owned = the pool; cached blocks are exactly
    the named ones; no block is free and owned at once."""
    manager = engine.core.block_manager
    tables = [seq.block_table for seq in engine.core.scheduler.running]
    holders = Counter(b for table in tables for b in table)
    assert all(manager.ref_counts[b] == holders.get(b, 0) for b in range(manager.num_blocks)), "ref counts"
    free, owned = set(manager.free), set(holders)
    assert not free & owned and len(free) + len(owned) == manager.num_blocks
    assert all(not seq.block_table for seq in engine.core.scheduler.waiting), "waiting requests hold no blocks"
    assert {manager.cached[h] for h in manager.block_hash.values()} == set(manager.block_hash)
    assert all(manager.block_hash[b] == h for h, b in manager.cached.items())


# Prompts over a system prompt of 13 tokens: with 4-token blocks they share 0, 1 or 3 full blocks,
# one repeats another exactly (all blocks), one is a strict prefix of another.
SYSTEM = random_prompts([13], seed=7)[0]
PROMPTS = [
    random_prompts([9], seed=1)[0],  # shares nothing
    SYSTEM[:5] + random_prompts([6], seed=2)[0],  # shares one full block
    SYSTEM + random_prompts([7], seed=3)[0],  # shares three
    SYSTEM + random_prompts([7], seed=3)[0],  # all of the previous prompt's blocks
    SYSTEM[:8],  # a strict prefix: two full blocks, and nothing left but its last token
    SYSTEM + random_prompts([2], seed=4)[0],
]
LENGTHS = [10, 7, 12, 12, 9, 11]
STARVED = dict(block_size=4, num_kv_blocks=10, max_num_batched_tokens=12, max_num_seqs=4)


@pytest.mark.parametrize("caching", [True, False], ids=["cached", "plain"])
def test_greedy_tokens_match_transformers_under_starvation(model, hf_model, reference, caching):
    llm = LLM(model, enable_prefix_caching=caching, **STARVED)
    llm.trace = Trace()
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in LENGTHS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference(hf_model, p, n) for p, n in zip(PROMPTS, LENGTHS)]
    manager = llm.engine.core.block_manager
    assert manager.num_free == STARVED["num_kv_blocks"]
    assert llm.trace.num_preemptions > 0, "the settings were meant to force preemption"
    if caching:
        assert manager.hit_tokens > 0 and all(n == 0 for n in manager.ref_counts)
    else:
        assert type(manager) is BlockManager


def test_cached_prefix_saves_the_work(qwen3_model, hf_models, reference):
    """Once a prompt is in the cache, the same prompt computes only its last partial block."""
    llm = LLM(qwen3_model, block_size=4)
    llm.trace = Trace()
    prompt, n = PROMPTS[2], 5
    first = llm.generate(prompt, SamplingParams(max_tokens=n, **GREEDY), use_tqdm=False)[0]
    steps_before = len(llm.trace.steps)
    second = llm.generate(prompt, SamplingParams(max_tokens=n, **GREEDY), use_tqdm=False)[0]
    expected = reference(hf_models["qwen3"], prompt, n)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == expected
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 16)
    prefill = llm.trace.steps[steps_before].prefill
    assert list(prefill.values()) == [len(prompt) % 4 or 4], "only the tokens after the cached blocks ran"
    assert llm.trace.steps[steps_before].cached_tokens == llm.trace.num_cached_tokens == 16


@pytest.mark.parametrize("seed", range(3))
def test_invariants_under_random_add_step_abort(qwen3_model, hf_models, reference, seed):
    rng = random.Random(seed)
    engine = LLMEngine(qwen3_model, block_size=2, num_kv_blocks=16, max_num_batched_tokens=10, max_num_seqs=4)
    engine.core.trace = Trace()
    pool = [SYSTEM[:rng.randint(1, 13)] + random_prompts([rng.randint(0, 6)], seed=100 + i)[0] for i in range(12)]
    expected, got, aborted, added = {}, {}, set(), 0
    for step in range(400):
        if added < len(pool) and rng.random() < 0.6:
            n = rng.randint(2, 10)
            rid = f"q{added}"
            engine.add_request(prompt=pool[added], params=SamplingParams(max_tokens=n, **GREEDY), request_id=rid)
            expected[rid] = (pool[added], n)
            added += 1
        if engine.requests and rng.random() < 0.08:
            victim = rng.choice(sorted(engine.requests))
            engine.abort_request(victim)
            aborted.add(victim)
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        check_invariants(engine)
        if added == len(pool) and not engine.has_unfinished_requests():
            break
    else:
        pytest.fail("the engine never emptied")
    hf = hf_models["qwen3"]
    for rid, tokens in got.items():
        prompt, n = expected[rid]
        assert tokens == reference(hf, prompt, n), rid
    assert set(got) | aborted == set(expected)
    assert engine.core.block_manager.hit_tokens > 0 and engine.core.trace.num_preemptions > 0


def test_prompt_logprobs_are_computed_even_when_the_prompt_is_cached(qwen3_model, hf_models):
    """A request that asks for prompt logprobs needs every prompt token's logits, so it reuses
    no cached block (as in vLLM); its logprobs equal those of an engine without a cache, and
    transformers' log_softmax."""
    prompt = PROMPTS[2]
    params = SamplingParams(max_tokens=3, prompt_logprobs=1, **GREEDY)
    cached = LLM(qwen3_model, block_size=4)
    cached.generate(prompt, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)  # fills the cache
    with_cache = cached.generate(prompt, params, use_tqdm=False)[0]
    assert with_cache.num_cached_tokens == 0
    plain = LLM(qwen3_model, block_size=4, enable_prefix_caching=False).generate(prompt, params, use_tqdm=False)[0]
    assert with_cache.prompt_logprobs[0] is None and len(with_cache.prompt_logprobs) == len(prompt)
    with torch.no_grad():  # row j of transformers' log_softmax predicts prompt token j + 1
        reference = hf_models["qwen3"](torch.tensor([prompt])).logits[0].double().log_softmax(-1)
    for j, (got, want) in enumerate(zip(with_cache.prompt_logprobs[1:], plain.prompt_logprobs[1:])):
        assert got.keys() == want.keys()
        assert all(abs(got[t].logprob - want[t].logprob) < 1e-5 for t in got)
        assert got[prompt[j + 1]].logprob == pytest.approx(float(reference[j, prompt[j + 1]]), abs=1e-4)


def test_n_completions_share_their_prompt_blocks(qwen3_model):
    """The n samples of one prompt compute it once: the first child's blocks are named as soon
    as its tokens are granted, so its siblings, admitted in the same step, find them."""
    prompt = PROMPTS[2]  # 20 tokens: 4 full blocks of 4 usable, the last block recomputed
    llm = LLM(qwen3_model, block_size=4)
    llm.trace = Trace()
    out = llm.generate(prompt, SamplingParams(n=4, max_tokens=3, temperature=1.0, seed=0), use_tqdm=False)[0]
    assert len(out.outputs) == 4 and out.num_cached_tokens == 3 * 16
    first = llm.trace.steps[0]
    assert sorted(first.prefill.values()) == [4, 4, 4, 20], "one child computes the prompt, three reuse it"
    assert first.cached_tokens == 3 * 16


def test_hits_are_counted_once_per_admission_not_per_lookup(qwen3_model):
    """The head of the queue looks its prefix up every step until it fits, giving the blocks
    back each time; only the admission counts: the trace's and the manager's hit counts equal
    what the requests report, and every prompt is queried once."""
    engine = LLMEngine(qwen3_model, block_size=4, num_kv_blocks=10, max_num_batched_tokens=64)
    engine.core.trace = Trace()
    shared = random_prompts([16], seed=5)[0]
    prompts = {"first": shared + [1], "hog": random_prompts([20], seed=6)[0], "late": shared + [2, 3]}
    engine.add_request(prompt=prompts["first"], params=SamplingParams(max_tokens=1, **GREEDY), request_id="first")
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request(prompt=prompts["hog"], params=SamplingParams(max_tokens=4, **GREEDY), request_id="hog")
    engine.step()
    engine.add_request(prompt=prompts["late"], params=SamplingParams(max_tokens=2, **GREEDY), request_id="late")
    outputs, waited = {}, 0
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        waited += bool(engine.core.scheduler.waiting)
        outputs |= {out.request_id: out for out in engine.step() if out.finished}
    assert waited >= 3, "the settings were meant to keep 'late' waiting for blocks over several steps"
    manager = engine.core.block_manager
    assert outputs["late"].num_cached_tokens == 16
    assert manager.hit_tokens == engine.core.trace.num_cached_tokens == 16
    assert manager.queried_tokens == sum(map(len, prompts.values()))


def test_the_server_metrics_count_prefix_cache_queries_and_hits():
    """Over HTTP (chapter 10's server): the second request with the same 40-token prompt finds its
    two full 16-token blocks (32 tokens; the last block is partial, and the last prompt token is
    always computed)."""
    engine = LLMEngine(load_model(device="cpu"), tokenizer=load_tokenizer(), enable_prefix_caching=True, **ENGINE)
    body = {"model": MODEL, "prompt": list(range(100, 140)), "max_tokens": 2, "ignore_eos": True}
    with running_server(engine) as (url, _), httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False) as http:
        counts = []
        for _ in range(2):
            expect_status(http.post("/v1/completions", json=body))
            values = wait_until_idle(http)
            counts.append((values["minivllm_prefix_cache_queries_total"], values["minivllm_prefix_cache_hits_total"]))
    assert counts == [(40, 0), (80, 32)]
