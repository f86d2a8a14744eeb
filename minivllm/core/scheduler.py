"""Iteration-level scheduling: every step, decide which tokens of which requests run (chapter 7).

This is continuous batching. There is no "prefill phase" and "decode phase": each request
simply has `num_tokens` it knows and `num_computed_tokens` already in the KV cache, and every
step the scheduler hands out at most `max_num_batched_tokens` tokens so the second counter can
catch up with the first (the design of vLLM V1's scheduler):

1. Running requests go first, oldest first. A decoding request needs 1 token; one still in
   its prompt gets the next chunk that fits in the budget.
2. If a running request needs a new KV block and none is free, the *newest* running request
   is preempted: its blocks are freed and it goes back to the front of the queue, to be
   recomputed from scratch later (its tokens so far are kept, so nothing is lost but work).
3. Whatever budget is left admits waiting requests, first come first served, each with as
   much of its prompt as fits (chunked prefill), up to `max_num_seqs` running at once. A
   newcomer must fit *all* of its prompt, and leave one free block per running request so
   that they can grow: admitting a request that its own next chunk, or the next block
   boundary of another, would preempt again only wastes work (a tight pool then "thrashes":
   admit, recompute, preempt, every other step).

Finished requests leave the batch the step they finish; new ones join the step they arrive.

A burst of long prompts (vLLM's `long_prefill_token_threshold`): first come, first served lets the
first prompts of a burst take the whole budget, step after step, while the short ones behind them
wait for their first token. With a threshold T > 0 a request still in its prompt gets at most T
of its prompt tokens per step (`wanted`), so the budget is shared by max_num_batched_tokens / T
newcomers at once. Chunked prefill is exact, so the tokens generated do not change; only when
each request's prompt is done does.

Chapter 13: a request whose grammar is still compiling waits *beside* the queue, in
`waiting_for_grammar`, so nobody waits for it; once compiled it joins the queue at the place its
arrival time gives it (`admit_compiled`, at the start of every schedule).
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from minivllm.core.block_manager import BlockManager
from minivllm.request.sequence import SchedulerOutput, Sequence, Status

if TYPE_CHECKING:  # the scheduler only calls the connector it is given; importing chapter 17's
    # package would load the engine config and the model into every scheduler import
    from minivllm.kv_transfer.base import KVConnectorBase


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 connector: KVConnectorBase | None = None, long_prefill_token_threshold: int = 0):
        """connector: chapter 17's KV connector, scheduler side (None: all K/V are computed here).
        long_prefill_token_threshold: most prompt tokens one request gets in a step (0: no cap)."""
        if max_num_batched_tokens < 1 or max_num_seqs < 1 or long_prefill_token_threshold < 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1, long_prefill_token_threshold >= 0")
        self.block_manager, self.connector = block_manager, connector
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in the order they were admitted: the last is the newest
        self.waiting_for_grammar: list[Sequence] = []  # chapter 13: not schedulable until compiled
        self.num_preemptions = 0  # since the engine started, for /metrics (a sequence's own count dies with it)

    def add(self, seq: Sequence) -> None:
        if seq.grammar is not None and not seq.grammar.ready:  # chapter 13
            self.waiting_for_grammar.append(seq)
        else:
            self.waiting.append(seq)

    def wanted(self, seq: Sequence) -> int:
        """The tokens `seq` would compute this step if the budget allowed: all it has not
        computed, but at most long_prefill_token_threshold (when > 0) while it is in its prompt."""
        n = seq.num_tokens - seq.num_computed_tokens
        cap = self.long_prefill_token_threshold
        if cap and seq.num_computed_tokens < seq.num_prompt_tokens:
            return min(n, cap)
        return n

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_grammar)

    def admit_compiled(self) -> None:
        """Chapter 13: move the sequences whose grammar is compiled into the queue, each before
        the first waiting sequence that arrived after it (first come, first served, as if its
        grammar had been ready all along)."""
        for seq in [s for s in self.waiting_for_grammar if s.grammar.ready]:
            self.waiting_for_grammar.remove(seq)
            later = (i for i, other in enumerate(self.waiting) if other.arrival_time > seq.arrival_time)
            self.waiting.insert(next(later, len(self.waiting)), seq)

    def schedule(self) -> SchedulerOutput:
        """Plan one step: which requests compute how many of their tokens, under the budget of
        self.max_num_batched_tokens tokens, preempting when KV blocks run out.

        1. self.running, oldest first, while budget is left: grant a request
           n = min(self.wanted(seq), budget left) tokens and grow its block table
           to num_computed_tokens + n tokens (block_manager.can_grow, then grow). While the blocks
           do not fit, preempt the newest running request (self.preempt(self.running[-1]), and
           append it to out.preempted); if that was the request itself, stop walking.
        2. Then, only if nothing was preempted this step, admit self.waiting in arrival order
           while budget is left and fewer than self.max_num_seqs run. (Memory is short after a
           preemption, and the preempted request is first in line: with blocks shared by a
           prefix cache, chapter 11, it could otherwise come straight back in the step that
           preempted it.) The head of the queue first takes the cached blocks of its prefix,
           if any, and the tokens a KV connector can load (seq.num_computed_tokens =
           self.reuse_computed(seq); always 0 before chapter 11). It comes in only if the free blocks then cover its whole num_tokens
           plus one block per running request, counting those admitted earlier in this same
           step; else it gives those blocks back with block_manager.release,
           num_computed_tokens returns to 0, and nobody comes in this step: no one overtakes
           it. (Such a head waits until running requests finish; with nothing running it
           always fits, because the engine refuses, in add_request, a request that could need
           more blocks than the pool holds.) It gets min(self.wanted(seq), budget left) tokens, its blocks for those tokens only, status Status.RUNNING, and joins the end
           of self.running (popped from self.waiting).
        Record every grant with out.add(seq, n), n >= 1, and return out. A step that preempts
        nothing must grant some token while requests are unfinished, or the engine would wait
        forever."""
        self.admit_compiled()  # chapter 13
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # BEGIN SOLUTION
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(self.wanted(seq), budget)
            while not self.block_manager.can_grow(seq.block_table, seq.num_computed_tokens + n):
                victim = self.running[-1]  # the newest running request gives its blocks back
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:  # it just preempted itself
                break
            self.block_manager.grow(seq.block_table, seq.num_computed_tokens + n)
            out.add(seq, n)
            budget -= n
            i += 1
        # Admit waiting requests with the budget left, in arrival order. After a preemption
        # memory is short, so nobody new comes in this step (the preempted one is first in line).
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            seq.num_computed_tokens = self.reuse_computed(seq)  # cached blocks (chapter 11), loaded K/V (17)
            n = min(self.wanted(seq), budget)
            needed = self.block_manager.missing_blocks(seq.block_table, seq.num_tokens)  # the whole prompt
            if needed + len(self.running) > self.block_manager.num_free:
                self.block_manager.release(seq.block_table)  # not this step: waiting requests hold nothing
                seq.num_computed_tokens = 0
                break  # first come, first served: nobody overtakes the head of the queue
            self.block_manager.grow(seq.block_table, seq.num_computed_tokens + n)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.add(seq, n)
            budget -= n
        return out
        # END SOLUTION

    def reuse_computed(self, seq: Sequence) -> int:
        """The tokens at the start of seq whose K/V need no computing here: the blocks of its prefix
        found in the prefix cache (chapter 11), then those a KV connector can load (chapter 17)."""
        cached = self.block_manager.reuse_prefix(seq)
        if self.connector is None:
            return cached
        return cached + self.connector.lookup(seq, cached)

    def preempt(self, seq: Sequence) -> None:
        """Recompute-preemption: free the KV cache of a running request and requeue it first."""
        self.running.remove(seq)
        self.block_manager.release(seq.block_table)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a request out for good (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.waiting_for_grammar:  # chapter 13
            self.waiting_for_grammar.remove(seq)
        if self.connector is not None:  # chapter 17: its saves are written within their steps, so the blocks go now
            self.connector.request_finished(seq)
        self.block_manager.release(seq.block_table)
        seq.status = Status.FINISHED
