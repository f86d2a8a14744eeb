"""vLLM's logit_bias, allowed_token_ids and bad_words (issue 49): SamplingParams refuses every
bad value and type and names every bad key; token ids are checked against the vocabulary when a
request is added; bad words are tokenized as vLLM tokenizes them; greedy tokens and logprobs
equal a plain transformers loop that applies the same edits to transformers' own logits; sampled
tokens follow the edited softmax; the edits come before the penalties, as in vLLM; and under
speculative decoding the verifier samples from the same edited distribution."""
from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch
import transformers

from minivllm import LLM, SamplingParams
from minivllm.core.spec_decode.rejection import target_probs
from minivllm.loader import DEFAULT_MODEL, load_tokenizer
from minivllm.request.bad_words import banned_tokens
from minivllm.request.sequence import Sequence
from minivllm.worker.logit_bias import verify_pasts
from minivllm.worker.sampler import Sampler

pytestmark = [pytest.mark.ch07, pytest.mark.floors]

PROMPT = "def add(a, b):"
ENGINE = {"num_kv_blocks": 128, "max_num_seqs": 8}
STEPS = 16


# ---------------------------------------------------------------------------------------------
# SamplingParams: values, types, the vocabulary
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    ({"logit_bias": {"5": 1.0}}, r"keys must be token ids.*\['5'\]"),
    ({"logit_bias": {-1: 1.0, 3: 1.0, True: 2.0}}, r"these are not: \[-1, True\]"),
    ({"logit_bias": {5: 100.5, 6: float("nan"), 7: "1", 8: 1.0}}, r"\[-100, 100\].*5: 100.5, 6: nan, 7: '1'"),
    ({"logit_bias": [(5, 1.0)]}, "must be a dict"),
    ({"allowed_token_ids": []}, "empty"),
    ({"allowed_token_ids": [1, -2, "3", 2.0, False]}, r"these are not: \[-2, '3', 2.0, False\]"),
    ({"allowed_token_ids": 5}, "must be a list"),
    ({"bad_words": "hello"}, "must be a list"),
    ({"bad_words": ["ok", ""]}, r"bad_words\[1\] must be a non-empty string"),
    ({"bad_words": [3]}, r"bad_words\[0\] must be a non-empty string"),
])
def test_bad_values_and_types_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_ids_outside_the_vocabulary_are_all_named(llm):
    tokenizer = load_tokenizer()
    params = SamplingParams(logit_bias={4096: 1.0, 3: 1.0, 5000: -1.0}, allowed_token_ids=[1, 9999])
    with pytest.raises(ValueError, match=r"\[4096, 5000\] in logit_bias; \[9999\] in allowed_token_ids"):
        params.for_model(tokenizer, 4096)
    assert SamplingParams(logit_bias={4095: 1.0}).for_model(tokenizer, 4096).logit_bias == {4095: 1.0}
    with pytest.raises(ValueError, match="bad_words need the model's tokenizer"):
        SamplingParams(bad_words=["x"]).for_model(None, 4096)
    with pytest.raises(ValueError, match="no token at all"):
        SamplingParams(bad_words=["   "]).for_model(tokenizer, 4096)
    with pytest.raises(ValueError, match=r"\[4096\] in logit_bias"):
        llm.generate(PROMPT, SamplingParams(logit_bias={4096: 1.0}), use_tqdm=False)


def vllm_spellings(word: str, tokenizer) -> list[list[int]]:
    """vLLM's rule, spelled out: the bare word, and the spaced word when it is as long and
    starts with another token."""
    bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
    spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
    return [bare] + ([spaced] if spaced[0] != bare[0] and len(spaced) == len(bare) else [])


@pytest.mark.parametrize("words", [["return"], ["the value", "  Return"], ["hello world", "x"]])
def test_bad_words_are_tokenized_as_vllm_does_and_cross_to_the_core(words):
    tokenizer = load_tokenizer()
    params = SamplingParams(bad_words=words).for_model(tokenizer, 4096)
    want = [tuple(ids) for word in words for ids in vllm_spellings(word, tokenizer)]
    assert list(params.bad_words_token_ids) == want
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params


