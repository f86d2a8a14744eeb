"""A server inside this process (chapter 10): uvicorn in a thread, for the chapter's script, its
notebook and the tests, which start servers, talk to them and stop them without a second process."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI

from minivllm.engine.async_llm import AsyncLLM
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.openai.app import build_app

START_TIMEOUT = 60.0  # seconds a server may take to start, or to stop


@contextmanager
def running_server(engine: LLMEngine, name: str, core_process: bool = False,
                   **options: Any) -> Iterator[tuple[str, FastAPI]]:
    """The app for `engine` (served as model `name`; options go to build_app) served by uvicorn
    in a thread, on 127.0.0.1 (this machine only) and a port the OS picks; yields (base url, app).
    core_process: serve `engine`'s model, settings and tokenizer from a core process of their
    own (chapter 15) instead of stepping `engine` in a thread of this one (chapter 10).
    Leaving the block stops uvicorn, whose shutdown stops the engine thread (the app's lifespan),
    and waits for both; a server that does not start or stop within START_TIMEOUT is a RuntimeError."""
    if core_process:
        engine = AsyncLLM.from_engine(engine, max_waiting=options.pop("max_waiting", 512))
    app = build_app(engine, name, **options)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(START_TIMEOUT)
        if thread.is_alive():
            raise RuntimeError("the server did not shut down")
