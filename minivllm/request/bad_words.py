"""Bad words (vLLM's `bad_words`): text that must never appear in a request's output, as rules
on token ids.

A word is text and the sampler sees token ids, so each word becomes the token sequences that
spell it, once, when the request is added (`tokenize_bad_words`). Then, before every token is
sampled, a sequence w_1..w_m bans its last token w_m exactly when the output so far ends with
w_1..w_(m-1) (`banned_tokens`): a one-token word is banned everywhere, a longer word only where
its beginning has just been written. The output is what the request generated, not its prompt
(vLLM's rule): a word whose first tokens end the prompt is not banned at the first step.

Why two spellings. Tokenizers of the GPT-2 / Llama family fold a word's leading space into its
first token ("Ġhello" is not "hello"), so the same word is a different sequence at the start of
a text and after a space. vLLM tokenizes every word both ways and keeps the spaced form only
when it is as long as the bare one and starts with another token (otherwise the two spellings
would not line up token for token); minivllm keeps exactly the same sequences.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def tokenize_bad_words(words: Sequence[str], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """Each word's token sequences, in vLLM's way: the word without leading whitespace, then
    (under the condition in the module doc) the same with one leading space; no special tokens.
    ValueError for a word that is no token at all (say, only whitespace)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            raise ValueError(f"bad_words entry {word!r} is no token at all: each word must tokenize to at least one token")
        sequences.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return tuple(sequences)


def longest(bad_words_token_ids: Sequence[Sequence[int]]) -> int:
    """The most tokens any bad word has: banned_tokens reads at most this many - 1 past tokens."""
    return max((len(word) for word in bad_words_token_ids), default=0)


def banned_tokens(bad_words_token_ids: Sequence[Sequence[int]], past: Sequence[int]) -> list[int]:
    """The tokens that may not come next after the output tokens `past` (only its last
    longest() - 1 tokens matter): the last token of every bad word whose other tokens end `past`."""
    banned = []
    for word in bad_words_token_ids:
        before = len(word) - 1
        if before <= len(past) and list(past[len(past) - before:]) == list(word[:-1]):
            banned.append(word[-1])
    return banned