@pytest.mark.parametrize("past, banned", [
    ([], [9]),  # a one-token word is banned everywhere; [1, 2, 3] needs [1, 2] first
    ([5, 1], [9]),  # [1] is not [1, 2]
    ([1, 2], [9, 3]),  # the output ends with [1, 2]: 3 would complete [1, 2, 3]
    ([7, 1, 2], [9, 3]),
    ([1, 2, 4], [9]),
])
def test_a_word_bans_its_last_token_only_after_the_rest_of_it(past, banned):
    assert banned_tokens([(9,), (1, 2, 3)], past) == banned


def test_verify_rows_see_the_guesses_before_them():
    params = SamplingParams(bad_words=["x"])
    object.__setattr__(params, "bad_words_token_ids", ((1, 2, 3),))
    tokens = [40, 41, 42, 7, 1, 2, 8]  # prompt of 3, output [7], then guesses [1, 2, 8]
    assert verify_pasts(tokens, 3, 3, params) == [[7], [7, 1], [1, 2], [2, 8]]  # only 2 tokens ever matter


# ---------------------------------------------------------------------------------------------
# Exact against transformers
# ---------------------------------------------------------------------------------------------


def reference(prompt: list[int], steps: int, bias: dict[int, float] | None = None, allowed: list[int] | None = None,
              bad: list[list[int]] | None = None) -> tuple[list[int], list[float]]:
    """transformers' logits, edited here token by token: the greedy tokens and their logprobs
    (of the unedited logits, vLLM's default)."""
    model = hf_model()
    tokens, logprobs = [], []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].double()
        edited = logits.clone()
        for token, b in (bias or {}).items():
            edited[token] += b
        if allowed is not None:
            keep = torch.full_like(edited, float("-inf"))
            keep[allowed] = 0
            edited += keep
        for word in bad or []:
            if len(word) == 1 or tokens[-(len(word) - 1):] == word[:-1]:
                edited[word[-1]] = float("-inf")
        token = int(edited.argmax())
        tokens.append(token)
        logprobs.append(float(logits.log_softmax(-1)[token]))
    return tokens, logprobs


_HF: list = []


def hf_model() -> transformers.PreTrainedModel:
    if not _HF:
        _HF.append(transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval())
    return _HF[0]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**ENGINE)


def generate(llm: LLM, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=2, **kwargs)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]


def check_equal(out, tokens: list[int], logprobs: list[float]) -> None:
    assert out.token_ids == tokens
    got = [entry[t].logprob for entry, t in zip(out.logprobs, out.token_ids)]
    assert got == pytest.approx(logprobs, abs=1e-4)


def test_logit_bias_equals_transformers(llm):
    prompt = llm.get_tokenizer().encode(PROMPT)
    plain = reference(prompt, STEPS)[0]
    bias = {plain[0]: -100.0, plain[3]: -2.5, 42: 7.0, 300: 3.0}  # changes the first token, and more
    tokens, logprobs = reference(prompt, STEPS, bias=bias)
    assert tokens != plain
    check_equal(generate(llm, logit_bias=bias), tokens, logprobs)


def test_allowed_token_ids_equal_transformers(llm):
    prompt = llm.get_tokenizer().encode(PROMPT)
    allowed = [10, 20, 30, 266, 383, 500, 972]
    tokens, logprobs = reference(prompt, STEPS, allowed=allowed)
    assert set(tokens) <= set(allowed) and len(set(tokens)) > 1
    check_equal(generate(llm, allowed_token_ids=allowed), tokens, logprobs)


def test_bad_words_equal_transformers(llm):
    """'the value' is two tokens: ' value' is banned only right after 'the'; the plain output
    says 'the value' and the edited one never does."""
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode(PROMPT)
    plain = reference(prompt, STEPS)[0]
    word = [tuple(w) for w in vllm_spellings("the value", tokenizer)]
    assert any(tuple(plain[i:i + 2]) in word for i in range(len(plain) - 1)), tokenizer.decode(plain)
    tokens, logprobs = reference(prompt, STEPS, bad=[list(w) for w in word])
    assert not any(tuple(tokens[i:i + 2]) in word for i in range(len(tokens) - 1))
    check_equal(generate(llm, bad_words=["the value"]), tokens, logprobs)


def test_all_three_together_equal_transformers(llm):
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode(PROMPT)
    bias, allowed = {266: 1.5, 383: -0.5}, [10, 266, 267, 294, 383, 500, 972, 1183]
    bad = [list(w) for w in vllm_spellings("Return", tokenizer)]
    tokens, logprobs = reference(prompt, STEPS, bias=bias, allowed=allowed, bad=bad)
    assert tokens != reference(prompt, STEPS, bias=bias, allowed=allowed)[0]  # the bad word matters too
    check_equal(generate(llm, logit_bias=bias, allowed_token_ids=allowed, bad_words=["Return"]), tokens, logprobs)


