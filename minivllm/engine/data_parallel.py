"""Chapter 14, copies instead of splits: N engine cores, each a whole model with its own KV cache,
behind one frontend (vLLM's --data-parallel-size; SGLang's router).

A model that fits one device is rarely worth splitting (chapter 14's cost model): N copies of it
serve N times the batch with no communication at all inside a step. The only decision left is
which core a request goes to:

    least loaded      the core with the fewest requests running + waiting (its last report, plus
                      the requests sent to it since), the lowest index on a tie
    prefix preferred  the core whose prefix cache most likely holds the start of this prompt (the
                      blocks of the prompts sent to it), unless that core is busier than the least
                      loaded one by more than `prefix_slack` requests

`DataParallelClient` looks like one `CoreProcessClient` to the frontend (serving/async_llm.py): send(),
receive(), alive, shutdown(); it forwards each core's StepOutputs with the gauges summed over
the cores. Across machines, each core would bind its ZMQ sockets on a TCP address instead of an
IPC path, and this client would connect to them: nothing else changes, as no core talks to another.

Failure: if any core dies, receive() raises CoreDied (the frontend fails every request in flight
and stops), and shutdown() stops every core: nothing is left behind.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections import OrderedDict
from typing import Any

import torch
import zmq

from minivllm.config.engine import EngineConfig
from minivllm.engine.process_client import CoreDied, CoreProcessClient
from minivllm.request.messages import (
    Abort,
    AddRequest,
    EngineCoreStats,
    FromCore,
    Refused,
    Shutdown,
    StepOutputs,
    StopSequences,
    ToCore,
)

PREFIX_SLACK = 4  # requests a core may be busier than the least loaded one and still win by its prefix cache
REMEMBERED_BLOCKS = 4096  # prompt blocks remembered per core (the oldest forgotten first)


def choose_core(loads: list[int], prefix_hits: list[int] | None = None, prefix_slack: int = PREFIX_SLACK) -> int:
    """Which of N cores takes the next request.

    loads: each core's requests running + waiting (N >= 1 ints >= 0). prefix_hits: None, or for
    each core how many leading blocks of this request's prompt it likely has cached (N ints >= 0).
    prefix_slack: how many requests more than the least loaded core a core may have and still be
    chosen for its cache (an int >= 0).

    Returns the index of the least loaded core, the lowest index on a tie; except that when some
    core has prefix_hits > 0, the core with the most hits among those whose load is at most
    min(loads) + prefix_slack wins (on a tie of hits, the less loaded, then the lower index).
    Raises ValueError for an empty loads or prefix_hits of another length."""
    if not loads or (prefix_hits is not None and len(prefix_hits) != len(loads)):
        raise ValueError(f"one load per core, and as many prefix hits: got {loads!r} and {prefix_hits!r}")
    # BEGIN SOLUTION
    least = min(range(len(loads)), key=lambda i: (loads[i], i))
    if prefix_hits is None or max(prefix_hits) == 0:
        return least
    near = [i for i in range(len(loads)) if loads[i] <= loads[least] + prefix_slack]
    best = min(near, key=lambda i: (-prefix_hits[i], loads[i], i))
    return best if prefix_hits[best] > 0 else least
    # END SOLUTION


def core_device(device: str | None, index: int) -> str | None:
    """Where data-parallel core `index` runs: on CUDA, GPU index; more copies than GPUs share
    them in turn (two processes on one GPU take turns on it: that pays only where one core leaves
    the GPU idle between its steps). Elsewhere, `device` itself."""
    gpus = torch.cuda.device_count() if device is not None and torch.device(device).type == "cuda" else 0
    return f"cuda:{index % gpus}" if gpus else device


def prompt_blocks(token_ids: list[int], block_size: int) -> list[bytes]:
    """A key for each full block of the prompt that names the block and everything before it
    (as a prefix cache's block hashes do): equal keys, equal prefixes."""
    keys, digest = [], hashlib.sha256()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest.update(repr(token_ids[start:start + block_size]).encode())
        keys.append(digest.copy().digest())
    return keys


class DataParallelClient:
    """N CoreClients, one request to one core. model/config/tokenizer/device/dtype/threads: as
    for CoreProcessClient (config.data_parallel_size cores; each gets the config with size 1, and on
    CUDA core i runs on GPU i). prefer_prefix: route by prefix cache as well as by load. cores:
    clients of cores already running (an API server of several, issue 48: AttachedCoreClients)
    instead of starting new ones; then model, tokenizer, device, dtype and threads are unused.

    With several API servers, each routes its own requests: every core sends every API server
    its gauges each step, so the loads are the whole core's; the prefix blocks remembered are
    only this API server's prompts."""

    def __init__(self, model: Any, config: EngineConfig, tokenizer: Any = None, device: str | None = None,
                 dtype: torch.dtype | None = None, threads: int | None = None, prefer_prefix: bool = True,
                 cores: list[CoreProcessClient] | None = None):
        size = config.data_parallel_size
        if cores is not None:
            self.cores = cores
        else:
            one = dataclasses.replace(config, data_parallel_size=1)
            self.cores = [CoreProcessClient(model, one, tokenizer, core_device(device, i), dtype, threads)
                          for i in range(size)]
        size = len(self.cores)
        self.prefer_prefix = prefer_prefix
        self.loads = [0] * size  # each core's running + waiting: its last report plus what was sent since
        self.sent = [0] * size  # requests sent to each core, ever
        self.stats: list[EngineCoreStats | None] = [None] * size
        self.blocks: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(size)]
        self.owner: dict[str, list[int]] = {}  # request id -> [its core, its completions not finished]
        self.info: dict[str, Any] = {}
        self.config: EngineConfig | None = None
        self._queue: asyncio.Queue | None = None
        self._readers: list[asyncio.Task] = []

    async def start(self) -> None:
        """Start every core (side by side) and wait until all are Ready."""
        try:
            await asyncio.gather(*(core.start() for core in self.cores))
        except BaseException:
            self.shutdown()
            raise
        first = self.cores[0]
        self.config = dataclasses.replace(first.config, data_parallel_size=len(self.cores))
        self.info = dict(first.info, data_parallel_size=len(self.cores),
                         num_kv_blocks=sum(core.info["num_kv_blocks"] for core in self.cores),
                         core_pids=[core.process.pid for core in self.cores])
        self._queue = asyncio.Queue()
        self._readers = [asyncio.create_task(self._read(i)) for i in range(len(self.cores))]

    @property
    def process(self) -> Any:
        """The first core's process (the frontend names one pid; info["core_pids"] has them all)."""
        return self.cores[0].process

    async def _read(self, index: int) -> None:
        try:
            while True:
                await self._queue.put((index, await self.cores[index].receive()))
        except CoreDied as err:
            await self._queue.put((index, CoreDied(f"data-parallel core {index}: {err}")))

    def route(self, token_ids: list[int]) -> int:
        """The core for a prompt (choose_core), remembering its blocks there."""
        keys = prompt_blocks(token_ids, self.config.block_size) if self.prefer_prefix else []
        hits = None
        if keys:
            hits = []
            for blocks in self.blocks:
                n = 0
                while n < len(keys) and keys[n] in blocks:
                    n += 1
                hits.append(n)
        index = choose_core(self.loads, hits)
        remembered = self.blocks[index]
        for key in keys:
            remembered[key] = None
            remembered.move_to_end(key)
        while len(remembered) > REMEMBERED_BLOCKS:
            remembered.popitem(last=False)
        return index

    def send(self, message: ToCore) -> None:
        """A new request to the core route() picks; an abort or stop to the core that holds it.
        (Taken is not passed on: the frontend counts all the cores' steps together, so each runs free.)"""
        if isinstance(message, AddRequest):
            index = self.route(message.request.prompt_token_ids)
            self.owner[message.request.request_id] = [index, message.request.params.n]
            self.loads[index] += 1
            self.sent[index] += 1
            self._send(index, message)
        elif isinstance(message, Abort):
            for index in range(len(self.cores)):
                ids = [r for r in message.request_ids if self.owner.get(r, [None])[0] == index]
                if ids:
                    self._send(index, Abort(ids))
            for r in message.request_ids:
                self.owner.pop(r, None)
        elif isinstance(message, StopSequences):
            for index in range(len(self.cores)):
                mine = [s for s in message.sequences if self.owner.get(s[0], [None])[0] == index]
                if mine:
                    self._send(index, StopSequences(mine))
        elif isinstance(message, Shutdown):
            for index in range(len(self.cores)):
                self._send(index, message)

    def _send(self, index: int, message: ToCore) -> None:
        """To one core; a core that has died is left to its reader, which reports it (CoreDied)."""
        try:
            self.cores[index].send(message)
        except zmq.ZMQError:
            if self.cores[index].alive:
                raise

    async def receive(self) -> FromCore:
        """The next message of any core; its StepOutputs carry the gauges of all the cores."""
        index, message = await self._queue.get()
        if isinstance(message, CoreDied):
            raise message
        if isinstance(message, StepOutputs):
            self.stats[index] = message.stats
            self.loads[index] = message.stats.running + message.stats.waiting
            for output in message.outputs:
                owner = self.owner.get(output.request_id)
                if output.finish_reason is not None and owner is not None:
                    owner[1] -= 1
                    if owner[1] == 0:
                        del self.owner[output.request_id]
            message = StepOutputs(message.outputs, self._total(), message.step_start, message.step_end)
        elif isinstance(message, Refused):
            self.owner.pop(message.request_id, None)
        return message

    def _total(self) -> EngineCoreStats:
        known = [s for s in self.stats if s is not None]
        return EngineCoreStats(running=sum(s.running for s in known), waiting=sum(s.waiting for s in known),
                               kv_cache_usage=sum(s.kv_cache_usage for s in known) / len(self.cores),
                               prefix_queried_tokens=sum(s.prefix_queried_tokens for s in known),
                               prefix_hit_tokens=sum(s.prefix_hit_tokens for s in known), spec=None,
                               num_preemptions=sum(s.num_preemptions for s in known),
                               waiting_deferred=sum(s.waiting_deferred for s in known))

    @property
    def alive(self) -> bool:
        return all(core.alive for core in self.cores)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every core (each as CoreProcessClient.shutdown does)."""
        for task in self._readers:
            task.cancel()
        for core in self.cores:  # one after the other: each stops after its current step
            core.shutdown(timeout)
