"""From tokens to text while a request runs: incremental detokenization and stop strings
(chapter 10).

A stream of tokens is not a stream of characters. With byte-level BPE one character may take
several tokens (the default model spells "é" in two and "世" in three), and other tokenizers
choose a token's leading space by looking at its neighbours; so decoding each token alone and
gluing the pieces gives wrong text. `IncrementalDetokenizer` decodes a short window of recent
tokens without and with the new ones, and keeps the difference; while that difference ends in
half a character (decoded as U+FFFD) it waits for the next token. The window's text "with"
is the next token's text "without", so it is kept, and a token costs one decode, not two
(the window slides on, with one decode more, every few tokens: a decode's cost grows with it).

Stop strings live in the text, not in the tokens: "\\n\\n" may be one token, or the end of one
and the start of the next. So each step searches the new text *and the last len(stop) - 1
characters before it* (`find_stop_string`, an exercise), cuts the text where the stop string
begins, and ends the request. Until a request finishes it shows its text without those last
len(stop) - 1 characters (`StopChecker.visible`): they might still become the start of a stop
string, and text once shown is never taken back.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token, for its leading space
WINDOW_TOKENS = 8  # the most tokens decoded at once before the window slides on


def find_stop_string(text: str, num_new_chars: int, stop: Sequence[str]) -> tuple[int, str] | None:
    """The stop string that starts earliest among those that end in the last num_new_chars
    characters of `text`, as (index in text where it starts, the stop string); None if none.

    text: the output text so far; its last num_new_chars characters arrived this step, and
    the text before them was searched in earlier steps. stop: non-empty strings; between two
    that start at the same index, the one listed first wins.
    Invariant: a match must end in the new text (one wholly in the old text would have been
    found before), but it may start in the old text, when a stop string spans two tokens: for
    a stop string s the search starts len(s) - 1 characters before the new text, never earlier.
    """
    # BEGIN SOLUTION
    new_start = len(text) - num_new_chars
    found: tuple[int, str] | None = None
    for s in stop:
        at = text.find(s, max(0, new_start - len(s) + 1))
        if at != -1 and (found is None or at < found[0]):
            found = (at, s)
    return found
    # END SOLUTION


def plain_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """tokenizer.decode(ids, skip_special_tokens=True) as a function of the ids, cheaper where
    it can be: for a Rust-backed transformers tokenizer that cleans up no spaces, and whose
    decoding no subclass changes, that is its Rust decoder alone, the same string without the
    Python checks that cost more than decoding a few tokens (this runs once per token of every
    stream). Any other tokenizer is called as it is."""
    if (isinstance(tokenizer, PreTrainedTokenizerFast) and tokenizer.clean_up_tokenization_spaces is False
            and type(tokenizer).decode is PreTrainedTokenizerBase.decode
            and type(tokenizer)._decode is PreTrainedTokenizerFast._decode):
        rust = tokenizer.backend_tokenizer
        return lambda ids: rust.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """A sequence's output text, decoded a few tokens at a time; `text` only ever grows.

    Two offsets into `tokens` (the last few prompt tokens, then the output): text for
    everything before `read` is done; decoding starts at `prefix`, a few tokens earlier, so
    the new tokens are decoded in context. `prefix_text` is tokens[prefix:read] decoded (None:
    not decoded yet).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self._decode = plain_decoder(tokenizer)
        self.tokens = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.tokens)
        self.prefix_text: str | None = None
        self.num_output_tokens = 0  # output tokens taken in so far
        self.text = ""

    def add(self, new_token_ids: list[int], final: bool = False) -> int:
        """Take in the next output tokens; returns how many characters `text` grew by. Text
        that ends in half a character is held back until the rest comes, or until `final`."""
        self.tokens += new_token_ids
        self.num_output_tokens += len(new_token_ids)
        if self.prefix_text is None:
            self.prefix_text = self._decode(self.tokens[self.prefix:self.read])
        after = self._decode(self.tokens[self.prefix:])
        if after.endswith("\ufffd") and not final:
            return 0
        new_text = after[len(self.prefix_text):]
        self.text += new_text
        if len(self.tokens) - self.prefix <= WINDOW_TOKENS:  # the same start: `after` is the next `before`
            self.read, self.prefix_text = len(self.tokens), after
        else:  # slide on: the window starts where this call's new tokens did
            self.prefix, self.read, self.prefix_text = self.read, len(self.tokens), None
        return len(new_text)


class StopChecker:
    """The text side of a request: its detokenizer, its stop strings, and the text it may show.

    stop: the stop strings; include_stop: keep the stop string in the text (the text is then
    cut after it instead of before it).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: Sequence[str], include_stop: bool):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self.stop, self.include_stop = stop, include_stop
        # Characters that may still turn out to begin a stop string: shown only at the end.
        self.hold_back = max(map(len, stop)) - 1 if stop and not include_stop else 0

    @property
    def num_output_tokens(self) -> int:
        return self.detokenizer.num_output_tokens

    def update(self, new_token_ids: list[int], final: bool, search: bool = True) -> str | None:
        """Take in the next output tokens and search the new text for the stop strings (if
        `search`). Returns the stop string found (the text is then cut there), or None."""
        num_new = self.detokenizer.add(new_token_ids, final)
        if not (num_new and search and self.stop):
            return None
        found = find_stop_string(self.detokenizer.text, num_new, self.stop)
        if found is None:
            return None
        start, stop = found
        self.detokenizer.text = self.detokenizer.text[:start + len(stop) if self.include_stop else start]
        return stop

    def visible(self, finished: bool) -> str:
        """The text the request shows now: all of it once finished, else all but hold_back."""
        text = self.detokenizer.text
        return text if finished or not self.hold_back else text[:max(0, len(text) - self.hold_back)]
