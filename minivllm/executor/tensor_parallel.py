"""Chapter 14 — rank 0: the engine's model runner, which also drives the other ranks.

`LLMEngine(model, tensor_parallel_size=N)` swaps its ModelRunner for a TensorParallelRunner and
changes nothing else: the scheduler, the block manager and the sampler run on rank 0 alone, as
before. Each step, `run` plans it on the host (ModelRunner.run); `execute` first sends the plan
to the other ranks (step_messages.py), then runs rank 0's own share, and the collectives inside the
forward pass bring the ranks together; the logits arrive on rank 0 only.

Where the other ranks come from (group.py):
- by default rank 0 spawns them on this machine, as vLLM's multiprocessing executor does. Given a
  checkpoint or a config (LLM("path", tensor_parallel_size=N)), every rank, rank 0 too, reads only
  its own slices (direct_load.py); given a Decoder already in memory, rank 0 hands the other ranks
  its weights through shared memory and each cuts its shard from them;
- under torchrun (one node or several) every rank runs the same program: on ranks 1 .. N-1 the
  engine's constructor becomes the worker loop, and the process exits when rank 0's engine stops.

No worker outlives its engine: `shutdown()` (or the engine being garbage-collected, or the program
exiting) sends STOP and waits; a worker that does not leave is terminated. A worker that dies is
noticed before the next step (its exit code) or inside one (its closed connections), and every
call after that raises a RuntimeError that says so, instead of waiting forever.
"""
from __future__ import annotations

import logging
import os
import signal
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.config.engine import EngineConfig
from minivllm.executor.group import (
    STARTUP_TIMEOUT,
    RankGroup,
    free_port,
    join,
    leave,
    rank_device,
    torchrun_rank,
)
from minivllm.executor.main_guard import refuse_unguarded_start
from minivllm.executor.worker import (
    WorkerSpec,
    make_shard,
    serve,
    share_config,
    spawned_worker,
    start_worker,
)
from minivllm.model import Decoder
from minivllm.worker.cuda_graphs import CudaGraph
from minivllm.worker.model_runner import ModelRunner, StepPlan

JOIN_SECONDS = 10.0  # a worker asked to stop gets this long before it is terminated
log = logging.getLogger("minivllm.distributed")


def describe_exit(rank: int, process: Any) -> str:
    """'worker 1 (pid 1234) was killed by SIGKILL' / '... exited with code 1' / '... is running'."""
    code = process.exitcode
    if code is None:
        state = "is still running"
    elif code < 0:
        state = f"was killed by {signal.Signals(-code).name}"
    else:
        state = f"exited with code {code}"
    return f"tensor-parallel worker {rank} (pid {process.pid}) {state}"


def is_communication_error(error: BaseException) -> bool:
    """Whether a collective failed (a rank gone, a timeout), rather than rank 0's own arithmetic.
    gloo reports a closed connection as a plain RuntimeError that names its transport."""
    text = str(error).lower()
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and ("gloo" in text or "nccl" in text))


class Workers:
    """Rank 0's view of the other ranks: the processes it spawned (none under torchrun), the
    channel the step messages go through, and whether the group can still run a step. Kept
    apart from the runner so that a finalizer can stop them without keeping the runner alive."""

    def __init__(self, processes: list[Any], store: dist.Store | None):
        self.processes, self.store = processes, store  # processes[i] is rank i + 1
        self.group: RankGroup | None = None
        self.in_step = False  # a step was sent and has not come back: its collectives may be half done
        self.failure: str | None = None  # why the group cannot run a step any more
        self.stopped = False

    def error_of(self, rank: int) -> str:
        """The last line of the traceback a failed worker left in the store, if any."""
        key = f"error/{rank}"
        try:
            if self.store is not None and self.store.check([key]):
                return ": " + self.store.get(key).decode().strip().splitlines()[-1]
        except Exception:
            pass
        return ""

    def dead(self) -> str | None:
        """Which spawned worker is no longer running, and how it ended; None if all run."""
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                return describe_exit(rank, process) + self.error_of(rank)
        return None

    def wait_until_joined(self) -> None:
        """Wait until every spawned worker reaches the rendezvous (each has imported torch and
        minivllm, and holds rank 0's weights), so that a worker that fails on the way is
        reported at once instead of leaving rank 0 waiting in init_process_group."""
        deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
        waiting = set(range(1, len(self.processes) + 1))
        while waiting:
            waiting = {r for r in waiting if not self.store.check([f"joined/{r}"])}
            dead = self.dead()
            if dead:
                raise RuntimeError(f"{dead} while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers {sorted(waiting)} did not start within "
                                   f"{STARTUP_TIMEOUT.total_seconds():.0f} s")
            time.sleep(0.05)

    def check(self) -> None:
        """Raise RuntimeError if the group cannot run a step (checked before every step)."""
        if self.failure is None and self.in_step:
            self.failure = "a step was interrupted halfway (its collectives may be half done)"
        if self.failure is None:
            dead = self.dead()
            if dead:
                self.failure = dead
        if self.failure is not None:
            raise RuntimeError(f"tensor parallelism failed: {self.failure}; this engine cannot run any more "
                               "steps: create a new one")

    def fail(self, error: BaseException) -> RuntimeError:
        """The error to raise when a step's collectives failed: most likely a rank died (its
        connections closed), so give its process a moment to be reaped and name it."""
        deadline = time.monotonic() + 2.0
        dead = self.dead()
        while dead is None and self.processes and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = self.dead()
        self.failure = f"{dead or 'a rank stopped answering'} during a step ({type(error).__name__}: {error})"
        return RuntimeError(f"tensor parallelism failed: {self.failure}; this engine cannot run any more steps: "
                            "create a new one")

    def stop(self) -> None:
        """Stop every worker and leave the process group; safe to call twice, and at exit."""
        if self.stopped:
            return
        self.stopped = True
        clean = self.group is not None and self.failure is None and not self.in_step and self.dead() is None
        if clean:
            try:
                self.group.channel.send(None)  # STOP: every worker returns from serve() and exits
            except Exception:
                pass
        for process in self.processes:
            process.join(JOIN_SECONDS if clean else 0.5)
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join(2.0)
        if self.group is not None:
            leave()


