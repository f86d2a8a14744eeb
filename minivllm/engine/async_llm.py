"""The server's frontend over a core process (chapter 15): what `AsyncEngine` does with a thread,
done with a process, so that HTTP and the model no longer share one GIL.

    frontend process (this event loop)                       core process (core/process.py)
    add():   InputProcessor: checks, token ids ── AddRequest ──►  between two steps, take it in
    reader:  OutputProcessor: text, stop strings ◄── StepOutputs ─  EngineCore.step(), then send its news
             -> RequestStreams, /metrics          ── StopSequences ► (a stop string ended a completion)
    abort(): at once                              ── Abort ───────►

Everything a user reads is built here, on the event loop, while the core already computes its
next step. The core's gauges (running, waiting, KV use) come with every StepOutputs.

Failure: a request the core refuses fails alone (its stream raises); if the core process dies,
every request in flight gets EngineFailed at once (the reader notices within
engine.process_client.WATCH_SECONDS), /health turns 503, and `on_core_death` is called (the CLI
stops the server, which then exits non-zero).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from minivllm.config.engine import EngineConfig
from minivllm.engine.async_engine import (
    EngineDead,
    EngineFailed,
    Overloaded,
    RequestStream,
)
from minivllm.engine.core_client import make_client
from minivllm.engine.input_processor import InputProcessor, Prompt
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.metrics import ServerMetrics
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.process_client import CoreDied
from minivllm.request.messages import (
    Abort,
    AddRequest,
    Failed,
    Refused,
    StepOutputs,
    StopSequences,
    Taken,
)
from minivllm.request.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger("minivllm.entrypoints.openai")

# How long the reader may keep the event loop while the core's messages wait (see _read): the
# most a chunk or a new request's handler waits for it, and the window in which a stream that
# is behind merges several steps into one chunk.
HOLD_SECONDS = 0.010


class RequestFailed(RuntimeError):
    """The core could not process this one request (the others carry on): a 500."""


class AsyncLLM:
    """The core-process engine for the server: `await start()`, then `await add(...)` and `async
    for output in stream`, as with AsyncEngine. model/config/tokenizer/device/dtype/threads: as
    for CoreProcessClient; the tokenizer is also the frontend's (text in, text out)."""

    def __init__(self, model: Any, config: EngineConfig, tokenizer: Any, device: str | None = None,
                 dtype: torch.dtype | None = None, threads: int | None = None, max_waiting: int = 512,
                 metrics: ServerMetrics | None = None, on_core_death: Callable[[], None] | None = None):
        if not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting must be an integer >= 1, got {max_waiting!r}")
        # One core process, or N copies (chapter 14): the client's choice, made in make_client.
        self.client, tokenizer = make_client(model, config, tokenizer, device, dtype, asyncio_mode=True, threads=threads)
        self.tokenizer, self.max_waiting = tokenizer, max_waiting
        self.metrics = metrics or ServerMetrics()
        self.on_core_death = on_core_death
        self.error: BaseException | None = None  # why the core stopped serving
        self.input_processor: InputProcessor | None = None  # made once the core has resolved the config
        self.output_processor = OutputProcessor(tokenizer)
        self._streams: dict[str, RequestStream] = {}
        self._waiting = 0  # the core's count at its last message
        self._steps_taken = 0  # the core's steps whose outputs have reached their streams
        self._reader: asyncio.Task | None = None
        self.step_times: deque[tuple[float, float]] = deque(maxlen=1000)  # the core's last steps (start, end)

    @classmethod
    def from_engine(cls, engine: LLMEngine, **options: Any) -> AsyncLLM:
        """A core process with `engine`'s model, settings and tokenizer (the tests' and the
        notebooks' way: they hold an LLMEngine already), and this thread's torch CPU threads."""
        options.setdefault("threads", torch.get_num_threads())
        return cls(engine.model, engine.config, engine.tokenizer, **options)

    async def start(self) -> None:
        await self.client.start()
        self.input_processor = InputProcessor(self.tokenizer, self.client.info["vocab_size"], self.client.config)
        self.metrics.describe_engine(self.client.info)
        self._reader = asyncio.create_task(self._read(), name="minivllm-core-reader")

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.client.shutdown(timeout)
        self._fail_everyone(EngineDead("the server is shutting down"))

    @property
    def alive(self) -> bool:
        return self.error is None and self.client.alive

    @property
    def max_model_len(self) -> int:
        return self.client.info["max_model_len"]

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return self.input_processor.tokenize(prompt)

    def engine_info(self) -> dict[str, Any]:
        return dict(self.client.info, core_pid=self.client.process.pid)

    async def add(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> RequestStream:
        """Check the request here and send it to the core; returns its stream at once. Raises
        ValueError if it cannot be served, Overloaded if too many wait, EngineFailed/EngineDead
        if the core is gone."""
        if self.error is not None:
            raise EngineFailed(self.error)
        if not self.alive:
            raise EngineDead("the engine is not running")
        if self._waiting >= self.max_waiting:
            raise Overloaded(f"{self._waiting} requests are already waiting (max_waiting={self.max_waiting}); "
                             f"try again later")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, request = self.input_processor.process(request_id, prompt, params, time.perf_counter())
        stream = RequestStream(request_id, delta=params.output_kind is RequestOutputKind.DELTA)
        self._streams[request_id] = stream
        self.output_processor.add_request(request, text)
        self.metrics.request_started(request_id, request.arrival_time, params)
        self._waiting += 1  # until the core's next count
        self.client.send(AddRequest(request))
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request: the core frees its blocks before its next step (unknown ids are ignored)."""
        if self._streams.pop(request_id, None) is None:
            return
        self.output_processor.abort_request(request_id)
        self.metrics.request_aborted(request_id)
        if self.client.alive:
            self.client.send(Abort([request_id]))

    async def _read(self) -> None:
        """The core's messages, as they come, until it dies or the server stops.

        A message that is already there completes `receive()` without a pause, so while the
        frontend is behind the core the reader takes in several steps in a row, and each stream
        merges them (RequestStream: output coalescing): its client then gets one chunk, one
        event, one socket write for those steps, which is what lets a saturated frontend catch
        up. It keeps the loop for at most HOLD_SECONDS before giving it a turn: otherwise the
        HTTP handlers would starve (new requests would wait for the whole backlog to reach
        their first token)."""
        last_turn = time.perf_counter()
        try:
            while True:
                message = await self.client.receive()
                if isinstance(message, StepOutputs):
                    self._take_step(message)
                elif isinstance(message, Refused):
                    self._refused(message)
                elif isinstance(message, Failed):
                    raise CoreDied(f"the engine core failed: {message.message}")
                if time.perf_counter() - last_turn >= HOLD_SECONDS:
                    await asyncio.sleep(0)
                    last_turn = time.perf_counter()
        except CoreDied as err:
            log.error("%s", err)
            self.error = err
            self._fail_everyone(EngineFailed(err))
            if self.on_core_death is not None:
                self.on_core_death()

    def _take_step(self, message: StepOutputs) -> None:
        outputs, stopped = self.output_processor.process_outputs(message.outputs)
        if stopped:
            self.client.send(StopSequences(stopped))
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
                if output.finished:
                    del self._streams[output.request_id]
        stats = message.stats
        self._waiting = stats.waiting
        self.metrics.step_outputs(outputs, time.perf_counter())
        self.metrics.engine_state(stats.running, stats.waiting, stats.kv_cache_usage, stats.prefix_queried_tokens,
                                  stats.prefix_hit_tokens, stats.spec, stats.num_preemptions, stats.waiting_deferred)
        if message.step_end:
            self.step_times.append((message.step_start, message.step_end))
            self._steps_taken += 1
            self.client.send(Taken(self._steps_taken))  # the core runs at most a step or two ahead (core/process.py)

    def _refused(self, message: Refused) -> None:
        stream = self._streams.pop(message.request_id, None)
        self.output_processor.abort_request(message.request_id)
        self.metrics.request_aborted(message.request_id)
        if stream is not None:
            stream.put(ValueError(message.message) if message.bad_request else RequestFailed(message.message))

    def _fail_everyone(self, err: BaseException) -> None:
        for stream in self._streams.values():
            stream.put(err)
        self._streams.clear()
