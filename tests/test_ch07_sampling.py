"""Chapter 7: the sampler. Empirical frequencies against the softmax (with temperature, top-k
and top-p computed independently here), seeded reproducibility whatever else is in the batch,
top_k=1 equals greedy, and SamplingParams validation."""
from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine.sampler import sample

pytestmark = pytest.mark.ch07

LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.3, 0.0, -0.5, -1.0])
DRAWS = 20_000


def expected_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution a request should sample from, spelled out one token at a time."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = order[:top_k] if top_k else order
    mass = sum(probs[i] for i in kept)
    nucleus, total = [], 0.0
    for i in kept:  # the most likely tokens, until their (renormalised) mass reaches top_p
        nucleus.append(i)
        total += probs[i] / mass
        if total >= top_p:
            break
    out = torch.zeros_like(probs)
    out[nucleus] = probs[nucleus]
    return out / out.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.7), (0.8, 5, 0.9), (1.0, 0, 0.05),
])
def test_frequencies_follow_the_filtered_softmax(temperature, top_k, top_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    generator = torch.Generator().manual_seed(0)
    tokens = sample(LOGITS.expand(DRAWS, -1), [params] * DRAWS, [generator] * DRAWS)
    freq = torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).double() / DRAWS
    want = expected_probs(LOGITS, temperature, top_k, top_p)
    assert freq[want == 0].sum() == 0  # filtered tokens are never drawn
    torch.testing.assert_close(freq, want, atol=0.015, rtol=0)  # ~5 standard errors at 20k draws


def test_greedy_rows_take_the_argmax_next_to_sampled_rows():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    greedy, hot = SamplingParams(temperature=0), SamplingParams(temperature=5.0, seed=3)
    params = [greedy, hot, greedy, hot, greedy, hot]
    gens = [None if p.greedy else torch.Generator().manual_seed(3) for p in params]
    tokens = sample(logits, params, gens)
    assert [tokens[i] for i in (0, 2, 4)] == logits[[0, 2, 4]].argmax(-1).tolist()


PROMPT = [5, 17, 33, 2, 60, 41, 8]
OTHERS = [[1, 2, 3], [90, 80, 70, 60, 50, 40, 30, 20, 10], [44] * 15]


def completions(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_seeded_sampling_does_not_depend_on_the_batch(qwen3_model):
    llm = LLM(qwen3_model)
    mine = SamplingParams(max_tokens=12, temperature=1.5, top_p=0.95, seed=7)
    alone = completions(llm, [PROMPT], [mine])[0]
    noisy = [SamplingParams(max_tokens=n, temperature=1.0) for n in (4, 20, 9)]  # unseeded neighbours
    in_batch = completions(llm, [OTHERS[0], PROMPT, *OTHERS[1:]], [noisy[0], mine, *noisy[1:]])[1]
    starved = LLM(qwen3_model, block_size=4, num_kv_blocks=12, max_num_batched_tokens=8)  # chunks and preemptions
    in_starved_batch = completions(starved, [*OTHERS, PROMPT], [*noisy, mine])[3]
    assert alone == in_batch == in_starved_batch
    other_seed = completions(llm, [PROMPT], [SamplingParams(max_tokens=12, temperature=1.5, top_p=0.95, seed=8)])[0]
    assert other_seed != alone  # the seed, not something else, decides


def test_top_k_1_equals_greedy(qwen3_model):
    llm = LLM(qwen3_model)
    prompts = [PROMPT, *OTHERS]
    greedy = completions(llm, prompts, [SamplingParams(max_tokens=10, temperature=0)] * 4)
    top1 = completions(llm, prompts, [SamplingParams(max_tokens=10, temperature=1.3, top_k=1)] * 4)
    assert top1 == greedy


@pytest.mark.parametrize("bad", [
    dict(max_tokens=0), dict(max_tokens=2.5), dict(temperature=-0.1), dict(temperature=float("nan")),
    dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(top_k=1.5), dict(seed="7"),
])
def test_invalid_sampling_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
