"""Repetition, frequency and presence penalties (chapter 10): the formula, and the per-sequence
token counts it needs, kept on the device from step to step."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from minivllm.worker.prepare import to_device

if TYPE_CHECKING:  # only for type hints: sequence.py imports the sampling params, not this module
    from minivllm.request.sequence import Sequence


def apply_penalties(
    logits: torch.Tensor, in_prompt: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
    frequency: torch.Tensor, repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM's (and transformers') penalties. logits: [S, V]; in_prompt: [S, V] bool, the
    tokens of each row's prompt; counts: [S, V], how often each token is in its output so far;
    presence, frequency, repetition: [S].

    Repetition (CTRL's): a token seen in the prompt or the output has its logit divided by the
    penalty if positive, multiplied if negative (either way less likely for a penalty > 1).
    Frequency and presence (OpenAI's): subtract frequency x count and presence x (count > 0).
    """
    seen = in_prompt | (counts > 0)
    r = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


class PenaltyCounts:
    """For each penalised sequence of the last step: the tokens of its prompt ([V] bool) and
    how often each token appears in its output ([V] int), on the device, one row each.

    Counting a sequence's tokens from its lists costs its length; doing it every step would
    make a step's cost grow with every token of the batch. So a sequence is counted from its
    lists once, when it joins the penalised rows, and afterwards each step adds the tokens it
    sampled with one scatter for the whole batch. A sequence that misses a step (preempted,
    out of budget) leaves the table and is counted afresh when it comes back.
    """

    def __init__(self) -> None:
        self.row_of: dict[Sequence, int] = {}
        self.in_prompt: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def gather(self, seqs: list[Sequence], vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(in_prompt, counts) [len(seqs), V] for these sequences, in this order."""
        old = [self.row_of.get(seq, -1) for seq in seqs]
        # Index pairs (row, token) of the newcomers' prompt and output tokens, all in one buffer.
        prompt_rows: list[int] = []
        prompt_ids: list[int] = []
        output_rows: list[int] = []
        output_ids: list[int] = []
        for row, (seq, j) in enumerate(zip(seqs, old)):
            if j < 0:
                prompt_rows += [row] * seq.num_prompt_tokens
                prompt_ids += seq.prompt_token_ids
                output_rows += [row] * seq.num_output_tokens
                output_ids += seq.output_token_ids
        # One pinned, non-blocking copy of every index (the host does not wait for the GPU).
        flat = to_device(np.array(old + prompt_rows + prompt_ids + output_rows + output_ids, dtype=np.int64), device)
        old_rows, p_rows, p_ids, o_rows, o_ids = flat.split(
            [len(old), len(prompt_rows), len(prompt_ids), len(output_rows), len(output_ids)])
        if self.counts is None:
            in_prompt = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=device)
            counts = torch.zeros(len(seqs), vocab, dtype=torch.int32, device=device)
        else:  # the returning rows from the table, zeros for the newcomers
            known = (old_rows >= 0)[:, None]
            in_prompt = self.in_prompt[old_rows.clamp(min=0)] & known
            counts = self.counts[old_rows.clamp(min=0)] * known
        in_prompt[p_rows, p_ids] = True
        counts.index_put_((o_rows, o_ids), torch.ones_like(o_ids, dtype=torch.int32), accumulate=True)
        self.row_of = {seq: row for row, seq in enumerate(seqs)}
        self.in_prompt, self.counts = in_prompt, counts
        return in_prompt, counts

    def add(self, tokens: torch.Tensor) -> None:
        """Count the tokens the last gathered rows sampled (tokens [rows], on the device)."""
        rows = torch.arange(len(tokens), device=tokens.device)
        self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    def clear(self) -> None:
        self.row_of, self.in_prompt, self.counts = {}, None, None
