"""A record of what the scheduler did, step by step, for pictures, stats and tests (chapter 7).

Give an engine a `Trace()` and every step appends a `StepRecord`: who computed prompt tokens
(a prefill chunk, or a recompute after a preemption), who decoded, who was preempted, who
waited, and how full the KV cache was. Plots and StageStats read this instead of re-deriving
the schedule.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.core.scheduler import Scheduler
from minivllm.request.sequence import SchedulerOutput

# What a request did in one step, for the timeline picture.
IDLE, WAITING, STALLED, PREFILL, DECODE, PREEMPTED = range(6)
TIMELINE_LABELS = {IDLE: "not arrived / done", WAITING: "waiting in the queue", STALLED: "running, out of budget",
                   PREFILL: "prefill chunk (or recompute)", DECODE: "decode (1 token)", PREEMPTED: "preempted"}


@dataclass
class StepRecord:
    step: int
    budget: int  # max_num_batched_tokens
    prefill: dict[str, int]  # request id -> tokens computed this step that were not a decode
    decode: list[str]  # request ids that computed exactly their newest token
    recomputed: int  # tokens computed again because a preemption had thrown their K/V away
    preempted: list[str]
    waiting: list[str]  # queued after the plan, not computing anything this step
    stalled: list[str]  # running, but the budget ran out before their turn
    kv_tokens: int  # tokens in the cache after this step, over all running requests (a block that
    # several requests share counts for each of them, so with prefix caching kv_tokens can exceed kv_reserved_tokens)
    kv_reserved_tokens: int  # slots in the blocks they hold (kv_tokens / this = KV utilisation)
    cached_tokens: int = 0  # prompt tokens that requests admitted this step found in the prefix cache (chapter 11)
    # Chapter 12: request id -> the guesses in its verify chunk (a decode that scores 1 + D
    # positions), and, filled in after verification, how many of them the target kept.
    drafts: dict[str, list[int]] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0  # how long the step took (filled in after it ran)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.prefill.values())

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + len(self.decode) + sum(map(len, self.drafts.values()))


@dataclass
class Trace:
    steps: list[StepRecord] = field(default_factory=list)
    high_water: dict[str, int] = field(default_factory=dict, repr=False)  # most tokens each request ever had cached
    hits_seen: int = field(default=0, repr=False)  # the block manager's hit counter at the last record

    def record(self, schedule: SchedulerOutput, scheduler: Scheduler) -> StepRecord:
        """Describe a plan before it runs (num_computed_tokens still holds the old values)."""
        prefill, decode, recomputed, drafts = {}, [], 0, {}
        for seq, n in zip(schedule.seqs, schedule.num_new_tokens):
            start, seen = seq.num_computed_tokens, self.high_water.get(seq.request_id, 0)
            guesses = seq.num_spec_tokens  # a verify chunk: the newest token, then its guesses
            recomputed += max(0, min(start + n - guesses, seen) - start)
            self.high_water[seq.request_id] = max(seen, start + n - guesses)
            if n == 1 + guesses and start == seq.num_tokens - n and start >= seq.num_prompt_tokens and start >= seen:
                decode.append(seq.request_id)
                if guesses:
                    drafts[seq.request_id] = seq.token_ids[-guesses:]
            else:
                prefill[seq.request_id] = n
        scheduled = set(prefill) | set(decode)
        manager = scheduler.block_manager
        record = StepRecord(
            step=len(self.steps), budget=scheduler.max_num_batched_tokens, prefill=prefill, decode=decode,
            recomputed=recomputed, preempted=[s.request_id for s in schedule.preempted],
            waiting=[s.request_id for s in scheduler.waiting if s.request_id not in scheduled],
            stalled=[s.request_id for s in scheduler.running if s.request_id not in scheduled],
            kv_tokens=sum(s.num_computed_tokens for s in scheduler.running) + schedule.total_tokens,
            kv_reserved_tokens=(manager.num_blocks - manager.num_free) * manager.block_size,
            cached_tokens=manager.hit_tokens - self.hits_seen, drafts=drafts,
        )
        self.hits_seen = manager.hit_tokens
        self.steps.append(record)
        return record

    @property
    def num_cached_tokens(self) -> int:
        return sum(s.cached_tokens for s in self.steps)

    @property
    def num_preemptions(self) -> int:
        return sum(len(s.preempted) for s in self.steps)

    def timeline(self) -> tuple[list[str], list[list[int]]]:
        """Request ids (in order of first appearance) and a [request][step] grid of codes."""
        ids: dict[str, int] = {}
        for s in self.steps:
            for rid in [*s.decode, *s.stalled, *s.prefill, *s.preempted, *s.waiting]:
                ids.setdefault(rid, len(ids))
        grid = [[IDLE] * len(self.steps) for _ in ids]
        for s in self.steps:
            for code, rids in ((WAITING, s.waiting), (STALLED, s.stalled), (PREFILL, s.prefill),
                               (DECODE, s.decode), (PREEMPTED, s.preempted)):
                for rid in rids:
                    grid[ids[rid]][s.step] = code
        return list(ids), grid
