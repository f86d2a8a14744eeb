"""Log-probabilities as a request reports them: the chosen token's, and the top k alternatives,
packed on the device so that a whole step's reach the host in one copy (chapter 10).

A token a grammar forbids (chapter 13) has logit -inf, so its logprob is -inf, and JSON has no
-inf: every logprob is floored at LOWEST_LOGPROB here, where they all reach the host (vLLM
floors its responses' logprobs at the same -9999.0)."""
from __future__ import annotations

from typing import NamedTuple

import torch

LOWEST_LOGPROB = -9999.0  # e^-9999 is 0 in any float: the floor changes no probability


class TopLogprobs(NamedTuple):
    """A position's log-probabilities: entry 0 is the token that was chosen (sampled, or the
    prompt's own), the rest the most likely tokens, best first. ranks: 1 = most likely."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """logprobs [R, V] (log_softmax of the raw logits), chosen [R] -> [3, R, 1 + k] float64:
    token ids, log-probabilities (each at least LOWEST_LOGPROB, never -inf) and ranks, the
    chosen token first, then the top k. Packed in one tensor so that it reaches the host in one
    copy (float64 holds the ids exactly)."""
    picked = logprobs.gather(1, chosen[:, None])  # [R, 1]
    rank = (logprobs > picked).sum(dim=-1, keepdim=True) + 1  # how many are strictly more likely, + 1
    values, ids = logprobs.topk(k, dim=-1)  # [R, k]
    ranks = torch.arange(1, k + 1, device=logprobs.device).expand(len(chosen), k)
    floored = torch.cat([picked, values], 1).double().clamp(min=LOWEST_LOGPROB)
    rows = [torch.cat([chosen[:, None], ids], 1), floored, torch.cat([rank, ranks], 1)]
    return torch.stack([r.double() for r in rows])


def unpack_logprobs(packed: list, ks: list[int]) -> list[TopLogprobs]:
    """The host copy of top_logprobs' tensor, one TopLogprobs per row, row r cut to 1 + ks[r]."""
    ids, values, ranks = packed
    return [TopLogprobs([int(t) for t in ids[r][:k + 1]], values[r][:k + 1], [int(x) for x in ranks[r][:k + 1]])
            for r, k in enumerate(ks)]
