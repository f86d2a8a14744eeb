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
from minivllm.stages.ragged_batch import (
    RaggedAttention,
    Segment,
    Step,
    new_sequence,
    record_step,
    run_step,
)


class ChunkedAttention(RaggedAttention):
    """Chapter 4's per-segment attention, with segments that may start mid-prompt."""

    def mask(self, segment: Segment) -> torch.Tensor:
        # [n, past + n]. It covers chapter 4's cases too: a whole prompt is chunk_mask(n, 0),
        # the causal mask, and a decode token is chunk_mask(1, past), a row of ones.
        return chunk_mask(segment.num_new, segment.past, segment.cache.k.device)


def plan_step(prompt_left: list[int], chunk_size: int, budget: int) -> list[tuple[int, int]]:
    """Which tokens of which live sequence run this step: a list of (index into prompt_left,
    count) tuples, in the order they run.

    prompt_left[i]: prompt tokens sequence i has not prefilled yet; 0 means it is decoding and
    runs exactly one token. Decodes come first, in index order, one budget token each; then
    prefill chunks, in index order, each min(prompt_left[i], chunk_size, budget left) tokens.
    A sequence that gets no token this step is left out (never a count of 0); budget >= 1, so
    the plan is empty only when prompt_left is. The stages check every plan (check_plan) and
    raise ValueError for an empty plan, a count of 0 or past what is left, an index twice, or
    more tokens than the budget."""
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


def check_plan(plan: list[tuple[int, int]], prompt_left: list[int], chunk_size: int, budget: int) -> None:
    """Refuse a plan that breaks plan_step's contract, with the plan in the message. The loops
    that run plans trust them: a plan with no tokens would make them spin forever, and a count
    past a prompt's end would feed tokens that do not exist."""
    def wrong(problem: str) -> ValueError:
        return ValueError(f"plan_step({prompt_left}, chunk_size={chunk_size}, budget={budget}) returned {plan!r}: "
                          f"{problem}")

    if not isinstance(plan, list) or not all(isinstance(p, tuple) and len(p) == 2 for p in plan):
        raise wrong("expected a list of (index, count) tuples")
    if prompt_left and not plan:
        raise wrong("no tokens planned while sequences wait; a step must run at least one token")
    indices = [i for i, _ in plan]
    if len(set(indices)) != len(indices) or not all(0 <= i < len(prompt_left) for i in indices):
        raise wrong(f"each index must be in 0..{len(prompt_left) - 1} and appear at most once")
    for i, n in plan:
        most = 1 if prompt_left[i] == 0 else min(prompt_left[i], chunk_size)
        if not 1 <= n <= most:
            raise wrong(f"sequence {i} ({prompt_left[i]} prompt tokens left) may run 1..{most} tokens, not {n}")
    if sum(n for _, n in plan) > budget:
        raise wrong(f"{sum(n for _, n in plan)} tokens planned, over the budget of {budget}")


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
            check_plan(plan, prompt_left, chunk_size, max_num_batched_tokens)
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
