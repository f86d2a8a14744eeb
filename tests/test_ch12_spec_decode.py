"""Chapter 12: speculative decoding. Greedy tokens equal transformers' with every proposer and
every k, under starvation; the rejection sampler keeps the target's distribution exactly; the
rollback keeps the block accounting and the prefix cache clean."""
from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
import torch
import transformers

import minivllm
from minivllm import LLM, LLMEngine, SamplingParams
from minivllm.core.block_manager import BlockManager
from minivllm.core.prefix_cache import PrefixCachingBlockManager, block_hashes
from minivllm.request.sequence import Sequence
from minivllm.config.speculative import SpeculativeConfig
from minivllm.core.spec_decode.ngram import propose_ngram
from minivllm.core.spec_decode.rejection import rejection_sample
from minivllm.core.spec_decode.rollback import rollback
from minivllm.core.trace import Trace
from tiny_models import random_prompts

pytestmark = [pytest.mark.ch12, pytest.mark.floors]

GREEDY = dict(temperature=0.0, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
STARVED = dict(block_size=2, num_kv_blocks=21, max_num_batched_tokens=7, max_num_seqs=3)
# Random tiny models repeat themselves quickly, so prompt lookup finds guesses in their output.
PROMPTS = random_prompts([5, 17, 9, 30, 3], seed=12)
LENGTHS = [20, 14, 24, 9, 18]


# ---------------------------------------------------------------------------------------------
# The exercises, each on its own
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens, k, lo, hi, expected", [
    ([1, 2, 3, 4, 1, 2, 3], 3, 1, 4, [4, 1, 2]),  # the 3-gram [1, 2, 3] occurred at 0: what followed it
    ([1, 2, 3, 4, 1, 2, 3], 9, 1, 4, [4, 1, 2, 3]),  # fewer than k when the sequence ends sooner
    ([5, 1, 9, 7, 1, 8, 1], 2, 1, 2, [8, 1]),  # 2-gram [8, 1] not seen, 1-gram [1]: its most recent occurrence
    ([7, 7, 7], 2, 1, 2, [7]),  # [7, 7] at 0, followed by the suffix's own last 7
    ([1, 2, 3], 2, 1, 4, []),  # nothing repeats
    ([4], 2, 1, 1, []),  # too short to look anything up
    ([3, 9, 3, 9, 5, 3, 9], 2, 2, 2, [5, 3]),  # the most recent occurrence of [3, 9] (at 2), not the first (at 0)
    ([6, 1, 2, 6, 1, 2, 6], 1, 3, 4, [1]),  # n = 4 first: [6, 1, 2, 6] occurred at 0, then came 1
])
def test_propose_ngram_finds_the_longest_most_recent_match(tokens, k, lo, hi, expected):
    before = list(tokens)
    assert propose_ngram(tokens, k, lo, hi) == expected, f"propose_ngram({tokens}, k={k}, min_n={lo}, max_n={hi})"
    assert tokens == before, "propose_ngram must not change token_ids"


@pytest.mark.parametrize("seed", range(3))
def test_propose_ngram_against_the_definition(seed):
    """Random token lists over a small vocabulary: the guess is what followed the most recent
    earlier occurrence of the longest suffix (within [min_n, max_n]) that occurred before."""
    rng = random.Random(seed)
    for _ in range(200):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 25))]
        k, lo = rng.randint(1, 4), rng.randint(1, 3)
        hi = lo + rng.randint(0, 2)
        expected = []
        for n in range(hi, lo - 1, -1):
            starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tokens[len(tokens) - n:]]
            if starts:
                expected = tokens[max(starts) + n:max(starts) + n + k]
                break
        assert propose_ngram(tokens, k, lo, hi) == expected, f"propose_ngram({tokens}, {k}, {lo}, {hi})"


def one_hot(index: int, size: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(index), size).float()


