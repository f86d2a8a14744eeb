"""Chapter 7: the sampler. Empirical frequencies against the softmax (with temperature, top-k,
top-p and min_p computed independently here), seeded reproducibility whatever else is in the
batch, top_k=1 equals greedy, a vanishing temperature is greedy, and SamplingParams refuses
every bad value and every bad type."""
from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.worker.sampler import Sampler, filter_logits
from minivllm.request.sequence import Sequence

pytestmark = [pytest.mark.ch07, pytest.mark.floors]

LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.3, 0.0, -0.5, -1.0])
DRAWS = 20_000


def rows_of(params: SamplingParams, n: int, generator: torch.Generator | None = None) -> list[Sequence]:
    """n one-token sequences sampling with `params`, all drawing from `generator`."""
    seqs = [Sequence(str(i), [0], params, max_model_len=100) for i in range(n)]
    for seq in seqs:
        seq.generator = generator
    return seqs


def draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    return Sampler()(logits.expand(n, -1), rows_of(params, n, torch.Generator().manual_seed(seed)), set()).token_ids


def expected_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """The distribution a request should sample from, spelled out one token at a time:
    min_p against the top probability first, then top-k, then top-p (vLLM's order)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    order = [i for i in order if probs[i] >= min_p * probs[order[0]]]
    kept = order[:top_k] if top_k > 0 else order
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


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.0), (0.5, 0, 1.0, 0.0), (2.0, 0, 1.0, 0.0), (1.0, 3, 1.0, 0.0), (1.0, 0, 0.7, 0.0),
    (0.8, 5, 0.9, 0.0), (1.0, 0, 0.05, 0.0), (1.0, -1, 1.0, 0.0), (1.0, 0, 1.0, 0.2), (0.7, 6, 0.95, 0.1),
])
def test_frequencies_follow_the_filtered_softmax(temperature, top_k, top_p, min_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    tokens = draw(LOGITS, params, DRAWS)
    freq = torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).double() / DRAWS
    want = expected_probs(LOGITS, temperature, top_k, top_p, min_p)
    assert freq[want == 0].sum() == 0  # filtered tokens are never drawn
    torch.testing.assert_close(freq, want, atol=0.015, rtol=0)  # ~5 standard errors at 20k draws


def test_greedy_rows_take_the_argmax_next_to_sampled_rows():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    greedy, hot = SamplingParams(temperature=0), SamplingParams(temperature=5.0, seed=3)
    seqs = [rows_of(p, 1, torch.Generator().manual_seed(3))[0] for p in [greedy, hot, greedy, hot, greedy, hot]]
    tokens = Sampler()(logits, seqs, set()).token_ids
    assert [tokens[i] for i in (0, 2, 4)] == logits[[0, 2, 4]].argmax(-1).tolist()


def test_filter_logits_leaves_unfiltered_rows_alone_and_keeps_the_top_token():
    logits = torch.randn(64, 4096, generator=torch.Generator().manual_seed(4)) * 6  # long float tails
    off = filter_logits(logits, torch.tensor([0, -1] * 32), torch.ones(64))
    assert torch.equal(off, logits)  # top_k off and top_p = 1: nothing is cut, not even the far tail
    tight = filter_logits(logits, torch.ones(64, dtype=torch.long), torch.full((64,), 1e-9))
    assert torch.equal(tight.isfinite().nonzero()[:, 1], logits.argmax(-1))  # exactly the top token survives


# Small rows whose filtered set is known by hand: (logits, top_k, top_p, the tokens that stay).
# Logits are log-probabilities, so the probabilities are the numbers in each case's name.
FILTER_CASES = {
    "top_p keeps the token whose probability crosses it: 0.5 + 0.3 >= 0.7":
        ([0.5, 0.3, 0.15, 0.05], 0, 0.7, [0, 1]),
    "top_p stops as soon as the sum reaches it: 0.5 + 0.3 + 0.15 >= 0.81, the last token is cut":
        ([0.5, 0.3, 0.15, 0.05], 0, 0.81, [0, 1, 2]),
    "top_p measured on the softmax over the kept top_k: top 2 renormalised to 0.625 + 0.375, and 0.625 >= 0.6":
        ([0.5, 0.3, 0.15, 0.05], 2, 0.6, [0]),
    "the most likely token stays, however small top_p": ([0.5, 0.3, 0.15, 0.05], 0, 0.01, [0]),
    "top_k keeps the k largest wherever they are in the row": ([0.1, 0.4, 0.05, 0.3, 0.15], 2, 1.0, [1, 3]),
    "top_k keeps every token tied with the k-th largest: 3 tokens for top_k = 2": ([0.4, 0.25, 0.25, 0.1], 2, 1.0, [0, 1, 2]),
    "top_k larger than the vocabulary keeps everything": ([0.4, 0.35, 0.25], 5, 1.0, [0, 1, 2]),
}


def kept_row(tokens: list[int], size: int) -> str:
    return " ".join("kept" if t in tokens else "cut " for t in range(size))


@pytest.mark.parametrize("case", list(FILTER_CASES))
def test_filter_logits_keeps_exactly_the_tokens_it_should(case):
    probs, top_k, top_p, keep = FILTER_CASES[case]
    logits = torch.tensor(probs).log()
    got = filter_logits(logits[None], torch.tensor([top_k]), torch.tensor([top_p]))[0]
    kept = got.isfinite().nonzero().flatten().tolist()
    assert kept == keep, (f"{case}\nfilter_logits(log {probs}, top_k={top_k}, top_p={top_p}):\n"
                          f"  expected: {kept_row(keep, len(probs))}\n  got:      {kept_row(kept, len(probs))}")
    assert torch.equal(got[keep], logits[keep]) and torch.all(got[[t for t in range(len(probs)) if t not in keep]] == -torch.inf), \
        f"{case}: kept logits must stay as they were and the others become -inf, got {got.tolist()}"


def test_filter_logits_filters_each_row_with_its_own_settings():
    rows = torch.tensor([v for v, *_ in FILTER_CASES.values() if len(v) == 4]).log()
    settings = [(k, p, keep) for v, k, p, keep in FILTER_CASES.values() if len(v) == 4]
    got = filter_logits(rows, torch.tensor([k for k, _, _ in settings]), torch.tensor([p for _, p, _ in settings]))
    for row, (k, p, keep) in zip(got, settings):
        assert row.isfinite().nonzero().flatten().tolist() == keep, f"the row with top_k={k}, top_p={p} in a batch"


@pytest.mark.parametrize("temperature", [0.0, 1e-6, 1e-30, 5e-324])
def test_a_vanishing_temperature_is_greedy(temperature):
    # Logits this large overflow to inf when divided by 1e-30: the sampler must not divide.
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2)) * 1e4
    params = SamplingParams(temperature=temperature, top_p=0.5, min_p=0.5)
    assert params.greedy
    assert Sampler()(logits, rows_of(params, 4), set()).token_ids == logits.argmax(-1).tolist()


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


def test_top_k_1_equals_greedy_and_top_k_minus_1_equals_0(qwen3_model):
    llm = LLM(qwen3_model)
    prompts = [PROMPT, *OTHERS]
    greedy = completions(llm, prompts, [SamplingParams(max_tokens=10, temperature=0)] * 4)
    top1 = completions(llm, prompts, [SamplingParams(max_tokens=10, temperature=1.3, top_k=1)] * 4)
    assert top1 == greedy
    off = [completions(llm, prompts, [SamplingParams(max_tokens=10, temperature=1.3, top_k=k, seed=4)] * 4)
           for k in (0, -1)]
    assert off[0] == off[1]


BAD = [
    # values out of range
    dict(n=0), dict(max_tokens=0), dict(min_tokens=-1), dict(min_tokens=5, max_tokens=4), dict(temperature=-0.1),
    dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=0.0), dict(top_p=1.5),
    dict(top_k=-2), dict(min_p=-0.1), dict(min_p=1.1), dict(presence_penalty=2.5), dict(frequency_penalty=-3),
    dict(repetition_penalty=0.0), dict(repetition_penalty=-1.0), dict(repetition_penalty=float("inf")),
    dict(seed=2**63), dict(logprobs=-1), dict(prompt_logprobs=-1), dict(stop=""), dict(stop=["ok", ""]),
    dict(stop_token_ids=[-1]), dict(n=2, temperature=0),
    # wrong types: never converted, never a TypeError from deep inside
    dict(n=2.0), dict(n="2"), dict(n=None), dict(max_tokens=2.5), dict(max_tokens="16"), dict(max_tokens=True),
    dict(min_tokens=None), dict(min_tokens=1.0), dict(temperature="0.7"), dict(temperature=None),
    dict(temperature=True), dict(top_p=None), dict(top_k=1.5), dict(top_k=None), dict(top_k="5"), dict(min_p="0.1"),
    dict(presence_penalty=None), dict(frequency_penalty="1"), dict(repetition_penalty=None), dict(seed="7"),
    dict(seed=1.0), dict(stop=5), dict(stop=[1, 2]), dict(stop={"a": 1}), dict(stop=[None]), dict(stop_token_ids=3),
    dict(stop_token_ids="3"), dict(stop_token_ids=[1.0]), dict(stop_token_ids=[None]), dict(stop_token_ids={1: 2}),
    dict(stop_token_ids=[True]), dict(stop_token_ids={1, 2}), dict(logprobs=1.0), dict(logprobs="2"),
    dict(prompt_logprobs=[1]), dict(ignore_eos=1), dict(ignore_eos=None), dict(include_stop_str_in_output="yes"),
    dict(output_kind=0), dict(seed=-(2**63) - 1),
]


@pytest.mark.parametrize("bad", BAD, ids=[repr(b) for b in BAD])
def test_invalid_sampling_params(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):  # the message names the field
        SamplingParams(**bad)


def test_valid_sampling_params_are_normalised_not_converted():
    p = SamplingParams(stop="\n", stop_token_ids=[3, 4], top_k=-1, max_tokens=None, temperature=1, seed=-5)
    assert (p.stop, p.stop_token_ids, p.top_k, p.max_tokens, p.temperature, p.seed) == (("\n",), (3, 4), -1, None, 1.0, -5)
    assert SamplingParams(stop=("a", "b")).stop == ("a", "b")
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.01).greedy


def test_rows_without_a_seed_share_one_draw(monkeypatch):
    """The common case, requests without a seed: one Exp(1) draw for all of their rows (one
    launch), not one per row; each seeded row still draws from its own generator. And the
    shared draw samples the softmax, row by row independently."""
    calls = []
    exponential = torch.Tensor.exponential_
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, *a, **k: calls.append(self.shape) or
                        exponential(self, *a, **k))
    seqs = rows_of(SamplingParams(temperature=1.0), DRAWS)  # no generator: no seed
    seeded = rows_of(SamplingParams(temperature=1.0, seed=1), 2, torch.Generator().manual_seed(1))
    tokens = Sampler()(LOGITS.expand(DRAWS + 2, -1), seqs + seeded, set()).token_ids
    assert len(calls) == 3, f"{len(calls)} draws for {DRAWS} unseeded and 2 seeded rows"
    freq = torch.bincount(torch.tensor(tokens[:DRAWS]), minlength=len(LOGITS)).double() / DRAWS
    torch.testing.assert_close(freq, expected_probs(LOGITS, 1.0, 0, 1.0), atol=0.015, rtol=0)


def test_the_engine_draws_once_per_step_for_requests_without_a_seed(qwen3_model, monkeypatch):
    calls = []
    exponential = torch.Tensor.exponential_
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, *a, **k: calls.append(self.shape) or
                        exponential(self, *a, **k))
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    outputs = LLM(qwen3_model).generate([PROMPT, *OTHERS], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 3 for o in outputs)
    assert len(calls) == 3, f"{len(calls)} draws in 3 steps of 4 unseeded requests"  # one prefill step, two decodes
