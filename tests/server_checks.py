"""What the server checks share: a server on 127.0.0.1 for an engine, and ways to read its
answers that fail with the server's own words. A failure inside the server is a 500 (or, in a
stream that had begun, a last `data: {"error": ...}` event) whose message says what raised,
in a student copy the exercise whose stub it was; a check that shows only a status code
would hide that, so these helpers put the message in the assertion."""
from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager

import httpx
import openai

from minivllm import LLMEngine
from minivllm.entrypoints.openai import threaded
from minivllm.entrypoints.openai.sse import DONE

MODEL = "tiny-server"
ENGINE = dict(num_kv_blocks=512, max_num_seqs=128)  # 8,192 KV slots: plenty for these tests, 32 MiB
TIMEOUT = 60  # seconds any one client call may take


def running_server(engine: LLMEngine, **options) -> AbstractContextManager[tuple[str, object]]:
    """The chapter's server in a thread on 127.0.0.1 (a port the OS picks), serving model MODEL."""
    return threaded.running_server(engine, MODEL, **options)


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def expect_status(response: httpx.Response, status: int = 200) -> None:
    """Fail unless the response has `status`, showing the body the server sent instead."""
    if response.status_code != status:
        raise AssertionError(f"HTTP {response.status_code} (expected {status}): {response.read().decode()}")


def answer(response: httpx.Response) -> dict:
    """The JSON body of a request that must succeed."""
    expect_status(response)
    return response.json()


def error_event(chunk: dict) -> str | None:
    """The message of a stream's error event, None for an ordinary chunk."""
    error = chunk.get("error")
    return (error.get("message") or str(error)) if error is not None else None


def chunks_of(lines: Iterable[str]) -> Iterator[dict]:
    """The JSON chunks of a server-sent event stream, in order; an error event fails the check
    with the server's message."""
    for line in lines:
        if line.startswith("data: ") and line != DONE.strip():
            chunk = json.loads(line.removeprefix("data: "))
            message = error_event(chunk)
            if message is not None:
                raise AssertionError(f"the stream ended with an error event: {message}")
            yield chunk


def metric_values(http: httpx.Client) -> dict[str, float]:
    """/metrics parsed as Prometheus text: sample name (with labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    response = http.get("/metrics")
    expect_status(response)
    assert response.headers["content-type"].startswith("text/plain")
    values = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            values[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return values


def wait_until_idle(http: httpx.Client, seconds: float = 20) -> dict[str, float]:
    """The metrics once nothing runs or waits; an engine that stopped fails at once, with why."""
    deadline = time.monotonic() + seconds
    while True:
        expect_status(http.get("/health"))
        values = metric_values(http)
        if values["minivllm_num_requests_running"] == values["minivllm_num_requests_waiting"] == 0:
            return values
        assert time.monotonic() < deadline, f"still busy after {seconds} s: {values}"
        time.sleep(0.05)