def test_rejection_sample_greedy_keeps_guesses_while_they_are_the_argmax():
    V = 5
    # Sequence 0: guesses 3, 1, 4; the target's argmaxes are 3, 1, 2, (0): keeps 3, 1, then 2.
    # Sequence 1: one guess, 2; the argmax is 2, then 4 (the bonus): emits 2, 4.
    # Sequence 2: two guesses; the first (0) is already wrong: the argmax 1 replaces it.
    probs = torch.zeros(3, 4, V)
    for s, row in enumerate([[3, 1, 2, 0], [2, 4, 0, 0], [1, 3, 3, 0]]):
        for j, t in enumerate(row):
            probs[s, j] = one_hot(t, V)
    drafts = torch.tensor([[3, 1, 4], [2, -1, -1], [0, 3, -1]])
    num = torch.tensor([3, 1, 2])
    uniforms, noise = torch.full((3, 3), 0.999), torch.ones(3, V)
    tokens, accepted = rejection_sample(probs, drafts, num, None, uniforms, noise)
    assert accepted.tolist() == [2, 1, 0]
    assert tokens.tolist() == [[3, 1, 2, -1], [2, 4, -1, -1], [1, -1, -1, -1]]


def residual_draw(weights: torch.Tensor, noise: torch.Tensor) -> int:
    return int((weights / noise).argmax())


def test_rejection_sample_draws_from_the_residual_at_the_first_rejection():
    """A hand-made case: p_0 = [.5, .3, .2], the guess is 1 with q_0 = [.1, .6, .3]: accepted
    when u * .6 < .3. Rejected, the token comes from max(0, p - q) = [.4, 0, 0]: always 0."""
    p = torch.tensor([[[.5, .3, .2], [.2, .2, .6]]])
    q = torch.tensor([[[.1, .6, .3]]])
    drafts, num = torch.tensor([[1]]), torch.tensor([1])
    noise = torch.tensor([[5.0, 0.01, 0.01]])  # would pick 1 or 2 from any weights that kept them
    tokens, accepted = rejection_sample(p, drafts, num, q, torch.tensor([[0.7]]), noise)
    assert accepted.tolist() == [0] and tokens.tolist() == [[0, -1]], "rejected: the residual [.4, 0, 0] draws 0"
    tokens, accepted = rejection_sample(p, drafts, num, q, torch.tensor([[0.2]]), torch.ones(1, 3))
    assert accepted.tolist() == [1] and tokens.tolist() == [[1, 2]], "accepted, then the bonus from p_1 (argmax 2)"


def sample_many(n: int, p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, seed: int, sampler=rejection_sample):
    """n independent verifications, seeded. With q, each run's guesses are drawn from q (the
    exactness of rejection sampling assumes they were); without, they are `drafts` (certain)."""
    generator = torch.Generator().manual_seed(seed)
    K, V = drafts.shape[1], p.shape[-1]
    if q is not None:
        drafts = torch.stack([torch.multinomial(q[0, j], n, replacement=True, generator=generator) for j in range(K)], 1)
    uniforms = torch.rand(n, K, generator=generator)
    noise = torch.empty(n, V).exponential_(generator=generator)
    return sampler(p.expand(n, -1, -1), drafts.expand(n, -1), torch.full((n,), K), None if q is None else q.expand(n, -1, -1),
                   uniforms, noise)


def always_accept(p, drafts, num, q, uniforms, noise):
    return rejection_sample(p, drafts, num, q, torch.zeros_like(uniforms) - 1e9, noise)


def resample_from_target(p, drafts, num, q, uniforms, noise):
    """A wrong sampler: at a rejection it draws from p itself instead of the residual."""
    tokens, accepted = rejection_sample(p, drafts, num, q, uniforms, noise)
    redrawn = (p[torch.arange(len(p)), accepted] / noise).argmax(-1)
    return tokens.scatter(1, accepted[:, None], redrawn[:, None]), accepted


DISTRIBUTION_CASES = {
    "certain guesses (q one-hot)": None,
    "a draft distribution": torch.tensor([[.1, .5, .2, .1, .1], [.3, .1, .1, .4, .1]]),
}


