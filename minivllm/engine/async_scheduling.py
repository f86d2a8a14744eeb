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
   sequence when step N+1's tokens arrive (`EngineCore._finish`), so it never reaches an
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
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from minivllm.engine.prepare import StepArrays, to_device
from minivllm.engine.sequence import Sequence

if TYPE_CHECKING:  # type hints only: the engine core imports this module
    from minivllm.engine.core import EngineCore, EngineCoreOutput

PLACEHOLDER = -1  # a sampled token the host has not seen yet: never a real token id


class SampledTokens:
    """One step's chosen tokens, one per sequence in `seqs`: on the device (`device`), where
    the next step reads them, and on their way to the host (`chosen()` waits for them).
    A verify step (chapter 12) comes already on the host, as `chosen`."""

    def __init__(self, seqs: list[Sequence], device: torch.Tensor | None = None, logprobs: list | None = None,
                 chosen: list[tuple[list[int], list]] | None = None):
        self.seqs, self.device, self.logprobs, self._chosen = seqs, device, logprobs, chosen
        self.host, self.copied = device, None
        if device is not None and device.is_cuda:
            self.host = torch.empty(device.shape, dtype=device.dtype, pin_memory=True)
            self.host.copy_(device, non_blocking=True)  # the copy engine's work: the host goes on
            self.copied = torch.cuda.Event()
            self.copied.record()

    def chosen(self) -> list[tuple[list[int], list]]:
        """Each sequence's (new tokens, their logprobs), waiting for the copy if it is not done."""
        if self._chosen is None:
            if self.copied is not None:
                self.copied.synchronize()
            self._chosen = [([token], [top]) for token, top in zip(self.host.tolist(), self.logprobs)]
        return self._chosen

    def feed(self, seqs: list[Sequence], arrays: StepArrays, flat: torch.Tensor) -> None:
        """Write these tokens over the placeholders among the next step's input ids, on the device.

        flat: the next step's inputs on the device, laid out as `arrays` (a step of `seqs`), its
        first T entries, flat[:T], the input ids; sequence i's tokens start at arrays.query_start[i],
        at its position seq.num_computed_tokens (not yet advanced). A sequence with a placeholder
        (seq.num_output_placeholders > 0) that is one of self.seqs, row j here, has it as its last
        token, at position seq.num_tokens - 1: its input id there becomes self.device[j]. Every
        other entry of flat is untouched. One gather and one scatter on the device, whatever the
        number of sequences, and no copy to the host: the host never waits for the device here."""
        # BEGIN SOLUTION
        row_of = {seq: j for j, seq in enumerate(self.seqs)}
        targets, sources = [], []
        for i, seq in enumerate(seqs):
            source = row_of.get(seq)
            if seq.num_output_placeholders and source is not None:
                targets.append(int(arrays.query_start[i]) + seq.num_tokens - 1 - seq.num_computed_tokens)
                sources.append(source)
        if targets:
            index = to_device(np.array(targets + sources, dtype=np.int64), flat.device).view(2, -1)
            flat[index[0]] = self.device[index[1]]
        # END SOLUTION


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


class AsyncScheduler:
    """Runs EngineCore.step with step N+1 launched before step N is finished (see the module doc):
    core._schedule, core._launch and core._finish are the synchronous step's three parts, taken
    in a different order. It lives in the core, so the overlap is the same in the caller's
    thread (LLMEngine) and in the core's own process (core_process/)."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.in_flight: StepInFlight | None = None

    def can_overlap(self) -> bool:
        """Whether the next step can be planned without this step's tokens: not while a request
        has a grammar (its next mask depends on them). (With speculation there is no
        AsyncScheduler at all: proposals always read the newest tokens.)"""
        core = self.core
        return core.grammars is None or all(g.params.structured_outputs is None for g in core.requests.values())

    def step(self) -> list[EngineCoreOutput]:
        core, last = self.core, self.in_flight
        overlap = self.can_overlap()
        self.in_flight = None
        if last is not None and not overlap:  # the next plan needs step N's tokens: finish it first
            return self._finish(last)
        schedule = core._schedule()
        launched = core._launch(schedule, None if last is None else last.tokens) if schedule is not None else None
        outputs = self._finish(last) if last is not None else []  # step N's results, while step N+1 runs
        if launched is not None and overlap:
            add_placeholders(launched.tokens.seqs)
            self.in_flight = launched
        elif launched is not None:
            outputs += core._finish(launched)
        return outputs

    def _finish(self, step: StepInFlight) -> list[EngineCoreOutput]:
        drop_placeholders(step.tokens.seqs)
        return self.core._finish(step)
