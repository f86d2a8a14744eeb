"""What paging buys, computed rather than timed: KV memory holding real tokens vs reserved.

The workload fixes every request's prompt and output length (EOS is ignored), so the token
counts along a run are known in advance and we can replay the run with counters alone, no
model. Every step, each running request has K/V for `cached` tokens (*used*) inside the memory
its cache policy sets aside for it (*reserved*). The policies compared, on one KV budget:

  max_model_len      a contiguous cache as long as the longest request the server allows
  prompt+max_tokens  a contiguous cache sized to the request (chapters 2-5)
  paged              whole blocks, taken as the cache grows; admitted only when the blocks
                     for its longest possible cache are sure to be there (chapter 6)
  paged+preemption   whole blocks, admitted when its prefill fits; when the pool runs dry the
                     newest request is preempted and recomputed later (chapter 7, vLLM)

All four share one scheduler, the iteration-level one of Orca and vLLM that the vLLM paper's
comparison assumes: first come first served, a request joins as soon as its policy lets it,
and each step every running request adds one token (a newly admitted one its whole prompt).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

SCHEMES = ("max_model_len", "prompt+max_tokens", "paged", "paged+preemption")


@dataclass
class Request:
    prompt_len: int
    output_len: int
    produced: int = 0  # output tokens sampled so far (kept across a preemption)
    cached: int = 0  # tokens whose K/V are in memory (0 while waiting)

    def next_cached(self) -> int:
        """Cached tokens after this request's next step: a (re)started request prefills its
        prompt and the outputs it already had; a running one adds its last sampled token."""
        return self.prompt_len + self.produced if self.cached == 0 else self.cached + 1


@dataclass
class KVTrace:
    """Per step: tokens cached, token slots reserved, requests holding memory, requests queued."""

    scheme: str
    budget: int  # token slots of KV memory
    used: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    preemptions: int = 0

    @property
    def utilisation(self) -> float:
        """Time-averaged share of reserved memory holding real tokens (the paper's measure)."""
        return sum(self.used) / sum(self.reserved)

    def _while_queued(self, values: list[int]) -> list[int]:
        """Values at the steps where requests queued for memory: the budget was the limit (in
        the tail of a run, with the queue empty, numbers say more about the workload)."""
        return [x for x, w in zip(values, self.waiting) if w > 0] or values

    @property
    def fit_at_once(self) -> float:
        """Requests running at once while others queue, on average: what the budget holds."""
        full = self._while_queued(self.running)
        return sum(full) / len(full)

    @property
    def budget_filled(self) -> float:
        """Share of the whole budget holding real tokens while others queue, on average."""
        full = self._while_queued(self.used)
        return sum(full) / (self.budget * len(full))

    @property
    def peak_running(self) -> int:
        return max(self.running)

    @property
    def steps(self) -> int:
        return len(self.used)


def simulate(
    prompt_lens: list[int], output_lens: list[int], budget: int, scheme: str, block_size: int = 16,
    max_model_len: int = 512,
) -> KVTrace:
    """Replay a workload under one cache policy with `budget` token slots of KV memory."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose from {', '.join(SCHEMES)}")

    def blocks(tokens: int) -> int:  # token slots in whole blocks
        return -(-tokens // block_size) * block_size

    def held(r: Request, cached: int) -> int:
        """Token slots reserved for r while it has `cached` tokens cached."""
        if scheme == "max_model_len":
            return max_model_len
        if scheme == "prompt+max_tokens":
            return r.prompt_len + r.output_len
        return blocks(cached)

    def promised(r: Request) -> int:
        """Slots r must be sure of to run its next step. Only paged+preemption promises less
        than r could ever need, and so must be able to take memory back."""
        if scheme == "paged":
            return blocks(r.prompt_len + r.output_len - 1)  # the last output is never cached
        return held(r, r.next_cached())

    requests = [Request(p, n) for p, n in zip(prompt_lens, output_lens) if n > 0]
    for r in requests:  # the most memory r can ever hold must fit, or it would wait forever
        if r.prompt_len + r.output_len > max_model_len or held(r, r.prompt_len + r.output_len - 1) > budget:
            raise ValueError(f"a request of {r.prompt_len} + {r.output_len} tokens can never run in {budget} "
                             f"slots with max_model_len {max_model_len}")
    trace, waiting, running = KVTrace(scheme, budget), deque(requests), []
    while waiting or running:
        while waiting and sum(promised(r) for r in running) + promised(waiting[0]) <= budget:
            running.append(waiting.popleft())
        while sum(held(r, r.next_cached()) for r in running) > budget:  # only with preemption
            victim = running.pop()  # the newest gives its memory back and starts over later
            victim.cached = 0
            waiting.appendleft(victim)
            trace.preemptions += 1
        for r in running:
            r.cached = r.next_cached()
            r.produced += 1
        trace.used.append(sum(r.cached for r in running))
        trace.reserved.append(sum(held(r, r.cached) for r in running))
        trace.running.append(len(running))
        trace.waiting.append(len(waiting))
        running = [r for r in running if r.produced < r.output_len]
    return trace


def compare(
    prompt_lens: list[int], output_lens: list[int], budget: int, block_size: int = 16, max_model_len: int = 512,
) -> dict[str, KVTrace]:
    """Every scheme on the same workload and budget."""
    return {s: simulate(prompt_lens, output_lens, budget, s, block_size, max_model_len) for s in SCHEMES}
