"""Chapter 14 — N ranks as N threads of one process, for checks and notebooks.

The Communicator's collectives, between threads: each rank puts its tensor on a shared table,
the threads wait for each other at a barrier, and each one adds up the table in rank order
(all-reduce), or rank 0 lays it side by side (gather). Same shards, same forward, no processes:
a way to see in a second that the shards of a model compute what the model computes. A rank
whose collectives do not match the others' fails at the barrier's timeout instead of hanging.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from minivllm.attention.dense import attend
from minivllm.distributed.layers import Communicator
from minivllm.distributed.shard import shard_decoder
from minivllm.model import Decoder

BARRIER_SECONDS = 30.0


class ThreadCommunicator(Communicator):
    """Rank `rank` of world_size threads that share `table` (a list, one slot per rank) and `barrier`."""

    def __init__(self, rank: int, world_size: int, table: list, barrier: threading.Barrier):
        super().__init__(rank, world_size)
        self.table, self.barrier = table, barrier

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.table[self.rank] = x.clone()
        self.barrier.wait()  # every rank has written its slot
        parts = list(self.table)
        self.barrier.wait()  # every rank has read the table: it may be written again
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        x.copy_(torch.stack(self._exchange(x)).sum(0))
        self._count(x, start)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        start = time.perf_counter()
        parts = self._exchange(x)
        self._count(x, start)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None


def run_ranks(world_size: int, work: Callable[[ThreadCommunicator], Any]) -> list[Any]:
    """work(comm) on world_size threads, one per rank; returns each rank's result, in rank
    order. An exception on any rank is raised here (the others then fail at the barrier)."""
    table: list = [None] * world_size
    barrier = threading.Barrier(world_size, timeout=BARRIER_SECONDS)
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            with torch.no_grad():
                results[rank] = work(ThreadCommunicator(rank, world_size, table, barrier))
        except BaseException as error:  # noqa: BLE001 - handed to the caller below
            errors.append(error)
            barrier.abort()  # the other ranks stop waiting for this one

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank-{r}") for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0] if errors else None)
    if first is not None:
        raise first
    return results


def sharded_logits(model: Decoder, world_size: int, input_ids: torch.Tensor) -> torch.Tensor:
    """The logits [T, V] of one sequence (input_ids [T], positions 0..T-1, causal attention)
    computed by world_size shards of `model` in lockstep, one thread per rank."""
    T = len(input_ids)
    positions = torch.arange(T, device=model.device)
    mask = torch.ones(T, T, dtype=torch.bool, device=model.device).tril()

    def rank_logits(comm: ThreadCommunicator) -> torch.Tensor | None:
        shard = shard_decoder(model, comm)
        hidden = shard(input_ids, positions, lambda layer, q, k, v: attend(q, k, v, mask))
        return shard.lm_head(hidden)

    return run_ranks(world_size, rank_logits)[0]