def first_tokens_distance(tokens: torch.Tensor, accepted: torch.Tensor, p: torch.Tensor) -> float:
    """Largest gap between the empirical and the exact distribution of the first emitted token
    (p_0) and of the second when the first guess was kept (p_1)."""
    V = p.shape[-1]
    first = torch.bincount(tokens[:, 0], minlength=V).float() / len(tokens)
    kept = tokens[accepted >= 1]
    second = torch.bincount(kept[:, 1], minlength=V).float() / max(1, len(kept))
    return max((first - p[0, 0]).abs().max().item(), (second - p[0, 1]).abs().max().item())


@pytest.mark.parametrize("case", sorted(DISTRIBUTION_CASES))
def test_rejection_sample_keeps_the_targets_distribution(case):
    """200,000 seeded verifications: the first token is distributed as p_0 and, after an
    accepted first guess, the second as p_1, within 5 standard errors. The same test fails a
    sampler that always accepts and one that resamples from the target instead of the residual."""
    p = torch.tensor([[[.3, .1, .4, .1, .1], [.05, .6, .05, .2, .1], [.2, .2, .2, .2, .2]]])
    drafts = torch.tensor([[0, 1]])
    q = DISTRIBUTION_CASES[case]
    q = None if q is None else q[None]
    tolerance = 5 * (0.25 / 60_000) ** 0.5  # 5 SE; the conditional sample has >= 60k draws here
    assert first_tokens_distance(*sample_many(200_000, p, drafts, q, seed=0), p) < tolerance
    for wrong in (always_accept, resample_from_target):
        bad = sample_many(200_000, p, drafts, q, seed=0, sampler=wrong)
        assert first_tokens_distance(*bad, p) > 3 * tolerance, f"the check cannot tell {wrong.__name__}"


def make_running(tokens: list[int], computed: int, manager: BlockManager, guesses: int) -> Sequence:
    seq = Sequence("r", tokens, SamplingParams(max_tokens=50), max_model_len=200)
    seq.token_ids += [90 + j for j in range(guesses)]
    seq.num_spec_tokens = guesses
    manager.grow(seq.block_table, computed + 1 + guesses)  # the verify chunk's blocks
    seq.num_computed_tokens = computed + 1 + guesses  # as the engine counts it after the forward
    return seq


