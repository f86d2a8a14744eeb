"""`minivllm serve --api-server-count N` (issue 48): N API server processes on one port in front of
the same engine core process(es), so that HTTP, tokenizing, detokenizing and SSE, which cost the
frontend about 120 µs of CPU per streamed token on this course's CPU, use N cores instead of one.

    minivllm serve (the parent: starts everything, watches everything, serves nothing)
      binds the listening socket (host:port) once, and hands it to every API server
      │
      ├── API server 0 ─┐   each: uvicorn accepting on the shared socket, its own tokenizer,
      ├── API server 1 ─┤   AsyncLLM (input and output processing), /metrics; it *binds* a pair of
      │        ...      │   ZMQ sockets per core (requests in, outputs out) on IPC paths in the
      ├── API server N-1┘   parent's folder
      │
      └── engine core 0 .. M-1 (M = --data-parallel-size): each *connects* to every API server's
          pair, remembers which API server sent each request, and sends each its own requests'
          outputs, with the core's gauges every step (core/process.py)

The kernel gives each new connection to whichever API server accepts first (the socket is one,
shared: vLLM does the same), so a client's requests may meet different API servers, which is fine
since none keeps state between requests. The core is not an API server's child, so the parent
starts it and stops it: an API server reaches it through an AttachedCoreClient
(engine/process_client.py). /metrics is one view over all API servers (engine/metrics.py,
AllAPIServers): the parent gives them a folder for prometheus_client's multiprocess mode.

Failure, as chapter 15 promised for one process: the parent waits on every child. If any dies
(an API server or a core), it stops the cores; every other API server then finds its core gone
within WATCH_SECONDS, sends each of its streams an error event, answers /health with 503 while it
stops, and exits non-zero; the parent exits non-zero too and removes its folder. SIGTERM (or
Ctrl-C) to the parent stops the API servers first (each finishes or ends its streams, as one
server does), then the cores, and exits 0. Every child asks the kernel to end it with the parent,
so a parent that is killed leaves nothing behind either (API server 0 removes its folder).
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch

from minivllm.config.engine import EngineConfig
from minivllm.core.process import die_with_parent, run_core
from minivllm.engine.data_parallel import core_device
from minivllm.engine.metrics import MULTIPROCESS_FOLDER
from minivllm.engine.process_client import CoreAddresses, RunningCores

HEADER = b"x-minivllm-api-server"  # every response says which API server answered it
STOP_SECONDS = 15.0  # how long the parent waits for a child to stop before it ends it
BACKLOG = 2048  # connections the kernel queues before an API server accepts them (uvicorn's default)


@dataclass(frozen=True)
class APIServerSettings:
    """What every API server needs to build its app (pickled to each one): the model source its
    tokenizer comes from, the engine's settings, the name it serves, build_app's keywords, the
    admission limit, a chat template (file or text) and uvicorn's log level."""

    model: str | None
    config: EngineConfig
    name: str
    app_options: dict[str, Any]
    max_waiting: int
    chat_template: str | None
    log_level: str


def listening_socket(host: str, port: int, uds: str | None = None) -> socket.socket:
    """The one socket all API servers accept on, bound here so that a port in use fails at once;
    with `uds`, a Unix socket at that path instead (--uds; as uvicorn binds one: a path that
    exists is an error, and anyone on the machine may connect)."""
    if uds is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(uds)
        except OSError:
            sock.close()
            raise
        os.chmod(uds, 0o666)
        sock.listen(BACKLOG)
    else:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=BACKLOG)  # SO_REUSEADDR, as uvicorn's
    sock.set_inheritable(True)
    return sock


