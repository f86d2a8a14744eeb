"""The core process (chapter 15): an EngineCore and a loop that waits on nothing but the model
(and, a step or two ahead, on the frontend).

    while True:
        read every message in the inbox (block only when there is no work, or the frontend is behind)
        step = core.step()                    schedule -> run -> sample -> append
        send StepOutputs(step's news, gauges) one message per step, whatever the batch size

HTTP, tokenizing, detokenizing, stop strings and SSE all happen in the frontend process, so
this loop holds the GIL alone: the frontend's Python for step k runs while the core computes
step k + 1.

Pacing (issue 49). A frontend that says how many steps it has taken in (Taken) keeps the core at
most MAX_LEAD steps ahead of it. Run free behind a busy frontend (many streams, a slow CPU), the
core computes steps whose outputs only queue in the socket, and a client that disconnects costs
every step until the frontend gets round to noticing (issue 49 measured ~44 tokens per client,
32 clients leaving mid-stream, against <= 32 with chapter 10's server, whose engine thread is
slowed by the frontend's GIL). Paced, it costs a step or two. Nothing is lost: when the frontend
is the slower half, its pace is what the clients get, whether the core runs ahead or not.

Several frontends (issue 48, `minivllm serve --api-server-count N`): the core connects a pair of
sockets to each, remembers which frontend sent each request, and sends each frontend its own
requests' news (every step, with the gauges, so each one's /metrics sees the whole core); it
runs at most MAX_LEAD steps ahead of the slowest frontend that paces it.

Failure: a request the core cannot take is refused alone (Refused); a step that raises is the
core's end (Failed, then exit code 1): its state may be half-updated, so carrying on could serve
wrong tokens. The process asks the kernel to end it when its parent dies, and also checks its
parent while idle, so a frontend that is killed leaves no core behind.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

import torch
import zmq

from minivllm.config.engine import EngineConfig
from minivllm.core.engine_core import EngineCore
from minivllm.request.messages import (
    Abort,
    AddRequest,
    EngineCoreOutput,
    EngineCoreStats,
    Failed,
    Ready,
    Refused,
    Shutdown,
    StepOutputs,
    StopSequences,
    Taken,
    encoder,
    to_core_decoder,
)

log = logging.getLogger("minivllm.core")
IDLE_POLL_MS = 500  # how long an idle core waits for a message before checking on its parent
MAX_LEAD = 2  # steps the core may run beyond those a pacing frontend has taken in
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: have the kernel send SIGTERM to this process when its parent exits."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the idle check on the parent still works
        pass


def run_core(model: Any, config: EngineConfig, tokenizer: Any, inboxes: list[str], outboxes: list[str],
             device: str | None = None, dtype: torch.dtype | None = None, threads: int | None = None) -> None:
    """The process' main: build the core, say Ready (with the resolved config) to every frontend,
    then serve until Shutdown. inboxes/outboxes: the ZMQ addresses each frontend has bound, one
    pair per frontend (PUSH -> PULL each way); frontend i's requests come in on inboxes[i] and
    their outputs go out on outboxes[i]."""
    die_with_parent()
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the frontend's to handle: it tells us
    torch.set_grad_enabled(False)
    if threads is not None:
        torch.set_num_threads(threads)
    context = zmq.Context()
    pulls, pushes = [context.socket(zmq.PULL) for _ in inboxes], [context.socket(zmq.PUSH) for _ in outboxes]
    for pull, inbox in zip(pulls, inboxes):
        pull.connect(inbox)
    for push, outbox in zip(pushes, outboxes):
        push.connect(outbox)  # a frontend not bound yet gets its messages once it binds
    try:
        core = EngineCore.load(model, config, tokenizer, device, dtype)
        for push in pushes:
            push.send(encoder.encode(Ready(os.getpid())))
            push.send_pyobj((core.info(), core.config))  # the input processor checks against this config
        serve(core, pulls, pushes, parent)
    except Exception as err:
        log.exception("the engine core failed")
        failed = encoder.encode(Failed(f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=4)}"))
        for push in pushes:
            push.send(failed)
        context.destroy(linger=2000)  # give the Failed message its chance to leave
        sys.exit(1)
    context.destroy(linger=0)


def apply_message(core: EngineCore, message: AddRequest | Abort | StopSequences) -> Refused | None:
    """Apply one message from the frontend to the core, between two steps.

    AddRequest: queue message.request with core.add_request. A request the core cannot take
    must not end the loop, nor touch the other requests: return Refused(its request_id,
    f"{type(err).__name__}: {err}", bad_request), where bad_request is True when err is a
    ValueError (the request's own fault: the frontend answers 400) and False for any other
    Exception (the core failed on it: a 500). Abort: core.abort_requests(message.request_ids).
    StopSequences: core.abort_sequences(message.sequences), the completions a stop string ended
    in the frontend. Returns None for everything but a refused AddRequest. (Shutdown is the
    loop's own: it never reaches here.)"""
    if isinstance(message, AddRequest):
        try:
            core.add_request(message.request)
        except Exception as err:  # this request fails alone; the others carry on
            return Refused(message.request.request_id, f"{type(err).__name__}: {err}", isinstance(err, ValueError))
    elif isinstance(message, Abort):
        core.abort_requests(message.request_ids)
    elif isinstance(message, StopSequences):
        core.abort_sequences(message.sequences)
    return None


def serve(core: EngineCore, pulls: list[zmq.Socket], pushes: list[zmq.Socket], parent: int) -> None:
    """The busy loop: messages between steps, one StepOutputs per step (to each frontend), at most
    MAX_LEAD steps ahead of every frontend that says what it has taken in (one that never does is
    not waited for)."""
    senders = Senders(pushes)
    poller = zmq.Poller()
    for pull in pulls:
        poller.register(pull, zmq.POLLIN)
    while True:
        runnable = core.has_unfinished_requests() and senders.may_step()
        if not runnable and not poller.poll(IDLE_POLL_MS):
            if os.getppid() != parent:  # the frontend is gone without a word
                return
            continue
        changed = False
        for client, pull in enumerate(pulls):
            while pull.poll(0):
                message = to_core_decoder.decode(pull.recv())
                if isinstance(message, Shutdown):
                    return
                if isinstance(message, Taken):
                    senders.taken[client] = message.steps
                    continue
                changed = True
                refused = senders.apply(core, client, message)
                if refused is not None:
                    senders.send(client, refused)
        if core.has_unfinished_requests() and senders.may_step():
            start = time.perf_counter()
            outputs = core.step()
            senders.step_outputs(core, outputs, start, time.perf_counter())
            senders.sent += 1
        elif changed:  # an abort emptied the core (or it waits for a frontend): the gauges say so at once
            senders.step_outputs(core, [], 0.0, 0.0)


class Senders:
    """Who gets what: with one frontend, everything; with several, each its own requests.

    The core remembers the frontend that sent each request (`owner`, until the request is gone
    from the core), takes aborts and stops only from that frontend, and after a step sends every
    frontend a StepOutputs with its requests' outputs and the core's gauges. The running sums of
    the gauges message (prefix-cache tokens, speculation's counts, preemptions) go to frontend 0
    alone: the frontends' counters are added up over the processes for /metrics, so the others
    count 0. Every frontend gets every step, so each one's Taken counts the same steps as `sent`."""

    def __init__(self, pushes: list[zmq.Socket]):
        self.pushes = pushes
        self.owner: dict[str, int] = {}  # request id -> the frontend that sent it (several frontends only)
        self.sent = 0  # steps sent
        self.taken: list[int | None] = [None] * len(pushes)  # steps each frontend has taken in (None: it does not say)

    def may_step(self) -> bool:
        """At most MAX_LEAD steps ahead of the slowest frontend that paces the core."""
        return all(taken is None or self.sent - taken < MAX_LEAD for taken in self.taken)

    def send(self, client: int, message: Any) -> None:
        self.pushes[client].send(encoder.encode(message))

    def apply(self, core: EngineCore, client: int, message: AddRequest | Abort | StopSequences) -> Refused | None:
        """apply_message, with several frontends: a request is known by the frontend that sent it."""
        if len(self.pushes) == 1:
            return apply_message(core, message)
        if isinstance(message, AddRequest):
            refused = apply_message(core, message)
            if refused is None:
                self.owner[message.request.request_id] = client
            return refused
        if isinstance(message, Abort):
            message = Abort([r for r in message.request_ids if self.owner.get(r) == client])
        elif isinstance(message, StopSequences):
            message = StopSequences([s for s in message.sequences if self.owner.get(s[0]) == client])
        apply_message(core, message)
        ids = message.request_ids if isinstance(message, Abort) else [s[0] for s in message.sequences]
        self.forget(core, ids)
        return None

    def forget(self, core: EngineCore, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if request_id not in core.requests:
                self.owner.pop(request_id, None)

    def step_outputs(self, core: EngineCore, outputs: list[EngineCoreOutput], start: float, end: float) -> None:
        stats = core.stats()
        if len(self.pushes) == 1:
            self.send(0, StepOutputs(outputs, stats, start, end))
            return
        mine: list[list[EngineCoreOutput]] = [[] for _ in self.pushes]
        for output in outputs:
            mine[self.owner.get(output.request_id, 0)].append(output)
        self.forget(core, [o.request_id for o in outputs if o.finish_reason is not None])
        gauges_only = EngineCoreStats(stats.running, stats.waiting, stats.kv_cache_usage, 0, 0, None, 0,
                                      stats.waiting_deferred)
        for client, its_outputs in enumerate(mine):
            self.send(client, StepOutputs(its_outputs, stats if client == 0 else gauges_only, start, end))
