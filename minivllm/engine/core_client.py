"""The one seam between the frontend and the engine core: a client, chosen in one place.

The frontend (LLMEngine, AsyncLLM) checks and tokenizes requests, and turns the core's news into
text; the core schedules, runs the model and samples. Between them only the messages of
request/messages.py pass, so where the core runs is a choice of client, made by `make_client`:

    core in this thread   InprocClient        EngineCore called directly: a laptop, the tests,
                                              chapters 7-14 (and tensor parallelism's rank 0)
    core in a process     CoreProcessClient   one core process over ZMQ (chapter 15)
    N copies              DataParallelClient  N core processes behind a router (chapter 14)
    cores already running AttachedCoreClient  one API server of several (issue 48): the cores are
                                              its parent's, it binds its own pair of their sockets

The process clients are asynchronous (the server's event loop reads them); LLMEngine is
synchronous, so it drives them through `SyncClient`, which runs their event loop in a thread of
its own. Every client answers the same calls: add a request, abort requests, stop completions,
get the next output, shut down.
"""
from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

import torch

from minivllm.config.engine import EngineConfig
from minivllm.core.engine_core import EngineCore
from minivllm.engine.data_parallel import DataParallelClient
from minivllm.engine.process_client import (
    AttachedCoreClient,
    CoreProcessClient,
    RunningCores,
)
from minivllm.executor.group import torchrun_rank
from minivllm.executor.main_guard import refuse_unguarded_start
from minivllm.loader import load_tokenizer
from minivllm.model import Decoder
from minivllm.request.messages import (
    Abort,
    AddRequest,
    EngineCoreRequest,
    Failed,
    FromCore,
    Refused,
    StepOutputs,
    StopSequences,
)


class InprocClient:
    """The core in the caller's thread: each get_output() runs one step. A request the core
    refuses raises its ValueError from add_request, touching nothing."""

    remote = False

    def __init__(self, core: EngineCore):
        self.core = core
        self.config: EngineConfig = core.config
        self.info: dict[str, Any] = core.info()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def stop_sequences(self, sequences: list[tuple[str, int]]) -> None:
        self.core.abort_sequences(sequences)

    def get_output(self) -> StepOutputs:
        start = time.perf_counter()
        outputs = self.core.step()
        return StepOutputs(outputs, self.core.stats(), start, time.perf_counter())

    def shutdown(self) -> None:
        """Nothing runs but the caller's thread: nothing to stop."""


class SyncClient:
    """A process client (CoreProcessClient or DataParallelClient) for synchronous callers: its
    event loop runs in a thread of its own, and each call waits for its result there, so it
    works from any caller, a notebook's running event loop included. Refusals and failures come
    back from get_output(), as the core sends them."""

    remote = True

    def __init__(self, client: CoreProcessClient | DataParallelClient):
        self.async_client = client
        self._loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self._loop.run_forever, name="minivllm-core-client", daemon=True)
        thread.start()
        self._finalizer = weakref.finalize(self, _stop, client, self._loop, thread)
        self._receiving: Future | None = None  # a receive() that a Ctrl-C left waiting: the next call takes it
        try:
            self._wait(client.start())
        except BaseException:  # a core that fails to start: stop the loop's thread too, then say why
            self._finalizer()
            raise
        self.config: EngineConfig = client.config
        self.info: dict[str, Any] = client.info

    @property
    def alive(self) -> bool:
        return self._finalizer.alive and self.async_client.alive

    def add_request(self, request: EngineCoreRequest) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("this engine's core processes were shut down")
        self._send(AddRequest(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if self.alive:
            self._send(Abort(request_ids))

    def stop_sequences(self, sequences: list[tuple[str, int]]) -> None:
        self._send(StopSequences(sequences))

    def get_output(self) -> FromCore:
        """The next message of the core(s). Raises CoreDied if a core process has died."""
        if self._receiving is None:
            self._receiving = asyncio.run_coroutine_threadsafe(self.async_client.receive(), self._loop)
        try:
            return self._receiving.result()
        finally:
            if self._receiving.done():
                self._receiving = None

    def shutdown(self) -> None:
        """Stop every core (each after its current step) and the event loop's thread."""
        self._finalizer()

    def _send(self, message: Any) -> None:
        """Call the client on its event loop: zmq.asyncio's sockets look for the running loop."""
        async def call() -> None:
            self.async_client.send(message)

        self._wait(call())

    def _wait(self, coroutine: Coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()


def _stop(client: Any, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    async def stop() -> None:
        client.shutdown()  # on the loop, as every call to the client; it cancels its readers
        await asyncio.sleep(0)  # and here they finish

    asyncio.run_coroutine_threadsafe(stop(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


def make_client(model: Any, config: EngineConfig, tokenizer: Any = None, device: str | None = None,
                dtype: torch.dtype | None = None, *, multiprocess: bool = False, asyncio_mode: bool = False,
                threads: int | None = None) -> tuple[Any, Any]:
    """The client for an engine, and the frontend's tokenizer. The only place that decides where
    the core runs: data_parallel_size > 1 is N core processes (chapter 14's copies); otherwise
    `multiprocess` puts the one core in a process of its own (chapter 15), else it runs in the
    caller's thread. asyncio_mode: the server's event loop reads the client itself (AsyncLLM;
    not started yet: `await client.start()`); otherwise a synchronous client (LLMEngine).
    model/tokenizer/device/dtype: as for LLMEngine; threads: torch's CPU threads in each core
    process (None: this process's, shared among N copies). model may also be RunningCores, the
    cores of `minivllm serve --api-server-count N` that this API server attaches to (asyncio_mode;
    the tokenizer is then the caller's to give)."""
    if isinstance(model, RunningCores):
        cores = [AttachedCoreClient(core, model.index, model.count) for core in model.cores]
        client = DataParallelClient(None, config, cores=cores) if len(cores) > 1 else cores[0]
        return client, tokenizer
    spawns_ranks = config.tensor_parallel_size > 1 and torchrun_rank() is None  # torchrun starts its ranks itself
    if config.data_parallel_size > 1 or spawns_ranks or multiprocess or asyncio_mode:
        refuse_unguarded_start()  # before loading anything: a script without the main guard ends here
    if not isinstance(model, Decoder):
        tokenizer = tokenizer or load_tokenizer(model)
    if config.data_parallel_size > 1 or multiprocess or asyncio_mode:
        if threads is None:
            threads = max(1, torch.get_num_threads() // config.data_parallel_size)
        if config.data_parallel_size > 1:
            client = DataParallelClient(model, config, tokenizer, device, dtype, threads)
        else:
            client = CoreProcessClient(model, config, tokenizer, device, dtype, threads)
        return (client if asyncio_mode else SyncClient(client)), tokenizer
    core = EngineCore.load(model, config, tokenizer, device, dtype)
    return InprocClient(core), core.tokenizer


def refusal_error(message: Refused | Failed) -> Exception:
    """What a frontend raises for a core's Refused (the request alone) or Failed (the core)."""
    if isinstance(message, Refused):
        return ValueError(f"request {message.request_id!r}: {message.message}")
    return RuntimeError(f"an engine core failed: {message.message}")


