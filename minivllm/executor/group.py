"""Chapter 14 — how the ranks find each other: torch.distributed's process groups.

Two ways in, one result:
- spawned: rank 0, the engine's own process, starts the N-1 other ranks on this machine (worker.py).
  It opens the rendezvous itself, a TCPStore on 127.0.0.1 and a free port, and every rank joins it.
- torchrun: every rank was started by torchrun, on one node or several, and they meet at the
  address torchrun hands them (MASTER_ADDR, MASTER_PORT: the "env://" rendezvous).

Either way each rank ends up with two groups:
- the default group (gloo on a CPU, NCCL on GPUs) carries the model's collectives (layers.py). Its
  timeout bounds how long a rank waits inside a step for the others.
- a gloo group carries the step messages (step_messages.py). Those are host data, and an idle rank waits
  there for as long as the engine has nothing to do, so its timeout is practically unbounded.
A rank that dies closes its connections: the others' next collective fails at once ("Connection
closed by peer") instead of waiting for a timeout.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from minivllm.distributed.layers import Communicator
from minivllm.executor.step_messages import StepChannel

COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # a rank waiting this long inside a step for the others gives up
IDLE_TIMEOUT = timedelta(days=365)  # an idle engine's workers wait for the next step this long
STARTUP_TIMEOUT = timedelta(seconds=300)  # to start, load and shard: spawning is slow on a busy machine


@dataclass
class RankGroup:
    """One rank's place among the others: who it is, where it computes, how it talks."""

    rank: int
    world_size: int
    device: torch.device
    comm: Communicator  # the model's collectives (default group)
    channel: StepChannel  # the step messages (gloo group)


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) when torchrun started this process, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "RANK" not in os.environ:
        return None
    env = os.environ
    return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"]))


def rank_device(model_device: torch.device, local_rank: int) -> torch.device:
    """The device a rank computes on: GPU number local_rank when the model runs on GPUs."""
    return torch.device("cuda", local_rank) if model_device.type == "cuda" else torch.device("cpu")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (the rendezvous of spawned ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank: int, world_size: int, device: torch.device, store: dist.Store | None = None) -> RankGroup:
    """Join the other ranks: through `store` (spawned ranks), or torchrun's env:// rendezvous."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    options = dict(backend=backend, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options["device_id"] = device
    if store is not None:
        dist.init_process_group(store=store, **options)
    else:
        dist.init_process_group(init_method="env://", **options)
    messages = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return RankGroup(rank, world_size, device, Communicator(rank, world_size), StepChannel(messages))


def leave() -> None:
    """Tear down this process's groups (a new engine can then make its own). After a rank died
    the teardown may fail too; there is nothing left to save then, so that error is dropped."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
