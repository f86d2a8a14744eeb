"""How busy this server is, told to load balancers (vLLM's two ways):

- GET /load answers {"server_load": N}, N the generating requests in flight: counted from when a
  completion or chat request arrives until its answer is sent (a stream: until its last event,
  or until its client leaves). A router sends the next request to the replica with the lowest N.
- ORCA (Open Request Cost Aggregation, the load report Envoy and gRPC balancers read): a request
  that carries the header `endpoint-load-metrics-format: text` (or `json`) gets back the header
  `endpoint-load-metrics` with the engine's load when its answer starts:

      endpoint-load-metrics: TEXT named_metrics.kv_cache_usage_perc=0.25, named_metrics.num_requests_waiting=3.0

Both read state the server already keeps (the engine's gauges, a counter), so they cost nothing
per step.
"""
from __future__ import annotations

import json
from collections.abc import Awaitable

from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from minivllm.engine.metrics import ServerMetrics

FORMAT_HEADER = "endpoint-load-metrics-format"  # what the client asks for: text or json
REPORT_HEADER = "endpoint-load-metrics"
# ORCA's named metrics, from the server's own gauges (the vllm: series of the same names)
ORCA_METRICS = {"kv_cache_usage_perc": "minivllm_kv_cache_usage",
                "num_requests_waiting": "minivllm_num_requests_waiting"}


class ServerLoad:
    """The generating requests in flight (GET /load). Only the event loop's thread touches it."""

    def __init__(self) -> None:
        self.count = 0

    async def counted(self, response: Awaitable[Response]) -> Response:
        """Await a route's response with the request counted: until a plain answer is made, or
        until a streamed one has sent its last event (or its client left: Starlette runs the
        background task either way)."""
        self.count += 1
        try:
            answer = await response
        except BaseException:
            self.count -= 1
            raise
        if isinstance(answer, StreamingResponse):
            answer.background = BackgroundTask(self.released)
        else:
            self.release()
        return answer

    def release(self) -> None:
        self.count -= 1

    async def released(self) -> None:
        """release() as a coroutine: Starlette awaits it on the loop, where it would run a plain
        function in its thread pool (a thread hop per streamed answer for one subtraction)."""
        self.release()


def orca_header(metrics: ServerMetrics, wanted: str | None) -> dict[str, str]:
    """The ORCA load report for a request whose `endpoint-load-metrics-format` header is
    `wanted`: {} when it asked for none, or for a format other than TEXT and JSON (vLLM ignores
    those too)."""
    if wanted is None or wanted.lower() not in ("text", "json"):
        return {}
    named = {name: float(metrics.registry.get_sample_value(series) or 0.0) for name, series in ORCA_METRICS.items()}
    if wanted.lower() == "json":
        return {REPORT_HEADER: f"JSON {json.dumps({'named_metrics': named})}"}
    return {REPORT_HEADER: "TEXT " + ", ".join(f"named_metrics.{name}={value}" for name, value in named.items())}
