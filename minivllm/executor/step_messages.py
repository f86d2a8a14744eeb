"""Chapter 14 — a step as one message from rank 0 to the other ranks.

Only rank 0 schedules. The others need the step's numbers and nothing else: the StepPlan, whose
arrays prepare.py already packs into one int64 buffer for the device (ids, positions, slot
mapping, query starts, context lengths, block tables, sampling rows). The block tables and slot
mappings mean the same thing on every rank, because every rank's KV pool has the same blocks;
each block just holds that rank's own KV heads.

A broadcast must know its size on every rank, so a message is a fixed header, then its body:

    header [9]: kind (STEP or STOP), T tokens, S rows, W block-table width, R sampling rows,
                the step's real sequences, the CUDA graph's batch size (-1: none), the pieces'
                token count (-1: none; both -1: eager), P sequences that want prompt logprobs
    body:       arrays.pack() | samplers [R] | P × (sequence, first row, end row)

Messages travel on their own gloo group (see group.py), on the CPU even when the model runs
on GPUs: the plan is host data, and an idle worker waits there for as long as rank 0 is idle.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from minivllm.worker.model_runner import StepPlan
from minivllm.worker.prepare import StepArrays, unpack

STOP, STEP = 0, 1
HEADER = 9


def body_size(header: np.ndarray | torch.Tensor) -> int:
    """int64s in the body a header announces: the packed arrays, the samplers, the prompt rows."""
    kind, T, S, W, R, _, _, _, P = (int(x) for x in header)
    return 0 if kind == STOP else 3 * T + (S + 1) + S + S * W + R + R + 3 * P


def encode(plan: StepPlan | None) -> tuple[np.ndarray, np.ndarray]:
    """(header, body) of a step, or of the STOP message for None."""
    if plan is None:
        return np.zeros(HEADER, dtype=np.int64), np.zeros(0, dtype=np.int64)
    a = plan.arrays
    rows = np.array([(i, start, end) for i, (start, end) in plan.prompt_rows.items()], dtype=np.int64).reshape(-1)
    header = np.array([STEP, a.num_tokens, a.block_tables.shape[0], a.block_tables.shape[1], len(a.sample_rows),
                       plan.num_seqs, -1 if plan.graph_size is None else plan.graph_size,
                       -1 if plan.piece_size is None else plan.piece_size, len(plan.prompt_rows)],
                      dtype=np.int64)
    body = np.concatenate([a.pack(), np.asarray(a.samplers, dtype=np.int64), rows])
    return header, body


def decode(header: np.ndarray, body: np.ndarray) -> StepPlan | None:
    """The StepPlan a (header, body) carries; None for STOP."""
    kind, T, S, W, R, num_seqs, graph_size, piece_size, P = (int(x) for x in header)
    if kind == STOP:
        return None
    packed = len(body) - R - 3 * P
    fields = {name: view.numpy() for name, view in unpack(torch.from_numpy(body[:packed]), T, S, W, R).items()}
    samplers = body[packed:packed + R].tolist()
    rows = body[packed + R:].reshape(P, 3).tolist()
    arrays = StepArrays(**fields, samplers=samplers)
    return StepPlan(arrays, num_seqs, None if graph_size < 0 else graph_size, None if piece_size < 0 else piece_size,
                    {i: (s, e) for i, s, e in rows})


class StepChannel:
    """Rank 0 sends each step's plan (or STOP) to every other rank of `group`; they receive it."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group

    def send(self, plan: StepPlan | None) -> None:
        header, body = encode(plan)
        dist.broadcast(torch.from_numpy(header), src=0, group=self.group)
        if len(body):
            dist.broadcast(torch.from_numpy(body), src=0, group=self.group)

    def receive(self) -> StepPlan | None:
        header = torch.empty(HEADER, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group)
        body = torch.empty(body_size(header), dtype=torch.int64)
        if len(body):
            dist.broadcast(body, src=0, group=self.group)
        return decode(header.numpy(), body.numpy())
