"""A step's sampled tokens, where the next step can read them (chapter 16).

Every step ends with one token per sequence chosen on the device. A synchronous engine copies
them to the host at once and waits (`chosen()`); under async scheduling (core/async_scheduling.py)
the next step is launched first, and reads them where they already are: `feed` writes them over
the next step's placeholders among its input ids, on the device, in stream order, while their
copy to the host (pinned memory, an event) completes in the background.
"""
from __future__ import annotations

import numpy as np
import torch

from minivllm.request.sequence import Sequence
from minivllm.worker.prepare import StepArrays, to_device


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
