"""The engine in the background (chapter 10): one thread owns the LLMEngine and steps it; the
asyncio event loop that serves HTTP never runs a model step.

    event loop (HTTP handlers)                        engine thread
    add():   inbox.put(accept)  ───────────────────►  between two steps, run what the inbox holds
             await accepted     ◄── call_soon_threadsafe ─  (engine.add_request / abort_request)
    stream:  async for output   ◄── call_soon_threadsafe ─  engine.step(): every output of the step
    abort(): inbox.put(abort)   ───────────────────►

Two rules make it safe. The LLMEngine is touched by its thread only: adds and aborts are
*handed* to it through a thread-safe inbox and run between two steps, so a request that
arrives during a step joins the batch at the next one. And asyncio objects (futures, queues)
are touched by the event loop only: the thread hands results back with
`loop.call_soon_threadsafe`, once per step for the whole batch.

Two admission policies share this loop. Continuous (the default): a request enters the engine
as soon as it arrives. Static (`static_batch_size=N`): requests queue here until the engine is
empty, then up to N of them enter together, and the next batch waits until all of those are
done — chapter 7's `serve_static` policy, served for real (a request that finishes early
leaves its batch, but nobody takes its place).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.metrics import ServerMetrics
from minivllm.engine.output_processor import merge_deltas
from minivllm.request.outputs import RequestOutput
from minivllm.request.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger("minivllm.entrypoints.openai")


class Overloaded(Exception):
    """More requests are waiting than `max_waiting`: the server says 503 instead of queueing."""


class EngineDead(RuntimeError):
    """The engine thread stopped: the server is shutting down (a 503: try again later)."""


class EngineFailed(EngineDead):
    """An engine step raised, so the engine thread stopped serving (a 500). Every request in
    flight and every later one is told what the step raised: in a student copy, the exercise
    whose stub it was."""

    def __init__(self, error: BaseException):
        super().__init__(f"an engine step failed, so the engine stopped: {type(error).__name__}: {error}")


class RequestStream:
    """One request's outputs, an async iterator fed by the engine thread (via the event loop).

    Output coalescing: a reader that fell behind gets everything it missed as one output, so
    under load a client gets fewer, larger chunks rather than a growing backlog (one event, one
    socket write for several steps). A cumulative output holds all the earlier ones, so the
    stream keeps just the newest; a DELTA one (`delta=True`) is merged into the unread one
    (merge_deltas: text, tokens, logprobs in order). An error replaces it, and ends the stream.
    No queue: one slot and, while the reader waits, one future, since this runs once per token
    of every stream."""

    def __init__(self, request_id: str, delta: bool = False):
        self.request_id, self.delta = request_id, delta
        self._newest: RequestOutput | BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._done = False

    def put(self, item: RequestOutput | BaseException) -> None:
        unread = self._newest
        if self.delta and isinstance(item, RequestOutput) and isinstance(unread, RequestOutput):
            item = merge_deltas(unread, item)
        self._newest = item
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    @property
    def done(self) -> bool:
        """True once the finished output (or an error) has been read."""
        return self._done

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        while self._newest is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item, self._newest = self._newest, None
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    async def final(self) -> RequestOutput:
        """Wait for the finished output (for requests that do not stream)."""
        output = None
        async for output in self:
            pass
        assert output is not None and output.finished
        return output


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several streams (a request's prompts) as they come, each as (its stream's
    index, output), until every stream has finished. One read waits on each unfinished stream;
    those left waiting when the reader stops (a client gone) are cancelled."""
    if len(streams) == 1:  # the common case: no task per output to wait on several streams
        async for output in streams[0]:
            yield 0, output
        return

    def read(i: int) -> asyncio.Future:
        return asyncio.ensure_future(anext(streams[i]))

    waiting = {read(i): i for i in range(len(streams))}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for read_done in sorted(done, key=waiting.get):  # outputs of one step: in prompt order
                i = waiting.pop(read_done)
                yield i, read_done.result()  # an engine failure is raised here
                if not streams[i].done:
                    waiting[read(i)] = i
    finally:
        for pending in waiting:
            pending.cancel()


@dataclass
class _Request:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float  # time.perf_counter(), when the server received it
    stream: RequestStream
    accepted: asyncio.Future  # resolved once the engine took the request, or refused it


