"""Chapter 5 — chunked prefill: long prompts in pieces, under a per-step token budget.

Chapter 4 prefills every prompt of a batch whole, in one step: a 4k-token prompt makes a
[4k, 4k] score matrix per head, and no request gets its first token before the longest prompt
of the batch is through. Here a prompt goes in
chunks of at most `chunk_size` tokens. A chunk attends to its sequence's cache (the chunks
before it) and causally within itself: chunk_mask(q_len, past), a causal mask shifted right
by `past`. That is the only change to attention: a segment of chapter 4 may now have both
past > 0 and several queries, so we reuse RaggedAttention and override its mask.

Each step also has a token budget, `max_num_batched_tokens`: decode tokens of the running
sequences go first (one each: they are the ones a user is waiting on), then prefill chunks of
as many sequences as fit. A chunk that stops mid-prompt samples nothing; the chunk that
completes a prompt samples its first output token.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from minivllm.attention.masks import chunk_mask
from minivllm.model import Decoder
from minivllm.stages.common import StageStats, prepare
from minivllm.stages.ragged_batch import RaggedAttention, Segment, Step, new_sequence, record_step, run_step


class ChunkedAttention(RaggedAttention):
    """Chapter 4's per-segment attention, with segments that may start mid-prompt."""

    def mask(self, segment: Segment) -> torch.Tensor:
        # [n, past + n]. It covers chapter 4's cases too: a whole prompt is chunk_mask(n, 0),
        # the causal mask, and a decode token is chunk_mask(1, past), a row of ones.
        return chunk_mask(segment.num_new, segment.past, segment.cache.k.device)


def plan_step(prompt_left: list[int], chunk_size: int, budget: int) -> list[tuple[int, int]]:
    """Which tokens of which live sequence run this step, as (index into prompt_left, count).

    prompt_left[i]: prompt tokens sequence i has not prefilled yet; 0 means it is decoding and
    runs exactly one token. Decodes come first, in order, one budget token each; then prefill
    chunks, in order, each at most chunk_size and at most what is left of the budget."""
    # BEGIN SOLUTION
    plan, left = [], budget
    for i, n in enumerate(prompt_left):
        if n == 0 and left > 0:
            plan.append((i, 1))
            left -= 1
    for i, n in enumerate(prompt_left):
        if n > 0 and left > 0:
            take = min(n, chunk_size, left)
            plan.append((i, take))
            left -= take
    return plan
    # END SOLUTION


@torch.inference_mode()
def steps(
    model: Decoder, prompts: list[list[int]], lengths: list[int], batch_size: int = 8, chunk_size: int = 64,
    max_num_batched_tokens: int = 256, stats: StageStats | None = None,
) -> Iterator[Step]:
    """Run the requests `batch_size` at a time, one `Step` per forward pass (as chapter 4's
    `steps`, with each step planned under the budget)."""
    if batch_size < 1 or chunk_size < 1 or max_num_batched_tokens < 1:
        raise ValueError(f"batch_size, chunk_size and max_num_batched_tokens must be >= 1, got "
                         f"{batch_size}, {chunk_size}, {max_num_batched_tokens}")
    todo = [i for i, n in enumerate(lengths) if n > 0]  # a request for 0 tokens needs no forward pass
    for first in range(0, len(todo), batch_size):
        live = [new_sequence(model, i, prompts[i], lengths[i]) for i in todo[first:first + batch_size]]
        while live:
            prompt_left = [max(0, s.prompt_len - s.cache.length) for s in live]
            plan = plan_step(prompt_left, chunk_size, max_num_batched_tokens)
            running, num_new = [live[i] for i, _ in plan], [n for _, n in plan]
            step = Step(plan=[(s.request, s.cache.length, n) for s, n in zip(running, num_new)])
            last_hidden = run_step(model, running, num_new, ChunkedAttention)
            # Only a sequence whose cache caught up with its tokens has a next token to sample.
            caught_up = [j for j, s in enumerate(running) if s.num_pending == 0]
            next_tokens = model.lm_head(last_hidden[caught_up]).argmax(-1).tolist()
            for j, token in zip(caught_up, next_tokens):
                running[j].tokens.append(token)
                step.produced.append((running[j].request, token))
            record_step(live, sum(num_new), stats)
            live = [s for s in live if not s.done]  # a finished sequence leaves (and frees its cache) now
            yield step


def generate(
    model: Decoder, prompts: list[list[int]], max_new_tokens: int | list[int], stats: StageStats | None = None,
    batch_size: int = 8, chunk_size: int = 64, max_num_batched_tokens: int = 256,
) -> list[list[int]]:
    lengths = prepare(model, prompts, max_new_tokens)
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in steps(model, prompts, lengths, batch_size, chunk_size, max_num_batched_tokens, stats):
        for request, token in step.produced:
            outputs[request].append(token)
    return outputs