@pytest.mark.parametrize("rejected", [0, 1, 3, 4])
def test_rollback_moves_the_count_back_and_frees_the_guesses_blocks(rejected):
    manager = BlockManager(num_blocks=10, block_size=2)
    seq = make_running(list(range(7)), computed=6, manager=manager, guesses=4)  # positions 6..10: 6 blocks
    assert len(seq.block_table) == 6 and manager.num_free == 4
    rollback(seq, rejected, manager)
    assert seq.token_ids == list(range(7)), "the guesses leave token_ids (the accepted ones come back by append_token)"
    assert seq.num_spec_tokens == 0
    assert seq.num_computed_tokens == 11 - rejected, "computed: the chunk's 1 + 4 positions minus the rejected"
    assert len(seq.block_table) == -(-(11 - rejected) // 2), "exactly the blocks the computed tokens need"
    assert manager.num_free + len(seq.block_table) == 10 and not set(seq.block_table) & set(manager.free)


def test_rollback_refuses_an_impossible_count():
    manager = BlockManager(num_blocks=10, block_size=2)
    seq = make_running([1, 2, 3], computed=2, manager=manager, guesses=2)
    for bad in (-1, 3, 1.0, True):
        with pytest.raises(ValueError, match="num_rejected"):
            rollback(seq, bad, manager)
    assert seq.num_spec_tokens == 2 and seq.num_computed_tokens == 5, "a refused rollback changes nothing"


def test_rollback_keeps_shared_prefix_blocks_and_their_counts():
    """With prefix caching a rolled-back block goes back with its reference count; named
    (shared) blocks hold only verified tokens and are never among the ones given back."""
    manager = PrefixCachingBlockManager(num_blocks=12, block_size=2)
    seq = Sequence("r", list(range(7)), SamplingParams(max_tokens=50), max_model_len=200)
    manager.reuse_prefix(seq)
    manager.grow(seq.block_table, 6)  # the prompt's first 6 tokens: 3 named blocks
    seq.num_computed_tokens = 6
    seq.token_ids += [90, 91, 92]
    seq.num_spec_tokens = 3
    manager.grow(seq.block_table, 10)  # the last real token and 3 guesses
    seq.num_computed_tokens = 10
    named = set(manager.block_hash)
    assert len(named) == 3, "a block holding a guess is never named"
    rollback(seq, 3, manager)
    assert named <= set(seq.block_table) and len(seq.block_table) == 4
    assert all(manager.ref_counts[b] == 1 for b in seq.block_table)
    assert sum(manager.ref_counts) + manager.num_free == 12 - len(set(manager.free) & set(seq.block_table))


# ---------------------------------------------------------------------------------------------
# The config
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config, match", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, "integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": True}, "integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "must not exceed"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "takes no 'model'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ("ngram", "must be a dict"),
    *[({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": bad}, "integer >= 2")
      for bad in (1, 0, "4", 4.0, True)],
])
def test_bad_speculative_configs_are_refused(qwen3_model, config, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(qwen3_model, speculative_config=config)


def test_a_config_is_read_as_vllm_reads_it():
    assert SpeculativeConfig.from_dict({"model": "x", "num_speculative_tokens": 2}).method == "draft_model"
    ngram = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (1, 3)


def test_disable_by_batch_size_defaults_by_device():
    """Left out (or "auto"): the device's default (16 on a CPU, never on CUDA); None: never."""
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    for config in (ngram, ngram | {"disable_by_batch_size": "auto"}):
        auto = SpeculativeConfig.from_dict(config)
        assert auto.pause_at(torch.device("cpu")) == 16 and auto.pause_at(torch.device("cuda")) is None
    assert SpeculativeConfig.from_dict(ngram | {"disable_by_batch_size": None}).pause_at(torch.device("cpu")) is None
    assert SpeculativeConfig.from_dict(ngram | {"disable_by_batch_size": 40}).pause_at(torch.device("cuda")) == 40


def test_a_draft_with_another_vocabulary_is_refused(qwen3_model):
    config = dataclasses.replace(qwen3_model.config, vocab_size=qwen3_model.config.vocab_size + 1)
    other = minivllm.Decoder(config)
    with pytest.raises(ValueError, match="vocabulary"):
        LLMEngine(qwen3_model, speculative_config={"model": other, "num_speculative_tokens": 2})


# ---------------------------------------------------------------------------------------------
# The engine: transformers' greedy tokens, whatever is guessed
# ---------------------------------------------------------------------------------------------


def tiny_draft(hf_model) -> minivllm.Decoder:
    """A draft that differs from the target: the same family and vocabulary, other random weights."""
    settings = {k: v for k, v in hf_model.config.to_dict().items() if k != "layer_types"}
    config = hf_model.config.__class__(**{**settings, "num_hidden_layers": 1})
    torch.manual_seed(123)
    other = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return minivllm.load_model(other, device="cpu")


def check_blocks(engine: LLMEngine) -> None:
    """Every block is free or owned; with prefix caching the counts match the live tables and a
    named block's hash is the hash of its owner's own (verified) tokens there."""
    manager = engine.core.block_manager
    tables = [seq.block_table for seq in engine.core.scheduler.running]
    holders = Counter(b for table in tables for b in table)
    assert not set(manager.free) & set(holders) and len(manager.free) + len(holders) == manager.num_blocks
    assert all(not seq.block_table for seq in engine.core.scheduler.waiting)
    assert all(seq.num_spec_tokens == 0 for seq in engine.core.scheduler.running), "guesses never outlive a step"
    if isinstance(manager, PrefixCachingBlockManager):
        assert all(manager.ref_counts[b] == holders.get(b, 0) for b in range(manager.num_blocks))
        for seq in engine.core.scheduler.running:
            for i, h in enumerate(block_hashes(seq.token_ids, manager.block_size)):
                if i < len(seq.block_table) and seq.block_table[i] in manager.block_hash:
                    assert manager.block_hash[seq.block_table[i]] == h, "a named block holds other tokens"


def run_checked(engine: LLMEngine, prompts, lengths, params: dict, steps: int = 3000) -> dict[str, list[int]]:
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(prompt=prompt, params=SamplingParams(max_tokens=n, **params), request_id=str(i))
    outputs = {}
    for _ in range(steps):
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        check_blocks(engine)
        if not engine.has_unfinished_requests():
            return outputs
    pytest.fail("the engine did not finish")


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "self"])
def test_greedy_tokens_equal_transformers_under_starvation(model, hf_model, reference, method, k):
    """Tiny blocks, a pool that forces preemption, a budget that cuts verify chunks: every
    request ends with transformers' own greedy tokens, and blocks stay accounted for after every
    step. ("self": the target drafts for itself, so every guess is accepted: the bonus path.)"""
    spec = {"num_speculative_tokens": k} | (
        {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram"
        else {"model": model if method == "self" else tiny_draft(hf_model)})
    engine = LLMEngine(model, speculative_config=spec, enable_prefix_caching=False, **STARVED)
    engine.core.trace = Trace()
    outputs = run_checked(engine, PROMPTS, LENGTHS, GREEDY)
    for i, (prompt, n) in enumerate(zip(PROMPTS, LENGTHS)):
        assert outputs[str(i)].outputs[0].token_ids == reference(hf_model, prompt, n), f"request {i}"
    stats = engine.core.speculator.stats
    assert stats.num_draft_tokens > 0, "nothing was ever guessed: the test would not test speculation"
    if method == "self":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert any(r.preempted for r in engine.core.trace.steps), "the pool was meant to force a preemption"
    assert engine.core.block_manager.num_free == engine.core.block_manager.num_blocks


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_greedy_tokens_with_prefix_caching(qwen3_model, hf_models, reference, method):
    """Requests that share a prefix, with the cache on: transformers' tokens, and no named block
    ever holds a guess (check_blocks compares every named block with its owner's tokens)."""
    system = random_prompts([9], seed=4)[0]
    prompts = [system + p for p in random_prompts([3, 6, 1, 8], seed=5)] + [system]
    lengths = [16, 12, 20, 9, 14]
    spec = {"num_speculative_tokens": 3} | ({"method": "ngram"} if method == "ngram" else {"model": qwen3_model})
    engine = LLMEngine(qwen3_model, speculative_config=spec, enable_prefix_caching=True, **STARVED)
    outputs = run_checked(engine, prompts, lengths, GREEDY)
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        assert outputs[str(i)].outputs[0].token_ids == reference(hf_models["qwen3"], prompt, n), f"request {i}"
    assert engine.core.block_manager.hit_tokens > 0, "the prompts were meant to share cached blocks"


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_no_guesses_while_the_batch_is_at_disable_by_batch_size(qwen3_model, hf_models, reference, method,
                                                                monkeypatch):
    """disable_by_batch_size=3 over 5 requests that finish at different times: a step that begins
    with 3 or more running proposes nothing, speculation resumes below 3, and every request still
    ends with transformers' greedy tokens (the draft catches up on what it did not see)."""
    spec = {"num_speculative_tokens": 3, "disable_by_batch_size": 3} | (
        {"method": "ngram"} if method == "ngram" else {"model": qwen3_model})
    engine = LLMEngine(qwen3_model, speculative_config=spec, enable_prefix_caching=False, max_num_seqs=4)
    steps = []  # (requests running when the step began, guesses it proposed)
    propose = engine.core.speculator.propose

    def counted(running):
        propose(running)
        steps.append((len(running), sum(seq.num_spec_tokens for seq in running)))

    monkeypatch.setattr(engine.core.speculator, "propose", counted)
    outputs = run_checked(engine, PROMPTS, LENGTHS, GREEDY)
    for i, (prompt, n) in enumerate(zip(PROMPTS, LENGTHS)):
        assert outputs[str(i)].outputs[0].token_ids == reference(hf_models["qwen3"], prompt, n), f"request {i}"
    assert all(guesses == 0 for running, guesses in steps if running >= 3)
    assert any(running >= 3 for running, _ in steps), "the batch was meant to reach the threshold"
    assert any(guesses > 0 for running, guesses in steps if running < 3), "speculation was meant to resume"


def test_n_completions_with_top_k_1_equal_greedy(qwen3_model, hf_models, reference):
    """n > 1 needs sampling; top_k=1 samples the argmax, so both completions are greedy's."""
    llm = LLM(qwen3_model, speculative_config={"model": qwen3_model, "num_speculative_tokens": 2}, **STARVED)
    params = SamplingParams(n=2, temperature=0.8, top_k=1, max_tokens=15, ignore_eos=True, seed=3)
    out = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for prompt, request in zip(PROMPTS[:2], out):
        expected = reference(hf_models["qwen3"], prompt, 15)
        assert [c.token_ids for c in request.outputs] == [expected, expected]


def test_stops_and_lengths_end_exactly_where_plain_decoding_ends(qwen3_model):
    """A stop token or max_tokens inside an accepted run: nothing is emitted after it."""
    plain = LLM(qwen3_model)
    spec = LLM(qwen3_model, speculative_config={"model": qwen3_model, "num_speculative_tokens": 5})
    prompt = PROMPTS[1]
    full = plain.generate(prompt, SamplingParams(max_tokens=30, **GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    stop = full[11]
    for params in (SamplingParams(max_tokens=30, stop_token_ids=[stop], **GREEDY),
                   SamplingParams(max_tokens=7, **GREEDY), SamplingParams(max_tokens=13, **GREEDY)):
        expected = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        got = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.finish_reason, got.stop_reason) == (
            expected.token_ids, expected.finish_reason, expected.stop_reason), params
        assert len(got.token_ids) <= params.max_tokens
    assert spec.engine.core.speculator.stats.num_accepted_tokens > 0


def test_logprobs_come_from_the_target(qwen3_model, hf_models):
    """Greedy with logprobs: every emitted token's logprob and top alternatives equal plain
    decoding's (the draft never decides a reported probability)."""
    params = SamplingParams(max_tokens=12, logprobs=3, **GREEDY)
    plain = LLM(qwen3_model).generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    spec = LLM(qwen3_model, speculative_config={"model": tiny_draft(hf_models["qwen3"]), "num_speculative_tokens": 3})
    got = spec.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == plain.token_ids
    for a, b in zip(got.logprobs, plain.logprobs):
        assert list(a) == list(b)
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)


def test_metrics_count_drafts_and_acceptances(qwen3_model):
    llm = LLM(qwen3_model, speculative_config={"model": qwen3_model, "num_speculative_tokens": 2})
    out = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)
    stats = llm.engine.core.speculator.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0  # the target guesses itself
    assert sum(o.metrics.num_draft_tokens for o in out) == stats.num_draft_tokens
    assert stats.num_accepted_per_position == stats.num_drafts_per_position
    assert sum(stats.num_drafts_per_position) == stats.num_draft_tokens
    # 10 tokens each: the first from the prompt, the other 9 from verify steps of 3 (2 guesses + 1):
    # 3 drafts of 2 guesses per request, the last one cut to what max_tokens leaves.
    assert stats.num_drafts == 3 * 3 and stats.num_draft_tokens == 3 * (2 + 2 + 2)


