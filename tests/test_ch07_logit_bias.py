"""vLLM's logit_bias, allowed_token_ids and bad_words (issue 49): SamplingParams refuses every
bad value and type and names every bad key; token ids are checked against the vocabulary when a
request is added; bad words are tokenized as vLLM tokenizes them; greedy tokens and logprobs
equal a plain transformers loop that applies the same edits to transformers' own logits; sampled
tokens follow the edited softmax; the edits come before the penalties, as in vLLM. (Speculative
decoding: test_ch12_logit_bias.py; grammars and the logprob floor: test_ch13_logit_bias.py.)"""
from __future__ import annotations

import msgspec
import pytest
import torch
import transformers

from minivllm import LLM, SamplingParams
from minivllm.loader import DEFAULT_MODEL, load_tokenizer
from minivllm.request.bad_words import banned_tokens
from minivllm.request.sequence import Sequence
from minivllm.worker.logit_bias import bias_logits
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


def test_a_row_the_edits_would_empty_keeps_its_logits():
    """A whitelist whose only token a bad word bans leaves nothing: that row samples as if the
    request had no edits (with a grammar, as the grammar alone allows); the other rows are edited."""
    empty = SamplingParams(allowed_token_ids=[2], bad_words=["x"])
    object.__setattr__(empty, "bad_words_token_ids", ((2,),))
    biased = SamplingParams(logit_bias={0: -3.0})
    logits = torch.stack([LOGITS, LOGITS])
    got = bias_logits(logits, [empty, biased], [[], []])
    assert torch.equal(got[0], LOGITS)
    assert got[1, 0] == LOGITS[0] - 3 and torch.equal(got[1, 1:], LOGITS[1:])
