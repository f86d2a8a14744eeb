"""Prompt lookup: guesses from the sequence's own past, no model at all (chapter 12).

Text repeats itself: code calls the names it defined, edits echo the file they edit, an answer
quotes its question. So if the last few tokens of a sequence already occurred earlier, a good
guess for what comes next is whatever followed them then. Looking that up costs a scan of the
token list on the host, nothing on the device; when the guess is wrong, the target model's
verification simply rejects it.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

from minivllm.config.speculative import SpeculativeConfig
from minivllm.request.sequence import Sequence


def propose_ngram(token_ids: Seq[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k guesses for the tokens after token_ids, by prompt lookup.

    For n from max_n down to min_n: the pattern is the last n tokens; find its most recent
    earlier occurrence, an i with i + n < len(token_ids) and token_ids[i:i+n] == pattern (the
    suffix itself, at i = len - n, does not count); the guesses are the tokens that followed it,
    token_ids[i+n : i+n+k] (fewer than k if the sequence ends sooner). The first n that finds an
    occurrence decides. Returns [] when no n in [min_n, max_n] finds one, or when the sequence
    has at most n tokens for every n tried.

    token_ids: a sequence's tokens (prompt and output); k >= 1; 1 <= min_n <= max_n. Reads only:
    token_ids is not changed. Invariant: every guess is a token of token_ids."""
    # BEGIN SOLUTION
    tokens = list(token_ids)
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        pattern = tokens[length - n:]
        for i in range(length - n - 1, -1, -1):  # most recent first; range is empty when length <= n
            if tokens[i:i + n] == pattern:
                return tokens[i + n:i + n + k]
    return []
    # END SOLUTION


class NgramProposer:
    """Proposes by prompt lookup, for every sequence independently (no state between steps)."""

    def __init__(self, config: SpeculativeConfig):
        self.k, self.min_n, self.max_n = config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, seqs: list[Sequence], limits: list[int]) -> tuple[list[list[int]], None]:
        """Guesses for each sequence, at most limits[i] of them. No draft probabilities: a
        lookup is a certainty, so the rejection sampler treats each guess as drawn with q = 1."""
        return [propose_ngram(seq.token_ids, min(self.k, limit), self.min_n, self.max_n) if limit > 0 else []
                for seq, limit in zip(seqs, limits)], None

    def forget(self, seq: object) -> None:
        """Nothing is kept per sequence."""
