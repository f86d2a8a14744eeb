"""The frontend's end of the core process (chapter 15): start it, send it messages, read what
it sends, and notice at once when it dies.

The two ZMQ sockets are bound here and connected from the core, on IPC paths in a fresh
temporary folder, so two servers on one machine never meet. The process is spawned (a clean
interpreter: no copy of the frontend's threads or event loop) and daemonic, and it asks the
kernel to end it with its parent (core/process.py): a frontend that exits, however it exits, takes its
core with it.

With several API server processes (issue 48, `minivllm serve --api-server-count N`), the cores
are started by the parent of the API servers, not by one of them: each API server reaches them
through an `AttachedCoreClient`, which binds its own pair of each core's addresses, watches the
core by its pid and leaves stopping it to the parent.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import zmq
import zmq.asyncio

from minivllm.config.engine import EngineConfig
from minivllm.core.process import run_core
from minivllm.executor.main_guard import refuse_unguarded_start
from minivllm.request.messages import (
    FromCore,
    Ready,
    Shutdown,
    ToCore,
    encoder,
    from_core_decoder,
)

START_TIMEOUT = 300.0  # seconds the core may take to load its model and say Ready
WATCH_SECONDS = 0.25  # while no message comes, how often the reader checks that the core still lives


class CoreDied(RuntimeError):
    """The core process is gone (its exit code in the message)."""


@dataclass(frozen=True)
class CoreAddresses:
    """A core process already running, as one API server reaches it: its pid and the ZMQ
    addresses this API server binds (requests in, outputs out)."""

    pid: int
    inbox: str
    outbox: str


@dataclass(frozen=True)
class RunningCores:
    """What API server `index` of `count` needs to serve from the core processes its parent
    started: one CoreAddresses per core (more than one: data parallelism)."""

    cores: list[CoreAddresses]
    index: int
    count: int


class CoreProcessClient:
    """model: a Decoder (sent to the new process) or a source for it to load; config: the
    engine's EngineConfig (resolved there); tokenizer: for grammars (None: loaded with the
    source). threads: torch's CPU threads in the core (None: torch's default)."""

    def __init__(self, model: Any, config: EngineConfig, tokenizer: Any = None, device: str | None = None,
                 dtype: torch.dtype | None = None, threads: int | None = None):
        self._args = (model, config, tokenizer)
        self._options = {"device": device, "dtype": dtype, "threads": threads}
        self.process: multiprocessing.Process | None = None
        self.info: dict[str, Any] = {}
        self.config: EngineConfig | None = None  # resolved by the core
        self._folder: str | None = None
        self._context: zmq.asyncio.Context | None = None

    async def start(self) -> None:
        """Start the process and wait until it is Ready (CoreDied if it fails first)."""
        refuse_unguarded_start()
        self._folder = tempfile.mkdtemp(prefix="minivllm-core-")
        inbox, outbox = f"ipc://{Path(self._folder) / 'in'}", f"ipc://{Path(self._folder) / 'out'}"
        self._bind(inbox, outbox)
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(target=run_core, args=(*self._args, [inbox], [outbox]), kwargs=self._options,
                                     name="minivllm-core", daemon=True)
        self.process.start()
        await self._handshake()

    def _bind(self, inbox: str, outbox: str) -> None:
        self._context = zmq.asyncio.Context()
        self._push, self._pull = self._context.socket(zmq.PUSH), self._context.socket(zmq.PULL)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(inbox)
        self._pull.bind(outbox)

    async def _handshake(self) -> None:
        """Wait for the core's Ready and its facts; on any failure, clean up and raise."""
        try:
            ready = await asyncio.wait_for(self.receive(), START_TIMEOUT)
            if not isinstance(ready, Ready):
                raise CoreDied(f"the engine core did not start: {getattr(ready, 'message', ready)}")
            self.info, self.config = await self._pull.recv_pyobj()
        except BaseException:  # a server that fails to start never shuts down: clean up here
            self.shutdown()
            raise

    def send(self, message: ToCore) -> None:
        """Queue a message for the core (never waits: ZMQ buffers it)."""
        self._push.send(encoder.encode(message), flags=zmq.NOBLOCK)

    async def receive(self) -> FromCore:
        """The core's next message; CoreDied if the process has exited and sent nothing more."""
        while True:
            if await self._pull.poll(WATCH_SECONDS * 1000):
                return from_core_decoder.decode(await self._pull.recv())
            if not self.alive:
                raise CoreDied(self._death())

    def _death(self) -> str:
        return f"the engine core process exited (exit code {self.process.exitcode})"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to stop after its current step; if it does not within `timeout`, end it."""
        if self.process is not None and self.process.is_alive():
            try:
                self.send(Shutdown())
            except zmq.ZMQError:
                pass
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self._close()

    def _close(self) -> None:
        if self._context is not None:
            self._push.close(linger=0)
            self._pull.close(linger=0)
            self._context.term()
            self._context = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


class AttachedCoreClient(CoreProcessClient):
    """A core process that the parent of the API servers started and will stop: this API server
    binds its own pair of the core's addresses, waits for its Ready, and watches it by its pid
    (it is a sibling, not a child: no exit code to read). index/count: which API server this
    is, of how many (shown in /server_info)."""

    def __init__(self, core: CoreAddresses, index: int = 0, count: int = 1):
        super().__init__(None, None)
        self.core, self.index, self.count = core, index, count

    async def start(self) -> None:
        self._bind(self.core.inbox, self.core.outbox)
        try:
            self.process = psutil.Process(self.core.pid)
        except psutil.NoSuchProcess:
            self._close()
            raise CoreDied(f"the engine core process (pid {self.core.pid}) is not running") from None
        await self._handshake()
        self.info = dict(self.info, api_server_index=self.index, api_server_count=self.count,
                         api_server_pid=os.getpid())

    @property
    def alive(self) -> bool:
        try:
            return self.process is not None and self.process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:  # psutil.Process also tells a new process that reused the pid
            return False

    def _death(self) -> str:
        return f"the engine core process (pid {self.core.pid}) exited"

    def shutdown(self, timeout: float = 10.0) -> None:
        """Close this API server's sockets; the core serves the others until the parent stops it."""
        self._close()