# ---------------------------------------------------------------------------------------------
# Sampling: the engine's output distribution is the target's
# ---------------------------------------------------------------------------------------------


def tiny_vocab_pair(vocab: int = 6) -> tuple[transformers.PreTrainedModel, minivllm.Decoder, minivllm.Decoder]:
    """A target and a very different draft over a vocabulary of `vocab` tokens."""
    config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=64, initializer_range=0.3, eos_token_id=None,
                                      bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf_target = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    torch.manual_seed(99)
    hf_draft = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return hf_target, minivllm.load_model(hf_target, device="cpu"), minivllm.load_model(hf_draft, device="cpu")


def exact_pair_distribution(hf_model, prompt: list[int], vocab: int, temperature: float) -> torch.Tensor:
    """P(second output token = a, third = b) [V, V], summed over the first token, from
    transformers' logits: the distribution plain sampling would have."""
    def probs(tokens):
        with torch.no_grad():
            logits = hf_model(torch.tensor([tokens])).logits[0, -1].double()
        return (logits / temperature).softmax(-1)
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    first = probs(prompt)
    for t0 in range(vocab):
        second = probs(prompt + [t0])
        for t1 in range(vocab):
            joint[t1] += first[t0] * second[t1] * probs(prompt + [t0, t1])
    return joint


