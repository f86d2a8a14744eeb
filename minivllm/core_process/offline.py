"""Chapter 14's copies for offline batches: `LLM(model, data_parallel_size=N)`.

LLMEngine's surface (add_request, step, abort_request, has_unfinished_requests) with its one
in-thread core replaced by N core processes behind a DataParallelClient, as the server has them:

    add_request ──► InputProcessor ──► DataParallelClient ──► N EngineCores ──► OutputProcessor
                    (here)             (here: routes)         (processes)       (here)

One `step()` takes the next StepOutputs of whichever core sends first, so the copies run side by
side while this thread turns their news into RequestOutputs. The client is asynchronous (it is
the server's); this engine runs it on an event loop in a thread of its own and waits for each
call there, so it works from any caller, a notebook's running event loop included.
(vLLM's offline `LLM` refuses data_parallel_size > 1 and asks for one process per copy.)
"""
from __future__ import annotations

import asyncio
import threading
import weakref
from concurrent.futures import Future
from collections.abc import Iterable
from typing import Any

import torch

from minivllm.core_process.client import CoreDied
from minivllm.core_process.data_parallel import DataParallelClient
from minivllm.core_process.messages import Abort, AddRequest, Failed, Refused, StepOutputs, StopSequences
from minivllm.engine.config import EngineConfig
from minivllm.engine.input_processor import InputProcessor, Prompt
from minivllm.engine.output_processor import OutputProcessor, RequestState
from minivllm.engine.outputs import RequestOutput
from minivllm.engine.sampling_params import SamplingParams
from minivllm.loader import load_tokenizer
from minivllm.model import Decoder


class DataParallelEngine:
    """model/tokenizer/device/dtype: as for LLMEngine (a source is loaded by each core, not
    here); config: an EngineConfig with data_parallel_size > 1. On a CPU the copies share this
    process's torch threads (each core gets its 1/N of them, at least one); on CUDA core i runs
    on GPU i. Call shutdown() when done (it is also called when the engine is collected)."""

    def __init__(self, model: Any, config: EngineConfig, tokenizer: Any = None, device: str | None = None,
                 dtype: torch.dtype | None = None):
        if not isinstance(config, EngineConfig) or config.data_parallel_size < 2:
            raise ValueError(f"DataParallelEngine runs copies: it needs an EngineConfig with data_parallel_size >= 2, "
                             f"got {config!r}")
        if not isinstance(model, Decoder):
            tokenizer = tokenizer or load_tokenizer(model)
        self.tokenizer = tokenizer
        threads = max(1, torch.get_num_threads() // config.data_parallel_size)
        self.client = DataParallelClient(model, config, tokenizer, device, dtype, threads)
        self._loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self._loop.run_forever, name="minivllm-copies", daemon=True)
        thread.start()
        self._finalizer = weakref.finalize(self, _stop, self.client, self._loop, thread)
        self._receiving: Future | None = None  # a receive() that a Ctrl-C left waiting: the next step takes it
        try:
            self._wait(self.client.start())
        except BaseException:  # a core that fails to start: stop the loop's thread too, then say why
            self._finalizer()
            raise
        self.config: EngineConfig = self.client.config
        self.input_processor = InputProcessor(tokenizer, self.client.info["vocab_size"], self.config)
        self.output_processor = OutputProcessor(tokenizer)

    @property
    def requests(self) -> dict[str, RequestState]:
        """The requests not yet finished, by id."""
        return self.output_processor.requests

    @property
    def trace(self) -> None:
        return None  # each core steps in its own process: there is no step here to record

    @trace.setter
    def trace(self, trace: Any) -> None:
        if trace is not None:
            raise ValueError("a Trace records the steps of an engine in this process; with data_parallel_size > 1 "
                             "the steps run in the cores' processes (trace one engine: data_parallel_size=1)")

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_request(self, request_id: str | None = None, prompt: Prompt | None = None,
                    params: SamplingParams | None = None, arrival_time: float | None = None) -> str:
        """As LLMEngine.add_request: checked and tokenized here (ValueError, touching nothing),
        then sent to the core the router picks."""
        if not self._finalizer.alive:
            raise RuntimeError("this engine's cores were shut down")
        if prompt is None:
            raise ValueError("add_request needs a prompt: add_request(request_id=..., prompt=..., params=...)")
        text, request = self.input_processor.process(request_id, prompt, params, arrival_time)
        self.output_processor.add_request(request, text)
        self._on_loop(self.client.send, AddRequest(request))
        return request.request_id

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        ids = [rid for rid in ids if rid in self.requests]
        for rid in ids:
            self.output_processor.abort_request(rid)
        if ids and self.client.alive:
            self._on_loop(self.client.send, Abort(ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """The next step of any core, as RequestOutputs. Raises ValueError for a request a core
        refused (after forgetting it) and RuntimeError if a core failed or died."""
        if not self.has_unfinished_requests():
            return []
        if self._receiving is None:
            self._receiving = asyncio.run_coroutine_threadsafe(self.client.receive(), self._loop)
        try:
            message = self._receiving.result()
        except CoreDied as err:
            raise RuntimeError(f"an engine core died: {err}") from err
        finally:
            if self._receiving.done():
                self._receiving = None
        if isinstance(message, Refused):
            self.output_processor.abort_request(message.request_id)
            raise ValueError(f"request {message.request_id!r}: {message.message}")
        if isinstance(message, Failed):
            raise RuntimeError(f"an engine core failed: {message.message}")
        if not isinstance(message, StepOutputs):
            return []
        outputs, stopped = self.output_processor.process_outputs(message.outputs)
        if stopped:
            self._on_loop(self.client.send, StopSequences(stopped))  # stop strings end completions in their core too
        return outputs

    def _wait(self, coroutine: Any) -> Any:
        """Run a coroutine on the client's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _on_loop(self, function: Any, *args: Any) -> Any:
        """Call the client on its event loop: zmq.asyncio's sockets look for the running loop."""
        async def call() -> Any:
            return function(*args)

        return self._wait(call())

    def shutdown(self) -> None:
        """Stop every core (each after its current step) and close the event loop."""
        self._finalizer()


def _stop(client: DataParallelClient, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    async def stop() -> None:
        client.shutdown()  # on the loop, as every call to the client; it cancels its readers
        await asyncio.sleep(0)  # and here they finish

    asyncio.run_coroutine_threadsafe(stop(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()
