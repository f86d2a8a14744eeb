"""Chapter 6 — paged KV cache: chapter 5's loop, but the cache is a pool of fixed-size blocks.

Chapter 5 gives every sequence its own contiguous cache of prompt + max_new_tokens rows, set
aside the moment the sequence starts; most rows sit empty for most of its life (the answer is
not written yet). Here all sequences share one pool of `num_blocks` blocks of `block_size`
token slots (attention/paged.py). A sequence takes a block only when its tokens reach it, so
at most block_size - 1 slots per sequence are held but empty.

Each sequence keeps a block table, its blocks in order; the BlockManager hands blocks out and
takes them back. Attention writes each new token's K/V to the slot the table gives
(slot_mapping) and reads a sequence's past back through the same table (gather_kv).

Blocks can run out. Without preemption (chapter 7) a sequence that starts must be able to
finish, so the pool, not a batch size, decides who runs: sequences join the next group in
order while the blocks for the longest cache each could reach fit in the pool together. A
request that could not fit even alone is refused up front. As in chapters 3-5 the next group
starts when this one is done; letting newcomers in as soon as blocks free up is chapter 7.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from minivllm.attention.paged import KVPool, PagedAttention, PagedBatch
from minivllm.core.block_manager import BlockManager
from minivllm.model import Decoder
from minivllm.stages.chunked_prefill import check_plan, plan_step
from minivllm.stages.common import StageStats, as_tensor, prepare
from minivllm.stages.ragged_batch import Step


@dataclass
class PagedSequence:
    """A request in flight: its tokens so far (prompt, then outputs) and the blocks of its cache."""

    request: int  # index in the caller's list of prompts
    tokens: list[int]
    prompt_len: int
    max_new: int
    num_cached: int = 0  # tokens whose K/V are in the pool
    block_table: list[int] = field(default_factory=list)  # physical block of logical block 0, 1, ...

    @property
    def num_pending(self) -> int:
        return len(self.tokens) - self.num_cached

    @property
    def max_cached(self) -> int:
        """The longest this sequence's cache can get: the last output token is returned, never
        fed back, so its K/V are never stored."""
        return self.prompt_len + self.max_new - 1

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.prompt_len == self.max_new


@dataclass
class PagedStep(Step):
    """Chapter 4's Step, plus the pool after it for pictures: each live request's block table
    and number of cached tokens."""

    block_tables: dict[int, list[int]] = field(default_factory=dict)
    num_cached: dict[int, int] = field(default_factory=dict)


def admit(waiting: deque[PagedSequence], blocks: BlockManager) -> list[PagedSequence]:
    """The next group: waiting sequences in order, while all their worst cases fit the pool.
    Blocks are taken later, as tokens arrive; this only guarantees that grow() never fails."""
    group, promised = [], 0
    while waiting and promised + blocks.blocks_for(waiting[0].max_cached) <= blocks.num_blocks:
        promised += blocks.blocks_for(waiting[0].max_cached)
        group.append(waiting.popleft())
    return group


def run_step(
    model: Decoder, pool: KVPool, blocks: BlockManager, seqs: list[PagedSequence], num_new: list[int]
) -> torch.Tensor:
    """Feed the next num_new[i] pending tokens of each seqs[i] in one flat run, and return the
    final hidden state of each sequence's last token: [len(seqs), hidden]."""
    for s, n in zip(seqs, num_new):
        blocks.grow(s.block_table, s.num_cached + n)  # a new block only when a token needs it
    batch = PagedBatch.build([s.block_table for s in seqs], [s.num_cached for s in seqs], num_new,
                             pool.block_size, model.device)
    ids = [t for s, n in zip(seqs, num_new) for t in s.tokens[s.num_cached:s.num_cached + n]]
    positions = [p for s, n in zip(seqs, num_new) for p in range(s.num_cached, s.num_cached + n)]
    hidden = model(as_tensor(ids, model.device), as_tensor(positions, model.device), PagedAttention(pool, batch))
    for s, n in zip(seqs, num_new):
        s.num_cached += n
    return hidden[batch.query_start_tensor[1:].long() - 1]