def sampled_pairs(target, draft, prompt, n: int, temperature: float) -> torch.Tensor:
    """The empirical joint distribution of the second and third output tokens of n seeded requests."""
    spec = {"model": draft, "num_speculative_tokens": 2, "disable_by_batch_size": None}  # speculate at any batch
    engine = LLMEngine(target, speculative_config=spec, max_num_seqs=256,
                       num_kv_blocks=2048, enable_prefix_caching=False)
    for i in range(n):
        engine.add_request(prompt=prompt, params=SamplingParams(max_tokens=4, temperature=temperature, seed=i, ignore_eos=True))
    counts = torch.zeros(target.config.vocab_size, target.config.vocab_size, dtype=torch.float64)
    for _ in range(10 * n):
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
                counts[tokens[1], tokens[2]] += 1
        if not engine.has_unfinished_requests():
            break
    assert engine.core.speculator.stats.num_draft_tokens > n, "the second and third tokens were meant to be guessed"
    return counts / n


@pytest.mark.slow
def test_sampled_tokens_follow_the_targets_distribution_not_the_drafts(monkeypatch):
    """4,000 seeded requests, a draft model unlike the target: the second and third output tokens
    (both verified guesses or their replacements) have the joint distribution transformers'
    logits give, within 5 standard errors in every cell; the same check fails a sampler that
    always accepts and one that resamples from the target instead of the residual."""
    vocab, temperature, n = 6, 1.0, 4000
    hf_target, target, draft = tiny_vocab_pair(vocab)
    prompt = [1, 4, 2, 5]
    exact = exact_pair_distribution(hf_target, prompt, vocab, temperature)
    tolerance = 5 * (exact * (1 - exact) / n).sqrt()
    got = sampled_pairs(target, draft, prompt, n, temperature)
    assert ((got - exact).abs() <= tolerance + 1e-3).all(), (got - exact).abs().max()
    for wrong in (always_accept, resample_from_target):
        monkeypatch.setattr("minivllm.core.spec_decode.speculator.rejection_sample", wrong)
        bad = sampled_pairs(target, draft, prompt, n, temperature)
        assert ((bad - exact).abs() > tolerance + 1e-3).any(), f"the check cannot tell {wrong.__name__}"


