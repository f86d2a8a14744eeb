"""Async scheduling: the host plans step N+1 while the device runs step N (chapter 16).

Why. A synchronous step takes turns: the host schedules and prepares while the GPU waits,
the GPU computes while the host waits in `.tolist()`, then the host appends tokens and builds
outputs while the GPU waits again. Measured on an H200 at batch 256: 9.46 ms per step for
6.1 ms of GPU work. If the host does its part for step N+1 while the GPU runs step N, a step
takes max(host, device) instead of host + device.

What makes that possible is one observation: to plan step N+1 the scheduler needs to know
*how many* tokens each request has, not *which*. So after launching step N the core appends a
`PLACEHOLDER` for every token it will sample (`Sequence.num_output_placeholders` counts them),
and the next step is scheduled and prepared at once. The sampled ids never need the host to
reach the next step: they stay on the device, and `SampledTokens.feed` writes them over the
placeholders in step N+1's input ids, on the device, in stream order. Meanwhile they travel to
the host in a non-blocking copy (pinned memory, an event), and the host reads them, appends
them and builds step N's outputs *after* step N+1 has been launched:

    host:   schedule N+1 | prepare N+1 | launch N+1 | finish N (wait for N's tokens) | schedule N+2 ...
    device:        ... step N ...                   | step N+1 ...

The price:
1. A request that finishes in step N (EOS, a stop token, its length) was already scheduled
   into step N+1: it computes one extra token. That token is dropped: the core skips a finished
   sequence when step N+1's tokens arrive (`EngineCore.finish`), so it never reaches an
   EngineCoreOutput, the output processor's stop-string check, a logprob or the prefix cache
   (placeholders are never hashed into it). The same holds for a sequence aborted while its
   step was in flight, and that includes a stop string: the output processor finds it in step
   N's text after step N+1 was launched, and aborts the completion in the core
   (`EngineCore.abort_sequences`) before the core finishes step N+1.
2. Where the host must see step N's tokens before it can plan step N+1, there is no overlap:
   a grammar's next mask (structured outputs) and speculation's proposals (n-gram lookup or a
   draft model read the tokens to guess from). While any unfinished request has a grammar, or
   always with speculative_config, steps run synchronously, one after the other.
3. Logprobs and prompt logprobs are computed on the host from device values: they stay
   correct, but such a step's host copy waits for the device, as in the synchronous engine.

On a CPU the model runs on the host's own cores, so nothing overlaps and the default is off;
`chapters/16_async_scheduling.py` shows the mechanism with a model that sleeps, as a GPU lets
the host go on while it works.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from minivllm.request.messages import EngineCoreOutput
from minivllm.request.sequence import SchedulerOutput, Sequence
from minivllm.worker.sampled_tokens import SampledTokens

PLACEHOLDER = -1  # a sampled token the host has not seen yet: never a real token id


def add_placeholders(seqs: list[Sequence]) -> None:
    """One placeholder for the token each unfinished sequence of a launched step will get."""
    for seq in seqs:
        if not seq.is_finished:
            seq.token_ids.append(PLACEHOLDER)
            seq.num_output_placeholders += 1


def drop_placeholders(seqs: list[Sequence]) -> None:
    """Take back the placeholders of a step whose tokens have arrived (one each, at the end)."""
    for seq in seqs:
        if seq.num_output_placeholders:
            del seq.token_ids[-1]
            seq.num_output_placeholders -= 1


@dataclass
class StepInFlight:
    """A launched step: what the engine needs to finish it later."""

    tokens: SampledTokens
    record: Any  # the step's trace record, or None
    start: float  # when the step began (perf_counter)


class StepPhases(Protocol):
    """The three phases of a step, as the engine core offers them (EngineCore in engine_core.py)."""

    def schedule(self) -> SchedulerOutput | None: ...

    def launch(self, schedule: SchedulerOutput, previous: Any = None) -> StepInFlight: ...

    def finish(self, step: StepInFlight) -> list[EngineCoreOutput]: ...

    def plans_need_tokens(self) -> bool: ...


class AsyncScheduler:
    """Runs a step with step N+1 launched before step N is finished (see the module doc): the
    core's three public phases, schedule, launch and finish, taken in a different order. It is
    the core's, so the overlap is the same in the caller's thread and in a core process."""

    def __init__(self, phases: StepPhases):
        self.phases = phases
        self.in_flight: StepInFlight | None = None

    def step(self) -> list[EngineCoreOutput]:
        phases, last = self.phases, self.in_flight
        # A grammar's next mask needs step N's tokens: then step N is finished before N+1 is planned.
        overlap = not phases.plans_need_tokens()
        self.in_flight = None
        if last is not None and not overlap:
            return self._finish(last)
        schedule = phases.schedule()
        launched = phases.launch(schedule, None if last is None else last.tokens) if schedule is not None else None
        outputs = self._finish(last) if last is not None else []  # step N's results, while step N+1 runs
        if launched is not None and overlap:
            add_placeholders(launched.tokens.seqs)
            self.in_flight = launched
        elif launched is not None:
            outputs += phases.finish(launched)
        return outputs

    def _finish(self, step: StepInFlight) -> list[EngineCoreOutput]:
        drop_placeholders(step.tokens.seqs)
        return self.phases.finish(step)
