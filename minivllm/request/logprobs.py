"""Log-probabilities as a request reports them: the chosen token's, and the top k alternatives
(or, with vLLM's logprob_token_ids, the tokens the request listed), packed on the device so that
a whole step's reach the host in one copy (chapter 10).

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


def listed_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, listed: torch.Tensor) -> torch.Tensor:
    """logprobs [R, V], chosen [R], listed [R, n] token ids -> [3, R, 1 + n] float64, packed as
    top_logprobs' tensor: the chosen token first, then the listed tokens in their order, each
    with its logprob (floored) and its true rank, however unlikely it is. The ranks come from
    one sort per row (count of logprobs strictly above a value = V - its place among the sorted
    ones), not from comparing every listed token with the whole row, which would cost n x V."""
    columns = torch.cat([chosen[:, None], listed], 1)  # [R, 1 + n]
    values = logprobs.gather(1, columns)
    ascending = logprobs.sort(dim=-1).values
    ranks = logprobs.shape[-1] - torch.searchsorted(ascending, values.contiguous(), right=True) + 1
    return torch.stack([columns.double(), values.double().clamp(min=LOWEST_LOGPROB), ranks.double()])


def report_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, wanted: list[int | tuple[int, ...]]
                    ) -> list[TopLogprobs]:
    """Each row's report: logprobs [R, V] (log_softmax of the raw logits), chosen [R], wanted[r]
    a row's `SamplingParams.logprob_columns`: k (the top k alternatives) or a tuple of token ids
    (logprob_token_ids). Rows of one kind share one packed tensor and one copy to the host (the
    lists padded to the longest with token 0, cut off again when unpacked)."""
    reports: list[TopLogprobs | None] = [None] * len(wanted)
    top_rows = [r for r, w in enumerate(wanted) if isinstance(w, int)]
    listed_rows = [r for r, w in enumerate(wanted) if not isinstance(w, int)]
    for rows in (top_rows, listed_rows):
        if not rows:
            continue
        every_row = len(rows) == len(wanted)  # the common case: no row to pick out
        pick = torch.tensor(rows, device=logprobs.device)
        lp, ch = (logprobs, chosen) if every_row else (logprobs[pick], chosen[pick])
        if rows is top_rows:
            ks = [wanted[r] for r in rows]
            packed = top_logprobs(lp, ch, max(ks))
        else:
            ks = [len(wanted[r]) for r in rows]
            padded = [list(wanted[r]) + [0] * (max(ks) - len(wanted[r])) for r in rows]
            packed = listed_logprobs(lp, ch, torch.tensor(padded, device=logprobs.device))
        for r, report in zip(rows, unpack_logprobs(packed.tolist(), ks)):  # the one copy to the host
            reports[r] = report
    return reports