def serve_api_servers(settings: APIServerSettings, count: int, host: str, port: int, device: str | None,
                      dtype: torch.dtype | None, threads: int | None, uds: str | None = None) -> str | None:
    """Run `count` API servers and config.data_parallel_size cores until SIGTERM/SIGINT or until
    one of them dies, on host:port or the Unix socket `uds`. Returns None after a clean stop, else
    why it stopped (the CLI exits non-zero with it)."""
    sock = listening_socket(host, port, uds)  # first: a port in use fails before anything else exists
    folder = tempfile.mkdtemp(prefix="minivllm-serve-")
    os.environ[MULTIPROCESS_FOLDER] = str(Path(folder) / "metrics")  # the API servers inherit it
    os.mkdir(os.environ[MULTIPROCESS_FOLDER])
    stop: list[int] = []
    previous = {s: signal.signal(s, lambda number, _: stop.append(number)) for s in (signal.SIGTERM, signal.SIGINT)}
    spawn = multiprocessing.get_context("spawn")
    cores: list[multiprocessing.Process] = []
    servers: list[multiprocessing.Process] = []
    try:
        size = settings.config.data_parallel_size
        one = dataclasses.replace(settings.config, data_parallel_size=1)  # each core: one copy
        threads = threads if threads is not None else max(1, torch.get_num_threads() // size)
        paths = [[(f"ipc://{folder}/core{j}-in{i}", f"ipc://{folder}/core{j}-out{i}") for i in range(count)]
                 for j in range(size)]
        for j in range(size):
            inboxes, outboxes = [p[0] for p in paths[j]], [p[1] for p in paths[j]]
            core = spawn.Process(target=run_core, args=(settings.model, one, None, inboxes, outboxes),
                                 kwargs={"device": core_device(device, j), "dtype": dtype, "threads": threads},
                                 name=f"minivllm-core-{j}", daemon=True)
            core.start()
            cores.append(core)
        for i in range(count):
            running = RunningCores([CoreAddresses(cores[j].pid, *paths[j][i]) for j in range(size)], i, count)
            server = spawn.Process(target=run_api_server, args=(settings, running, sock),
                                   name=f"minivllm-api-server-{i}", daemon=True)
            server.start()
            servers.append(server)
        sock.close()  # the API servers hold it now
        failure = watch(servers, cores, stop)
        stop_all(servers, cores)
        # (an API server still loading when the signal came ends by SIGTERM itself: the stop asked for)
        unclean = [f"{p.name} (exit code {p.exitcode})" for p in servers
                   if p.exitcode != 0 and not (stop and p.exitcode == -signal.SIGTERM)]
        return failure or (f"API servers that did not stop cleanly: {', '.join(unclean)}" if unclean else None)
    finally:
        sock.close()
        stop_all(servers, cores)  # (after an error here; nothing left to do after a stop)
        if uds is not None:
            Path(uds).unlink(missing_ok=True)  # the socket file outlives its socket
        for s, handler in previous.items():
            signal.signal(s, handler)
        del os.environ[MULTIPROCESS_FOLDER]
        shutil.rmtree(folder, ignore_errors=True)


def watch(servers: list[multiprocessing.Process], cores: list[multiprocessing.Process], stop: list[int]) -> str | None:
    """Wait until a signal asks to stop (None) or a child exits (why, as a sentence)."""
    children = {p.sentinel: p for p in servers + cores}
    while not stop:
        ended = wait(list(children), timeout=0.2)  # a short timeout: the signal handler only sets `stop`
        if ended:
            child = children[ended[0]]
            child.join()
            what = "the engine core process" if child in cores else "an API server process"
            return f"{what} {child.name} (pid {child.pid}) exited with code {child.exitcode}, so the server stopped"
    return None


def stop_all(servers: list[multiprocessing.Process], cores: list[multiprocessing.Process]) -> None:
    """After a signal: the API servers first (they end their streams as one server does), then the
    cores. After a death: the cores first, so that every API server left sends its streams their
    error events and stops on its own; then whatever still runs."""
    if all(p.is_alive() for p in servers + cores):
        for p in servers:
            p.terminate()
        deadline = time.monotonic() + STOP_SECONDS
        for p in servers:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in cores:
        p.terminate()
    deadline = time.monotonic() + STOP_SECONDS
    for p in cores + servers:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def run_api_server(settings: APIServerSettings, running: RunningCores, sock: socket.socket) -> None:
    """An API server's main: its tokenizer, an AsyncLLM over the parent's cores, the app, and
    uvicorn on the shared socket. Exits 1 if the cores die (or never start) under it."""
    import uvicorn

    from minivllm.engine.async_llm import AsyncLLM
    from minivllm.entrypoints.openai.app import build_app
    from minivllm.loader import load_tokenizer

    die_with_parent()
    parent = multiprocessing.parent_process().pid
    if os.getppid() != parent:  # the parent died while this one started
        raise SystemExit(1)
    torch.set_grad_enabled(False)
    died: list[bool] = []
    server: uvicorn.Server | None = None

    def on_core_death() -> None:
        died.append(True)
        server.should_exit = True

    tokenizer = load_tokenizer(settings.model)
    if settings.chat_template:
        if tokenizer is None:
            raise SystemExit("minivllm serve: --chat-template: this model has no tokenizer")
        path = Path(settings.chat_template)
        tokenizer.chat_template = path.read_text() if path.is_file() else settings.chat_template
    try:
        engine = AsyncLLM(running, settings.config, tokenizer, max_waiting=settings.max_waiting,
                          on_core_death=on_core_death)
        app = build_app(engine, settings.name, **settings.app_options)
    except ValueError as err:
        raise SystemExit(f"minivllm serve: {err}")
    app.add_middleware(NameTheAPIServer, index=running.index)
    server = uvicorn.Server(uvicorn.Config(app, log_level=settings.log_level, timeout_graceful_shutdown=5))
    stopping: list[int] = []
    for s in (signal.SIGTERM, signal.SIGINT):  # as in the CLI: uvicorn raises them again once it has stopped
        signal.signal(s, lambda number, _: stopping.append(number))
    server.run(sockets=[sock])
    if os.getppid() != parent and running.index == 0:  # the parent was killed, so it cannot clean up: its folder
        shutil.rmtree(Path(os.environ[MULTIPROCESS_FOLDER]).parent, ignore_errors=True)
    if died or not (server.started or stopping):  # (a stop asked for while uvicorn started is a clean one)
        raise SystemExit(1)


class NameTheAPIServer:
    """ASGI middleware: every response carries HEADER: the index of the API server that answered
    (how a test, or anyone checking the balance, sees that every API server serves)."""

    def __init__(self, app: Any, index: int):
        self.app, self.value = app, str(index).encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (HEADER, self.value)]
            await send(message)

        await self.app(scope, receive, named)
