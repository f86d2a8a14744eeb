"""One sequence's place in its grammar (chapter 13).

A compiled grammar is shared by every request with the same constraint; where a sequence has
got to is its own: an xgrammar `GrammarMatcher`, a pushdown automaton that has read the
sequence's output tokens so far. From that state it can say which tokens may come next (the
bitmask, bitmask.py), and it moves on with each token the step accepted.

The invariant the engine keeps: **a matcher has accepted exactly its sequence's output tokens.**
It advances when a token is appended, never when a token is (re)computed, so a sequence that is
preempted and recomputed is not advanced twice. Speculative decoding (chapter 12) appends
several tokens in one step, and tries guesses that are then rejected; xgrammar's matchers roll
back, so `advance_matcher` takes a list and never leaves a matcher half-advanced.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from minivllm.structured_outputs.backend import import_xgrammar


def advance_matcher(matcher: Any, token_ids: list[int]) -> bool:
    """Advance one sequence's grammar matcher by the tokens one step accepted for it, in order,
    all or nothing; return whether the matcher is now terminated.

    matcher: an xgrammar GrammarMatcher (matcher.accept_token(t) -> bool moves it on by token t,
    or returns False and leaves it unchanged if the grammar refuses t; matcher.rollback(k) undoes
    the last k tokens it accepted; matcher.is_terminated() is True once it has accepted a stop
    token (EOS), after which it accepts nothing). token_ids: the step's tokens for the sequence,
    one in plain decoding, several with speculative decoding; [] changes nothing.

    Returns matcher.is_terminated() after the tokens: True means the grammar has ended.
    Raises ValueError naming the refused token and its index in token_ids if the grammar refuses
    one (a terminated matcher refuses every token: ask it before accept_token); the tokens this
    call had accepted before it are rolled back first, so on error the matcher is exactly as it
    was before the call (never half-advanced).
    """
    # BEGIN SOLUTION
    for i, token in enumerate(token_ids):
        if matcher.is_terminated() or not matcher.accept_token(token):
            if i:
                matcher.rollback(i)
            raise ValueError(f"the grammar refuses token {token} at index {i} of {token_ids}")
    return matcher.is_terminated()
    # END SOLUTION


class SequenceGrammar:
    """A sequence's grammar: the compiled grammar (a future while it compiles) and, from the
    first step that samples for the sequence, its own matcher."""

    def __init__(self, compiled: Future):
        self.compiled = compiled
        self._matcher: Any = None

    @property
    def ready(self) -> bool:
        """Whether compiling is over (the scheduler admits the sequence only then)."""
        return self.compiled.done()

    @property
    def matcher(self) -> Any:
        if self._matcher is None:
            self._matcher = import_xgrammar().GrammarMatcher(self.compiled.result())
        return self._matcher

    def advance(self, token_ids: list[int]) -> bool:
        """Accept a step's tokens (advance_matcher); True once the grammar has ended."""
        return advance_matcher(self.matcher, token_ids)
