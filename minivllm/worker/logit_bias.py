"""What a request does to its own logits (vLLM's allowed_token_ids, bad_words and logit_bias):
the edits the sampler makes before penalties and temperature, and the verifier of chapter 12
makes to the target's rows, so that both sample from the same distribution.

For row r of the logits:
- allowed_token_ids: every other token becomes -inf;
- bad_words: the tokens `request.bad_words.banned_tokens` names after the row's past become -inf;
- logit_bias: bias[t] is added to token t's logit (a -inf stays -inf).
Masking and adding commute, so the order among the three does not matter; what matters is that
all three come before the penalties, as in vLLM (a repetition penalty divides a biased logit).

A row the edits would leave with no token at all (a whitelist disjoint from what the request's
grammar allows at that step, a bad word that is the grammar's only way on) keeps its unedited
logits for that step: there is no token that obeys both, and a token the grammar refuses would
break the output's format (and the grammar's matcher), so the grammar's rule wins.

The per-row work is host lists of (row, token) pairs, sent to the device in one copy (ints) and
one more for the biases: the cost is the size of the lists, not of the vocabulary.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from minivllm.request.bad_words import banned_tokens, longest
from minivllm.request.sampling_params import SamplingParams
from minivllm.worker.prepare import to_device


def recent_output(token_ids: Sequence[int], num_prompt_tokens: int, params: SamplingParams,
                  end: int | None = None) -> list[int]:
    """The output tokens before position `end` of a sequence (None: all of them) that its bad
    words can match: at most the longest word's length - 1, never a prompt token. The `past`
    banned_tokens reads."""
    if not params.bad_words_token_ids:
        return []
    end = len(token_ids) if end is None else end
    keep = longest(params.bad_words_token_ids) - 1
    return list(token_ids[max(num_prompt_tokens, end - keep):end]) if keep else []


def verify_pasts(token_ids: Sequence[int], num_prompt_tokens: int, num_guesses: int,
                 params: SamplingParams) -> list[list[int]]:
    """recent_output for each row of a verify chunk (chapter 12): token_ids ends with the
    num_guesses guesses, row 0 follows the last real token and row j follows guess j, so row j's
    past holds guesses 1..j (the rows after a guess the target rejects are never used)."""
    end = len(token_ids) - num_guesses
    return [recent_output(token_ids, num_prompt_tokens, params, end + j) for j in range(num_guesses + 1)]


def bias_logits(logits: torch.Tensor, params: Sequence[SamplingParams], pasts: Sequence[Sequence[int]]) -> torch.Tensor:
    """logits [R, V] with row r edited as params[r] asks (see the module doc), pasts[r] being
    the output tokens before row r's token (recent_output). A new tensor; logits is not changed."""
    allowed_rows: list[int] = []
    allowed_pairs: list[tuple[int, int]] = []  # (index among allowed_rows, token)
    banned_pairs: list[tuple[int, int]] = []  # (row, token)
    bias_pairs: list[tuple[int, int]] = []
    biases: list[float] = []
    for row, (p, past) in enumerate(zip(params, pasts, strict=True)):
        if p.allowed_token_ids:
            allowed_pairs += [(len(allowed_rows), t) for t in p.allowed_token_ids]
            allowed_rows.append(row)
        if p.bad_words_token_ids:
            banned_pairs += [(row, t) for t in banned_tokens(p.bad_words_token_ids, past)]
        if p.logit_bias:
            bias_pairs += [(row, t) for t in p.logit_bias]
            biases += p.logit_bias.values()
    out = logits.clone()
    if not (allowed_rows or banned_pairs or bias_pairs):
        return out
    flat = to_device(np.array([*allowed_rows, *(x for pair in allowed_pairs + banned_pairs + bias_pairs for x in pair)],
                              dtype=np.int64), out.device)
    rows, allowed, banned, biased = flat.split([len(allowed_rows), 2 * len(allowed_pairs), 2 * len(banned_pairs),
                                                2 * len(bias_pairs)])
    if allowed_rows:
        forbidden = torch.ones(len(allowed_rows), out.shape[-1], dtype=torch.bool, device=out.device)
        allowed = allowed.view(-1, 2)
        forbidden[allowed[:, 0], allowed[:, 1]] = False
        out[rows] = out[rows].masked_fill(forbidden, float("-inf"))
    if banned_pairs:
        banned = banned.view(-1, 2)
        out[banned[:, 0], banned[:, 1]] = float("-inf")
    if bias_pairs:
        biased = biased.view(-1, 2)  # a dict's keys: each (row, token) once, so += adds every bias once
        out[biased[:, 0], biased[:, 1]] += to_device(np.array(biases, dtype=np.float32), out.device).to(out.dtype)
    nothing_left = out.amax(dim=-1, keepdim=True) == float("-inf")  # on the device: the host does not wait
    return torch.where(nothing_left, logits, out)
