"""`minivllm disagg-proxy` (chapter 17): one address in front of a prefill and a decode instance.

    minivllm serve --port 8100 --kv-transfer-config '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer", ...}'
    minivllm serve --port 8200 --kv-transfer-config '{... "kv_role": "kv_consumer" ...}'
    minivllm disagg-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Each completion (`/v1/completions`, `/v1/chat/completions`) goes first to the prefill instance
with max_tokens=1 and no stream, which computes the prompt and saves its K/V through its
connector, then, as the client sent it, to the decode instance, which loads those K/V and
generates; its answer (streamed or not) is the client's. vLLM's disaggregated-serving proxy does
the same. A failure on either side is the client's error, at once: the prefill's error status
and body as they came, or 502 when an instance cannot be reached; a decode instance that dies
mid-stream ends the client's stream.
"""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from minivllm.entrypoints.openai.responses import error_body

ROUTES = ("/v1/completions", "/v1/chat/completions")
CONNECT_SECONDS = 5.0  # an instance that does not answer a connection in this long is down
READ_SECONDS = 300.0  # the longest wait for a response (a long prefill) or the next chunk of a stream


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill instance gets: the same prompt and settings, one token, no stream."""
    drop = {"stream", "stream_options", "max_completion_tokens", "min_tokens"}
    return {k: v for k, v in body.items() if k not in drop} | {"max_tokens": 1, "stream": False}


def unreachable(side: str, err: httpx.HTTPError) -> JSONResponse:
    return JSONResponse(error_body(f"the {side} instance failed: {type(err).__name__}: {err}", "upstream_error"), 502)


def build_proxy(prefill_url: str, decode_url: str) -> FastAPI:
    """The proxy's app. prefill_url, decode_url: the instances' base urls (http://host:port)."""
    client: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        timeout = httpx.Timeout(READ_SECONDS, connect=CONNECT_SECONDS)
        async with httpx.AsyncClient(timeout=timeout) as http:
            client["http"] = http
            yield

    app = FastAPI(title="minivllm disagg-proxy", lifespan=lifespan)

    async def forward(request: Request) -> Response:
        http, path = client["http"], request.url.path
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse(error_body("the request body is not JSON"), 400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("the request body must be a JSON object"), 400)
        try:
            prefilled = await http.post(prefill_url + path, json=prefill_body(body), headers=headers)
        except httpx.HTTPError as err:
            return unreachable("prefill", err)
        if prefilled.status_code != 200:  # the prefill's verdict (a bad request, say) is the client's
            return Response(prefilled.content, prefilled.status_code, media_type="application/json")
        try:
            decoded = await http.send(http.build_request("POST", decode_url + path, json=body, headers=headers),
                                      stream=True)
        except httpx.HTTPError as err:
            return unreachable("decode", err)
        if decoded.status_code != 200 or not body.get("stream"):
            content = await decoded.aread()
            await decoded.aclose()
            return Response(content, decoded.status_code, media_type="application/json")
        return StreamingResponse(decoded.aiter_raw(), media_type="text/event-stream",
                                 background=BackgroundTask(decoded.aclose))

    for route in ROUTES:
        app.add_api_route(route, forward, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
            answer = await client["http"].get(decode_url + "/v1/models", headers=headers)
        except httpx.HTTPError as err:
            return unreachable("decode", err)
        return Response(answer.content, answer.status_code, media_type="application/json")

    return app
