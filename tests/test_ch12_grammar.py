"""Chapter 12 with chapter 13: a draft model guesses as the grammar allows.

The draft's rows are masked by the request's grammar after the guesses before them, so every
guess it proposes is one the grammar accepts, and its matcher is back at the request's output
tokens after each proposal. Greedy tokens equal the non-speculative constrained engine's, every
finished sampled output fits its constraint, with verify and draft steps replayed from graphs
(EagerGraph on a CPU).
"""
from __future__ import annotations

import pytest
from test_ch12_graphs import Replays, graphed
from test_ch13_structured_outputs import CASES, PROMPTS, fits

from minivllm import DRAFT_MODEL, LLM, SamplingParams, load_model, load_tokenizer

pytestmark = [pytest.mark.ch13, pytest.mark.floors]  # chapter 13 under chapter 12: its checks need chapter 13's exercises

pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def draft(default_model):
    return load_model(DRAFT_MODEL, device="cpu")


def checked_proposals(llm: LLM) -> list[int]:
    """Wrap the draft's propose: every guess for a constrained request must be accepted by its
    grammar in order, and its matcher must be back at its output tokens afterwards. Returns the
    list the wrapper appends the number of guesses it checked to."""
    proposer, checked = llm.engine.core.speculator.proposer, []
    propose = proposer.propose

    def wrapped(targets, limits):
        before = {t: t.grammar.matcher.is_terminated() for t in targets if t.grammar is not None}
        guesses, dists = propose(targets, limits)
        for target, tokens in zip(targets, guesses):
            if target.grammar is None or not tokens:
                continue
            matcher = target.grammar.matcher
            assert matcher.is_terminated() == before[target], "the matcher was left moved on"
            for i, token in enumerate(tokens):
                assert matcher.accept_token(token), f"guess {i} ({token}) breaks the grammar: {tokens}"
            matcher.rollback(len(tokens))
            checked.append(len(tokens))
        return guesses, dists

    proposer.propose = wrapped
    return checked


@pytest.mark.parametrize("kind, spec, constraint", CASES, ids=["json", "regex", "choice", "grammar"])
def test_draft_guesses_follow_the_grammar(default_model, draft, tokenizer, kind, spec, constraint):
    prompt = tokenizer.encode(PROMPTS[0])
    plain = LLM(default_model, tokenizer=tokenizer)
    greedy = SamplingParams(temperature=0, max_tokens=64, structured_outputs=constraint)
    expected = plain.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    llm = LLM(default_model, tokenizer=tokenizer, max_num_seqs=4,
              speculative_config={"model": draft, "num_speculative_tokens": 4})
    graphed(llm.engine)
    replays = Replays(llm.engine.core.runner)
    checked = checked_proposals(llm)
    got = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    assert (got.token_ids, got.finish_reason) == (expected.token_ids, expected.finish_reason)
    sampled = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=64, structured_outputs=constraint)
    for completion in llm.generate(prompt, sampled, use_tqdm=False)[0].outputs:
        assert completion.finish_reason == "length" or fits(constraint, completion.text), completion.text
    assert sum(checked) > 0, "the draft guessed nothing under the grammar"
    assert replays.of_query_len(5) > 0
