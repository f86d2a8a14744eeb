"""Chapter 12 with vLLM's logit_bias, allowed_token_ids and bad_words (issue 49): the verifier
edits each of a request's verify rows as the sampler edits that position's row (bad words after
the guesses before it), so speculation gives plain decoding's greedy tokens and samples from the
edited distribution, while the draft guesses knowing nothing of the edits."""
from __future__ import annotations

import pytest
import torch
import transformers

from minivllm import LLM, LLMEngine, SamplingParams, load_model
from minivllm.core.spec_decode.rejection import target_probs
from minivllm.loader import DEFAULT_MODEL
from minivllm.worker.logit_bias import verify_pasts

pytestmark = [pytest.mark.ch12, pytest.mark.floors]

ENGINE = {"num_kv_blocks": 128, "max_num_seqs": 8}
LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.3, 0.0, -0.5, -1.0])


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**ENGINE)


def test_verify_rows_see_the_guesses_before_them():
    params = SamplingParams(bad_words=["x"])
    object.__setattr__(params, "bad_words_token_ids", ((1, 2, 3),))
    tokens = [40, 41, 42, 7, 1, 2, 8]  # prompt of 3, output [7], then guesses [1, 2, 8]
    assert verify_pasts(tokens, 3, 3, params) == [[7], [7, 1], [1, 2], [2, 8]]  # only 2 tokens ever matter


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


def tiny_pair(vocab: int) -> tuple[transformers.PreTrainedModel, object, object]:
    """A target (also as transformers) and an unlike draft, over `vocab` tokens."""
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


@pytest.mark.slow
def test_speculation_samples_from_the_edited_distribution(monkeypatch):
    """2,000 seeded requests, an unlike draft that knows nothing of the edits: the second and
    third output tokens (verified guesses or their replacements) have the joint distribution of
    transformers' edited logits, within 5 standard errors in every cell; a verifier that forgets
    the edits fails the same check."""
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
