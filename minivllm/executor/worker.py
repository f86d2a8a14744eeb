"""Chapter 14 — ranks 1 .. N-1: build a shard, then run whatever step rank 0 sends, until STOP.

Every rank builds the same thing: its shard of the model (shard.py) and an ordinary ModelRunner
over it, with its own KV pool (the same number of blocks as every rank, each holding this rank's
KV heads) and, on GPUs, its own CUDA graphs. A worker never schedules or samples: it receives a
StepPlan and calls the runner's `execute`, the very method rank 0 calls on the same plan, so
the ranks meet in the same collectives in the same order.

A spawned worker lives only as long as rank 0 wants it: it ignores Ctrl-C (rank 0 handles it
and stops the workers), exits on STOP, exits when rank 0's connections close, and exits when
its parent process is gone (a watchdog thread), so that nothing is ever left running.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from minivllm.config.engine import EngineConfig
from minivllm.distributed.direct_load import UnloadedDecoder, load_shard
from minivllm.distributed.shard import shard_decoder
from minivllm.executor.group import STARTUP_TIMEOUT, RankGroup, join, leave, rank_device
from minivllm.model import Decoder
from minivllm.worker.model_runner import ModelRunner

PARENT_POLL_SECONDS = 0.5


def share_config(group: RankGroup, config: EngineConfig | None = None) -> EngineConfig:
    """Rank 0's resolved engine settings, on every rank (rank 0 passes them, the others get
    them): every KV pool must have the same number of blocks, every rank the same graphs."""
    box = [config]
    dist.broadcast_object_list(box, src=0, group=group.channel.group)
    return box[0]


def make_shard(model: Decoder, group: RankGroup) -> Decoder:
    """This rank's shard: read from the checkpoint directly when `model` is only its skeleton
    (direct_load.py), cut from the whole model when one was handed over."""
    if isinstance(model, UnloadedDecoder):
        return load_shard(model.weights, group.comm, group.device, model.dtype)
    return shard_decoder(model, group.comm, group.device)


def build_runner(model: Decoder, group: RankGroup, config: EngineConfig, graph_class: type) -> ModelRunner:
    """A worker's shard of `model` and a ModelRunner over it, built while rank 0 builds its own
    the same way (TensorParallelRunner.__init__): capturing CUDA graphs runs the forward, whose
    all-reduces every rank must join."""
    return ModelRunner(make_shard(model, group), config, graph_class)


def start_worker(model: Decoder, group: RankGroup, graph_class: type) -> ModelRunner:
    """A worker's runner, built in step with rank 0's (see TensorParallelRunner.__init__)."""
    config = share_config(group)
    runner = build_runner(model, group, config, graph_class)
    dist.barrier(group=group.channel.group)  # ready: rank 0's constructor returns
    return runner


def serve(runner: ModelRunner, group: RankGroup) -> None:
    """Run every step rank 0 sends, until it sends STOP."""
    while (plan := group.channel.receive()) is not None:
        runner.execute(plan)


@dataclass
class WorkerSpec:
    """What a spawned worker is started with."""

    rank: int
    world_size: int
    port: int  # rank 0's TCPStore on 127.0.0.1
    model: Any  # rank 0's Decoder: its weights arrive through shared memory, not as a copy; or an
    # UnloadedDecoder, which arrives as where the weights are (each rank reads its own slices)
    graph_class: type
    threads: int  # torch CPU threads (rank 0's own number)
    parent_pid: int


def _exit_with_parent(parent_pid: int) -> None:
    """Watchdog: if rank 0's process is gone (even killed outright), this worker goes too."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_SECONDS)
    os._exit(1)


def spawned_worker(spec: WorkerSpec) -> None:
    """The entry point of a worker that rank 0 spawned (torch.multiprocessing, "spawn")."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it then stops us
    threading.Thread(target=_exit_with_parent, args=(spec.parent_pid,), daemon=True).start()
    torch.set_num_threads(spec.threads)
    store = dist.TCPStore("127.0.0.1", spec.port, spec.world_size, is_master=False, timeout=STARTUP_TIMEOUT)
    try:
        store.set(f"joined/{spec.rank}", "1")
        group = join(spec.rank, spec.world_size, rank_device(spec.model.device, spec.rank), store)
        runner = start_worker(spec.model, group, spec.graph_class)
        spec.model = None  # the shard holds copies: let go of rank 0's weights
        serve(runner, group)
        code = 0
    except Exception as error:
        try:  # rank 0 reads this and says why the worker is gone
            store.set(f"error/{spec.rank}", traceback.format_exc())
        except Exception:
            pass  # rank 0 itself is gone: nobody is left to tell
        print(f"minivllm tensor-parallel worker {spec.rank}: {type(error).__name__}: {error}", file=sys.stderr)
        code = 1
    leave()
    # Skip the interpreter's teardown, which takes seconds with torch loaded and has nothing left to do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