class TensorParallelRunner(ModelRunner):
    """Rank 0 of config.tensor_parallel_size ranks: a ModelRunner over rank 0's shard of `model`
    (the engine keeps `model` itself, for its settings) that sends every step to the other ranks
    before running its own share. graph_class: as for ModelRunner (EagerGraph on a CPU, in tests).

    Under torchrun, on ranks other than 0 the constructor serves as a worker until rank 0 stops,
    then ends the process (SystemExit(0)): the rest of the program runs on rank 0 only."""

    def __init__(self, model: Decoder, config: EngineConfig, graph_class: type = CudaGraph):
        n = config.tensor_parallel_size
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group (another tensor-parallel "
                               "engine?): one per process; shut the other down first (engine.core.runner.shutdown())")
        launched = torchrun_rank()
        if launched is not None:
            rank, world_size, local_rank = launched
            if world_size != n:
                raise ValueError(f"torchrun started {world_size} processes but tensor_parallel_size={n}: they must agree")
            group = join(rank, n, rank_device(model.device, local_rank))
            if rank != 0:
                try:
                    serve(start_worker(model, group, graph_class), group)
                finally:
                    leave()
                raise SystemExit(0)
            self.workers = Workers([], None)
        else:
            self.workers = self._spawn(model, n, graph_class)
            group = None
        # From here on, whatever happens, the workers go when this runner does (or when it fails to start).
        self._finalizer = weakref.finalize(self, self.workers.stop)
        try:
            if group is None:
                self.workers.wait_until_joined()
                group = join(0, n, rank_device(model.device, 0), self.workers.store)
            self.workers.group = group
            share_config(group, config)
            # Rank 0's runner, built as every rank builds its own (worker.build_runner), at the same time.
            super().__init__(make_shard(model, group), config, graph_class)
            dist.barrier(group=group.channel.group)  # every rank is ready
        except BaseException as error:
            dead = self.workers.dead()
            self.shutdown()
            if dead and is_communication_error(error):  # rank 0 lost a worker: say which, and how it ended
                raise RuntimeError(f"tensor parallelism could not start: {dead}") from error
            raise
        self.group = group
        log.info("tensor parallelism: %d ranks, %s backend, rank 0 in this process (pid %d)", n,
                 dist.get_backend(), os.getpid())

    def _spawn(self, model: Decoder, n: int, graph_class: type) -> Workers:
        """Start ranks 1 .. n-1 on this machine, around a rendezvous on 127.0.0.1."""
        refuse_unguarded_start()
        port = free_port()
        store = dist.TCPStore("127.0.0.1", port, n, is_master=True, timeout=STARTUP_TIMEOUT, wait_for_workers=False)
        context = mp.get_context("spawn")  # a fresh interpreter: fork would copy this process's threads and CUDA state
        processes = []
        for rank in range(1, n):
            spec = WorkerSpec(rank, n, port, model, graph_class, torch.get_num_threads(), os.getpid())
            process = context.Process(target=spawned_worker, args=(spec,), name=f"minivllm-tp-{rank}", daemon=True)
            process.start()
            processes.append(process)
        return Workers(processes, store)

    @property
    def pids(self) -> list[int]:
        """The spawned workers' process ids (none under torchrun)."""
        return [p.pid for p in self.workers.processes]

    @torch.inference_mode()
    def execute(self, plan: StepPlan, flat: torch.Tensor | None = None
                ) -> tuple[list[int], torch.Tensor, dict[int, torch.Tensor]]:
        """Send the plan to every other rank, then run rank 0's share of it (ModelRunner.execute)."""
        self.workers.check()
        self.workers.in_step = True
        try:
            self.group.channel.send(plan)
            out = super().execute(plan, flat)
        except Exception as error:
            if not is_communication_error(error):
                # Rank 0's own share failed (a bug, an exercise still a stub): that error, as it is. The
                # other ranks wait inside the step for rank 0, so this group cannot run another one.
                self.workers.failure = f"rank 0 failed inside a step ({type(error).__name__}: {error})"
                raise
            raise self.workers.fail(error) from error  # a collective failed: most likely a rank is gone
        self.workers.in_step = False
        return out

    def shutdown(self) -> None:
        """Stop the other ranks and leave the process group. The engine cannot run afterwards."""
        self._finalizer()