def record_step(live: list[PagedSequence], blocks: BlockManager, num_tokens: int, stats: StageStats | None) -> None:
    """Used: tokens cached. Reserved: whole blocks handed out (the pool's free blocks are not)."""
    if stats:
        stats.token_slots += num_tokens
        held = blocks.num_blocks - blocks.num_free
        stats.record_kv(used=sum(s.num_cached for s in live), reserved=held * blocks.block_size)


@torch.inference_mode()
def steps(
    model: Decoder, prompts: list[list[int]], lengths: list[int], block_size: int = 16, num_blocks: int | None = None,
    chunk_size: int = 64, max_num_batched_tokens: int = 256, stats: StageStats | None = None,
) -> Iterator[PagedStep]:
    """Run the requests in groups that fit the pool, one `PagedStep` per forward pass."""
    if block_size < 1 or chunk_size < 1 or max_num_batched_tokens < 1:
        raise ValueError(f"block_size, chunk_size and max_num_batched_tokens must be >= 1, got {block_size}, "
                         f"{chunk_size}, {max_num_batched_tokens}")
    waiting = deque(PagedSequence(i, list(prompts[i]), len(prompts[i]), n) for i, n in enumerate(lengths) if n > 0)
    if num_blocks is None:
        # Enough blocks for every request's worst case at once, so all run as one group: what
        # chapter 5 with batch_size = len(prompts) reserves in contiguous caches, rounded up to
        # whole blocks. Pass a smaller pool to see admission at work.
        num_blocks = max(1, sum(-(-s.max_cached // block_size) for s in waiting))
    blocks = BlockManager(num_blocks, block_size)
    for s in waiting:  # refuse now what could never run, rather than wait for it forever
        if blocks.blocks_for(s.max_cached) > num_blocks:
            raise ValueError(
                f"request {s.request}: {s.prompt_len} prompt + {s.max_new} new tokens cache up to {s.max_cached} "
                f"tokens, {blocks.blocks_for(s.max_cached)} blocks of {block_size}, but the pool has only "
                f"{num_blocks} blocks")
    pool = KVPool(model, num_blocks, block_size)
    while waiting:
        live = admit(waiting, blocks)  # NEW: the pool, not batch_size, decides who runs together
        while live:
            prompt_left = [max(0, s.prompt_len - s.num_cached) for s in live]
            plan = plan_step(prompt_left, chunk_size, max_num_batched_tokens)
            check_plan(plan, prompt_left, chunk_size, max_num_batched_tokens)
            running, num_new = [live[i] for i, _ in plan], [n for _, n in plan]
            step = PagedStep(plan=[(s.request, s.num_cached, n) for s, n in zip(running, num_new)])
            last_hidden = run_step(model, pool, blocks, running, num_new)
            # Only a sequence whose cache caught up with its tokens has a next token to sample.
            caught_up = [j for j, s in enumerate(running) if s.num_pending == 0]
            next_tokens = model.lm_head(last_hidden[caught_up]).argmax(-1).tolist()
            for j, token in zip(caught_up, next_tokens):
                running[j].tokens.append(token)
                step.produced.append((running[j].request, token))
            record_step(live, blocks, sum(num_new), stats)
            step.block_tables = {s.request: list(s.block_table) for s in live}
            step.num_cached = {s.request: s.num_cached for s in live}
            for s in live:
                if s.done:
                    blocks.release(s.block_table)  # NEW: its blocks go back to the pool at once
            live = [s for s in live if not s.done]
            yield step


def generate(
    model: Decoder, prompts: list[list[int]], max_new_tokens: int | list[int], stats: StageStats | None = None,
    block_size: int = 16, num_blocks: int | None = None, chunk_size: int = 64, max_num_batched_tokens: int = 256,
) -> list[list[int]]:
    lengths = prepare(model, prompts, max_new_tokens)
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in steps(model, prompts, lengths, block_size, num_blocks, chunk_size, max_num_batched_tokens, stats):
        for request, token in step.produced:
            outputs[request].append(token)
    return outputs