class AsyncEngine:
    """Serves an LLMEngine to asyncio code: `await add(...)` then `async for output in stream`.

    max_waiting: how many requests may wait (queued, not yet running) before new ones are
    refused with Overloaded. static_batch_size: None for continuous batching, N for static
    batches of up to N requests."""

    def __init__(self, engine: LLMEngine, max_waiting: int = 512, static_batch_size: int | None = None,
                 metrics: ServerMetrics | None = None):
        if not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting must be an integer >= 1, got {max_waiting!r}")
        if static_batch_size is not None and (not isinstance(static_batch_size, int) or static_batch_size < 1):
            raise ValueError(f"static_batch_size must be None or an integer >= 1, got {static_batch_size!r}")
        self.engine, self.max_waiting, self.static_batch_size = engine, max_waiting, static_batch_size
        self.metrics = metrics or ServerMetrics()
        self.error: BaseException | None = None  # why the engine thread stopped serving
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()  # None: stop
        self._streams: dict[str, RequestStream] = {}  # requests in the engine (engine thread only)
        self._batch_queue: deque[_Request] = deque()  # static mode: waiting for the engine to empty
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- called on the event loop ----

    def start(self) -> None:
        """Start the engine thread; call it from the event loop that will read the streams."""
        self._loop = asyncio.get_running_loop()
        self.metrics.describe_engine(self.engine_info())
        self._thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread after its current step; unfinished requests get EngineDead."""
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(None)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """The engine's own checks and tokenizer (they read only what never changes: any thread may call them)."""
        return self.engine.tokenize(prompt)

    def engine_info(self) -> dict[str, Any]:
        """The engine's facts for /server_info: its core's, as a core process reports them."""
        return self.engine.core.info()

    async def add(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> RequestStream:
        """Queue a request; returns its stream once the engine has taken it. Raises ValueError
        if the engine refuses it, Overloaded if too many are waiting, EngineFailed if a step
        failed, EngineDead if the engine stopped. In static mode the engine takes it when its
        batch starts."""
        if self.error is not None:
            raise EngineFailed(self.error)
        if not self.alive:
            raise EngineDead("the engine is not running")
        stream = RequestStream(request_id, delta=params.output_kind is RequestOutputKind.DELTA)
        accepted = self._loop.create_future()
        self._inbox.put(partial(self._accept, _Request(request_id, prompt, params, time.perf_counter(), stream, accepted)))
        try:
            await accepted
        except asyncio.CancelledError:  # the client left before its request started
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks before the next step (unknown ids are ignored)."""
        self._inbox.put(partial(self._abort, request_id))

    # ---- the engine thread ----

    def _run(self) -> None:
        torch.set_grad_enabled(False)  # grad mode is per thread: the engine's thread needs its own
        while self._run_inbox(block=not self._has_work()):
            if self.error is not None:
                continue
            try:
                self._start_static_batch()
                if self.engine.has_unfinished_requests():
                    self._publish(self.engine.step())
                self._update_stats()
            except Exception as err:  # a failed step: every request is told, the server reports unhealthy
                log.exception("engine step failed")
                self.error = err
                self._fail_everyone(EngineFailed(err))
        self._fail_everyone(EngineDead("the server is shutting down"))

    def _has_work(self) -> bool:
        return self.error is None and (self.engine.has_unfinished_requests() or bool(self._batch_queue))

    def _run_inbox(self, block: bool) -> bool:
        """Run every command in the inbox (waiting for one if `block`); False means stop."""
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for command in commands:
            if command is None:
                return False
            command()
        if commands:  # after a step, _run has just updated them
            self._update_stats()
        return True

    def _accept(self, request: _Request) -> None:
        if self.error is not None:
            return self._settle(request.accepted, EngineFailed(self.error))
        scheduler = self.engine.core.scheduler  # a request whose grammar compiles waits too (chapter 13)
        waiting = len(scheduler.waiting) + len(scheduler.waiting_for_grammar) + len(self._batch_queue)
        if waiting >= self.max_waiting:
            return self._settle(request.accepted, Overloaded(f"{waiting} requests are already waiting "
                                                             f"(max_waiting={self.max_waiting}); try again later"))
        if self.static_batch_size is not None:
            self._batch_queue.append(request)
        else:
            self._start(request)

    def _start(self, request: _Request) -> None:
        """Hand a request to the engine, or tell its handler why the engine refused it."""
        try:
            self.engine.add_request(request_id=request.request_id, prompt=request.prompt, params=request.params,
                                    arrival_time=request.arrival_time)
        except ValueError as err:
            return self._settle(request.accepted, err)
        self._streams[request.request_id] = request.stream
        self.metrics.request_started(request.request_id, request.arrival_time, request.params)
        self._settle(request.accepted, None)

    def _start_static_batch(self) -> None:
        if self.static_batch_size is None or self.engine.has_unfinished_requests():
            return
        for _ in range(min(self.static_batch_size, len(self._batch_queue))):
            self._start(self._batch_queue.popleft())

    def _abort(self, request_id: str) -> None:
        for request in self._batch_queue:
            if request.request_id == request_id:
                self._batch_queue.remove(request)
                return
        if self._streams.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)
            self.metrics.request_aborted(request_id)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams, in one trip to the event loop."""
        deliveries = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                deliveries.append((stream, output))
                if output.finished:
                    del self._streams[output.request_id]
        self.metrics.step_outputs(outputs, time.perf_counter())
        self._call_on_loop(_deliver, deliveries)

    def _fail_everyone(self, err: BaseException) -> None:
        """Tell every request in flight, and every one still to come, that the engine is gone."""
        self._call_on_loop(_deliver, [(stream, err) for stream in self._streams.values()])
        for request in self._batch_queue:
            self._settle(request.accepted, err)
        self._streams.clear()
        self._batch_queue.clear()

    def _update_stats(self) -> None:
        """Read-only counts of the scheduler and block manager, for /metrics' gauges."""
        scheduler, blocks = self.engine.core.scheduler, self.engine.core.block_manager
        waiting = len(scheduler.waiting) + len(scheduler.waiting_for_grammar) + len(self._batch_queue)  # chapter 13
        self.metrics.engine_state(len(scheduler.running), waiting,
                                  1 - blocks.num_free / blocks.num_blocks, blocks.queried_tokens, blocks.hit_tokens,
                                  None if self.engine.core.speculator is None else self.engine.core.speculator.stats,
                                  scheduler.num_preemptions, len(scheduler.waiting_for_grammar))

    def _settle(self, future: asyncio.Future, error: BaseException | None) -> None:
        self._call_on_loop(_settle_future, future, error)

    def _call_on_loop(self, fn: Callable, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            pass


# ---- run on the event loop, scheduled by the engine thread ----

def _deliver(deliveries: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in deliveries:
        stream.put(item)


def _settle_future(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # its handler was cancelled: the client is gone
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