# ---------------------------------------------------------------------------------------------
# The sampler: sampled rows, and the edits before the penalties
# ---------------------------------------------------------------------------------------------

LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.3, 0.0, -0.5, -1.0])


def test_sampled_tokens_follow_the_edited_softmax():
    bias, allowed, draws = {0: -2.0, 5: 3.0}, [0, 1, 2, 5, 6], 20_000
    params = SamplingParams(temperature=0.8, logit_bias=bias, allowed_token_ids=allowed)
    seqs = [Sequence(str(i), [3], params, max_model_len=100) for i in range(draws)]
    generator = torch.Generator().manual_seed(0)
    for seq in seqs:
        seq.generator = generator
    tokens = Sampler()(LOGITS.expand(draws, -1), seqs, set()).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).double() / draws
    edited = LOGITS.double().clone()
    for token, b in bias.items():
        edited[token] += b
    banned = [t for t in range(len(LOGITS)) if t not in allowed]
    edited[banned] = float("-inf")
    want = (edited / 0.8).softmax(-1)
    assert freq[banned].sum() == 0
    assert (freq - want).abs().max() < 4 * (0.25 / draws) ** 0.5


def test_the_bias_comes_before_the_repetition_penalty():
    """vLLM's order: (2 - 1) / 2 = 0.5 beats 0.3; the other order, 2 / 2 - 1 = 0, would not."""
    params = SamplingParams(temperature=0, logit_bias={1: -1.0}, repetition_penalty=2.0)
    seq = Sequence("a", [1], params, max_model_len=100)  # token 1 is in the prompt
    assert Sampler()(torch.tensor([[0.3, 2.0, -5.0]]), [seq], set()).token_ids == [1]


def test_target_probs_are_the_edited_softmax():
    """What the verifier of chapter 12 samples from: the edits of this request at each row."""
    params = SamplingParams(temperature=0.7, logit_bias={2: 1.0}, allowed_token_ids=[0, 1, 2, 3, 4])
    object.__setattr__(params, "bad_words_token_ids", ((6, 1),))
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    got = target_probs(logits, params, [[5], [6]])  # row 1 follows a 6: 1 is banned there
    edited = logits.double().clone()
    edited[:, 2] += 1.0
    edited[:, 5:] = float("-inf")
    edited[1, 1] = float("-inf")
    assert torch.allclose(got.double(), (edited / 0.7).softmax(-1), atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Speculative decoding: the verifier sees the same edited distribution
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3},
                                  {"model": str(DEFAULT_MODEL), "num_speculative_tokens": 3}])
def test_speculation_gives_the_same_greedy_tokens(llm, spec):
    """The draft guesses without the edits, the target verifies with them: rejected guesses,
    and the tokens plain decoding gives."""
    speculating = LLM(speculative_config=spec, **ENGINE)
    tokenizer = llm.get_tokenizer()
    prompt = "x = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2"
    three, one = tokenizer.encode(" 3 1", add_special_tokens=False)  # plain decoding repeats ", 3"
    cases = [{"logit_bias": {three: -100.0, one: 2.0}}, {"bad_words": ["3, 3"]},
             {"allowed_token_ids": [12, 14, one, 1213]}]
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for kwargs in cases:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1, **kwargs)
        want = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert want.token_ids != plain[0].outputs[0].token_ids, kwargs  # the edit matters
        got = speculating.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids, (kwargs, tokenizer.decode(got.token_ids), tokenizer.decode(want.token_ids))
        assert [e[t].logprob for e, t in zip(got.logprobs, got.token_ids)] == pytest.approx(
            [e[t].logprob for e, t in zip(want.logprobs, want.token_ids)], abs=1e-4)
    stats = speculating.engine.core.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # guesses were made, some refused


@pytest.mark.ch16
def test_bad_words_under_async_scheduling(llm):
    """Async scheduling plans step N+1 before step N's token is known; a multi-token bad word
    needs that token, so while a request has bad words the steps run one after the other."""
    overlapping = LLM(async_scheduling=True, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, bad_words=["the value"])
    want = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    assert overlapping.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids == want