# ---------------------------------------------------------------------------------------------
# Serving
# ---------------------------------------------------------------------------------------------


def test_the_server_streams_speculated_tokens_and_counts_them():
    """`minivllm serve --speculative-config ...` as a client sees it: the streamed text equals
    LLM.generate's without speculation, and /metrics carries vLLM's counters, equal to the
    engine's own totals."""
    import httpx
    import openai

    from minivllm.entrypoints.openai.threaded import running_server

    model, tokenizer = minivllm.load_model(), minivllm.load_tokenizer()
    prompt = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return"
    expected = LLM(model, tokenizer=tokenizer).generate(prompt, SamplingParams(max_tokens=40, **GREEDY),
                                                         use_tqdm=False)[0].outputs[0].text
    engine = LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=64, speculative_config=NGRAM)
    with running_server(engine, "spec") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)
        stream = client.completions.create(model="spec", prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    stats = engine.core.speculator.stats
    assert stats.num_accepted_tokens > 0, "the repeated functions were meant to be guessed"
    for name, value in (("num_drafts", stats.num_drafts), ("num_draft_tokens", stats.num_draft_tokens),
                        ("num_accepted_tokens", stats.num_accepted_tokens)):
        assert f"minivllm_spec_decode_{name}_total {float(value)}" in metrics, name
