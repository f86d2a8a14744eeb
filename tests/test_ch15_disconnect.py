"""Chapter 15 (issue 49): a client that disconnects mid-stream costs the core at most a couple
of steps, even when the frontend is behind the core.

The core in a process of its own does not wait for the frontend on its own: behind a busy
frontend (many streams, a slow CPU) it runs ahead, and every step between a client leaving and
the frontend getting round to noticing is a token computed for nobody (issue 49 measured ~44 a
client). So the frontend tells the core what it has taken in, and the core runs at most MAX_LEAD
steps ahead of it (core/process.py). This check makes the busy state on purpose: a tiny model,
so the core's steps are short, and a frontend that spends SLOW_FRONTEND seconds more on each of
the core's messages while the clients are connected. An ASGI wrapper around the app writes
down when the disconnect message reaches the app (the frontend noticing); the core's own
messages say when each step started and which tokens it made (one a step: no speculation).
A client may cost at most two steps after the frontend noticed, and MAX_LEAD + 3 after it left
(the lead, and a step for each turn of the frontend's loop until it notices: the turn it is in,
the one that reads the closed socket, the one that hands the app its disconnect).
"""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from server_checks import MODEL, TIMEOUT, wait_until_idle
from tiny_models import tiny_hf_model

import minivllm
from minivllm import LLMEngine
from minivllm.core.process import MAX_LEAD
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.app import build_app
from minivllm.request.messages import StepOutputs

pytestmark = [pytest.mark.ch15, pytest.mark.floors, pytest.mark.slow]  # ~30 s: a core process, 16 clients
CLIENTS = 16
SLOW_FRONTEND = 0.1  # seconds the frontend spends on each core message while clients are connected
MAX_TOKENS = 240  # more than the core can make before the last client leaves: they all leave mid-stream


def noticing(app: Callable, noticed: dict[int, float]) -> Callable:
    """`app`, writing down (by client port) when a connection's http.disconnect reaches it."""
    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        port = scope["client"][1]

        async def watched():
            message = await receive()
            if message["type"] == "http.disconnect":
                noticed.setdefault(port, time.perf_counter())
            return message

        await app(scope, watched, send)

    return wrapped


@contextmanager
def serving(app: Callable) -> Iterator[int]:
    """uvicorn on 127.0.0.1 in a thread (as threaded.running_server does); yields the port."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)


def leave_after(port: int, i: int, chunks: int, left: dict[str, tuple[int, float]]) -> None:
    """Stream a completion over a plain socket, read `chunks` events, then close the socket."""
    body = json.dumps({"model": MODEL, "prompt": "def f(x):", "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True, "stream": True, "request_id": f"dc{i}"}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        received, seen = b"", 0
        while seen < chunks:
            data = sock.recv(65536)
            assert data, "the server closed the stream before the client left"
            received += data
            seen = received.count(b"data: {")
        left[f"cmpl-dc{i}"] = (sock.getsockname()[1], time.perf_counter())


def test_a_client_that_disconnects_costs_the_core_at_most_a_couple_of_steps():
    model = minivllm.load_model(tiny_hf_model("qwen3", vocab_size=4096), device="cpu")
    engine = LLMEngine(model, tokenizer=minivllm.load_tokenizer(), num_kv_blocks=512, max_num_seqs=CLIENTS,
                       max_model_len=256)
    llm = AsyncLLM.from_engine(engine)
    steps: list[tuple[float, dict[str, int]]] = []  # the core's: when each step started, tokens per request
    connected = threading.Event()
    take_step = llm._take_step

    def slow_take_step(message: StepOutputs) -> None:
        if message.step_end:
            made: dict[str, int] = {}
            for out in message.outputs:
                made[out.request_id] = made.get(out.request_id, 0) + len(out.new_token_ids)
            steps.append((message.step_start, made))
        if connected.is_set():
            time.sleep(SLOW_FRONTEND)  # a busy frontend: the core runs ahead of it
        take_step(message)

    llm._take_step = slow_take_step
    noticed: dict[int, float] = {}
    left: dict[str, tuple[int, float]] = {}
    with serving(noticing(build_app(llm, MODEL), noticed)) as port:
        connected.set()
        clients = [threading.Thread(target=leave_after, args=(port, i, 3 + i % 6, left)) for i in range(CLIENTS)]
        for client in clients:
            client.start()
        for client in clients:
            client.join(TIMEOUT)
        connected.clear()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT) as http:
            wait_until_idle(http)  # the core has stopped them all, and the frontend has read every step
    assert len(left) == CLIENTS and all(p in noticed for p, _ in left.values()), (left, noticed)

    def made_after(moment: Callable[[int, float], float]) -> dict[str, int]:
        return {rid: sum(made.get(rid, 0) for start, made in steps if start > moment(port, close))
                for rid, (port, close) in left.items()}

    after_notice, after_close = made_after(lambda port, _: noticed[port]), made_after(lambda _, close: close)
    assert max(after_notice.values()) <= 2, f"tokens of steps started after the frontend noticed: {after_notice}"
    assert max(after_close.values()) <= MAX_LEAD + 3, f"tokens of steps started after the client left: {after_close}"
    total = {rid: sum(made.get(rid, 0) for _, made in steps) for rid in left}
    assert all(n < MAX_TOKENS for n in total.values()), total  # everyone left mid-stream