@pytest.mark.ch15
@pytest.mark.slow
def test_the_edits_cross_to_a_core_process(llm):
    """The frontend tokenizes bad_words; the token ids travel to the core process with the rest
    of the params, and the core process samples what the in-thread core samples."""
    from minivllm import LLMEngine

    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, bad_words=["the value"],
                            logit_bias={4000: 0.5}, allowed_token_ids=list(range(4096)))
    want = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    without = dataclasses.replace(params, bad_words=None)
    assert llm.generate(PROMPT, without, use_tqdm=False)[0].outputs[0].token_ids != want  # the words matter
    engine = LLMEngine(multiprocess=True, **ENGINE)
    try:
        engine.add_request(request_id="r", prompt=PROMPT, params=params)
        got = None
        for _ in range(10 * STEPS):
            for out in engine.step():
                if out.finished:
                    got = out.outputs[0].token_ids
            if got is not None:
                break
    finally:
        engine.shutdown()
    assert got == want


def tiny_pair(vocab: int) -> tuple[transformers.PreTrainedModel, object, object]:
    """A target (also as transformers) and an unlike draft, over `vocab` tokens."""
    from minivllm import load_model

    config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=64, initializer_range=0.3, eos_token_id=None,
                                      bos_token_id=None, tie_word_embeddings=False)
    models = []
    for seed in (0, 99):
        torch.manual_seed(seed)
        models.append(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())
    return models[0], load_model(models[0], device="cpu"), load_model(models[1], device="cpu")


def edited_pairs_exact(hf_model, prompt: list[int], vocab: int, temperature: float, bias: dict[int, float],
                       allowed: list[int]) -> torch.Tensor:
    """P(second output token = a, third = b) when every step samples from transformers' logits
    edited by the bias and the whitelist."""
    def probs(tokens):
        with torch.no_grad():
            logits = hf_model(torch.tensor([tokens])).logits[0, -1].double()
        for token, b in bias.items():
            logits[token] += b
        logits[[t for t in range(vocab) if t not in allowed]] = float("-inf")
        return (logits / temperature).softmax(-1)
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    first = probs(prompt)
    for t0 in range(vocab):
        second = probs(prompt + [t0])
        for t1 in range(vocab):
            joint[t1] += first[t0] * second[t1] * probs(prompt + [t0, t1])
    return joint


@pytest.mark.ch12
@pytest.mark.slow
def test_speculation_samples_from_the_edited_distribution(monkeypatch):
    """2,000 seeded requests, an unlike draft that knows nothing of the edits: the second and
    third output tokens (verified guesses or their replacements) have the joint distribution of
    transformers' edited logits, within 5 standard errors in every cell; a verifier that forgets
    the edits fails the same check."""
    from minivllm import LLMEngine

    vocab, temperature, n, prompt = 6, 1.0, 2000, [1, 4, 2, 5]
    bias, allowed = {2: 1.5, 4: -1.0, 0: 0.5}, [0, 1, 2, 4, 5]
    hf_target, target, draft = tiny_pair(vocab)
    exact = edited_pairs_exact(hf_target, prompt, vocab, temperature, bias, allowed)
    tolerance = 5 * (exact * (1 - exact) / n).sqrt() + 1e-3

    def sampled() -> torch.Tensor:
        spec = {"model": draft, "num_speculative_tokens": 2, "disable_by_batch_size": None}
        engine = LLMEngine(target, speculative_config=spec, max_num_seqs=256, num_kv_blocks=2048,
                           enable_prefix_caching=False)
        for i in range(n):
            engine.add_request(prompt=prompt, params=SamplingParams(
                max_tokens=4, temperature=temperature, seed=i, ignore_eos=True, logit_bias=bias,
                allowed_token_ids=allowed))
        counts = torch.zeros(vocab, vocab, dtype=torch.float64)
        for _ in range(10 * n):
            for out in engine.step():
                if out.finished:
                    counts[out.outputs[0].token_ids[1], out.outputs[0].token_ids[2]] += 1
            if not engine.has_unfinished_requests():
                break
        assert engine.core.speculator.stats.num_draft_tokens > n, "the second and third tokens were meant to be guessed"
        return counts / n

    assert ((sampled() - exact).abs() <= tolerance).all()
    monkeypatch.setattr("minivllm.core.spec_decode.rejection.bias_logits", lambda logits, params, pasts: logits)
    assert ((sampled() - exact).abs() > tolerance).any(), "the check cannot tell a verifier without the edits"
