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


def run_core(model: Any, config: EngineConfig, tokenizer: Any, inbox: str, outbox: str,
             device: str | None = None, dtype: torch.dtype | None = None, threads: int | None = None) -> None:
    """The process' main: build the core, say Ready (with the resolved config), then serve
    until Shutdown. inbox/outbox: ZMQ addresses the frontend has bound (PUSH -> PULL each way)."""
    die_with_parent()
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the frontend's to handle: it tells us
    torch.set_grad_enabled(False)
    if threads is not None:
        torch.set_num_threads(threads)
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.connect(inbox)
    push.connect(outbox)
    try:
        core = EngineCore.load(model, config, tokenizer, device, dtype)
        push.send(encoder.encode(Ready(os.getpid())))
        push.send_pyobj((core.info(), core.config))  # the input processor checks against this config
        serve(core, pull, push, parent)
    except Exception as err:
        log.exception("the engine core failed")
        push.send(encoder.encode(Failed(f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=4)}")))
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


def serve(core: EngineCore, pull: zmq.Socket, push: zmq.Socket, parent: int) -> None:
    """The busy loop: messages between steps, one StepOutputs per step, at most MAX_LEAD steps
    ahead of a frontend that says what it has taken in (one that never does is not waited for)."""
    sent, taken = 0, None  # steps sent; steps the frontend has taken in (None: it does not say)
    while True:
        runnable = core.has_unfinished_requests() and (taken is None or sent - taken < MAX_LEAD)
        if not runnable and not pull.poll(IDLE_POLL_MS):
            if os.getppid() != parent:  # the frontend is gone without a word
                return
            continue
        changed = False
        while pull.poll(0):
            message = to_core_decoder.decode(pull.recv())
            if isinstance(message, Shutdown):
                return
            if isinstance(message, Taken):
                taken = message.steps
                continue
            changed = True
            refused = apply_message(core, message)
            if refused is not None:
                push.send(encoder.encode(refused))
        if core.has_unfinished_requests() and (taken is None or sent - taken < MAX_LEAD):
            start = time.perf_counter()
            outputs = core.step()
            push.send(encoder.encode(StepOutputs(outputs, core.stats(), start, time.perf_counter())))
            sent += 1
        elif changed:  # an abort emptied the core (or it waits for the frontend): the gauges say so at once
            push.send(encoder.encode(StepOutputs([], core.stats())))
