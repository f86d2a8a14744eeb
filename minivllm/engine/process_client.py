"""The frontend's end of the core process (chapter 15): start it, send it messages, read what
it sends, and notice at once when it dies.

The two ZMQ sockets are bound here and connected from the core, on IPC paths in a fresh
temporary folder, so two servers on one machine never meet. The process is spawned (a clean
interpreter: no copy of the frontend's threads or event loop) and daemonic, and it asks the
kernel to end it with its parent (core/process.py): a frontend that exits, however it exits, takes its
core with it.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import shutil
import tempfile
from pathlib import Path
from typing import Any

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
        self._context = zmq.asyncio.Context()
        self._push, self._pull = self._context.socket(zmq.PUSH), self._context.socket(zmq.PULL)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(inbox)
        self._pull.bind(outbox)
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(target=run_core, args=(*self._args, inbox, outbox), kwargs=self._options,
                                     name="minivllm-core", daemon=True)
        self.process.start()
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
            if not self.process.is_alive():
                raise CoreDied(f"the engine core process exited (exit code {self.process.exitcode})")

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
        if self._context is not None:
            self._push.close(linger=0)
            self._pull.close(linger=0)
            self._context.term()
            self._context = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
