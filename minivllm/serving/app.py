"""The HTTP routes (chapter 10): an OpenAI-compatible API over the background engine.

    POST /v1/completions        a prompt (text or token ids) -> its completion(s)
    POST /v1/chat/completions   messages -> the checkpoint's chat template -> completion(s)
    GET  /v1/models             the one model this server serves
    GET  /health                200 while the engine thread runs
    GET  /metrics               Prometheus text: queue, KV cache, tokens, latency histograms
    GET  /server_info           the engine's settings, device and model shape (for benchmarks)

Every handler is a coroutine that only validates, hands the request to the engine thread and
relays what comes back: nothing here waits on the model, so one slow request never holds up
the others. Bad input is answered with OpenAI's error body and a 4xx before the request ever
reaches the engine (or, for what only the engine can judge, as soon as it refuses). A failure
inside the server is a 500 with the same body, whose message says what raised (in a student
copy, the exercise whose stub it was); once a streamed answer has begun, its status is already
sent, so the error comes as one last event, `data: {"error": ...}`, before `data: [DONE]` (as
vLLM does; the openai client raises it as an APIError).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from minivllm.engine.llm import render_chat
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.sampling_params import SamplingParams
from minivllm.machine import environment
from minivllm.serving.async_engine import AsyncEngine, EngineDead, EngineFailed, Overloaded, RequestStream
from minivllm.serving.protocol import (ChatCompletionRequest, CompletionRequest, chat_response, completion_response,
                                       error_body)
from minivllm.serving.sse import DONE, Chunks, sse, stream_events

T = TypeVar("T")
log = logging.getLogger("minivllm.serving")


class APIError(Exception):
    """An answer other than 200: becomes OpenAI's error body with this status."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def server_error(err: Exception) -> APIError:
    """What the client is told when something failed inside the server: a 500 naming it, or a
    503 while the server shuts down."""
    if isinstance(err, EngineDead) and not isinstance(err, EngineFailed):
        return APIError(503, str(err), kind="engine_unavailable")
    message = str(err) if isinstance(err, EngineFailed) else f"{type(err).__name__}: {err}"
    return APIError(500, message, kind="internal_server_error")


def build_app(engine: LLMEngine, model_name: str, max_waiting: int = 512, static_batch_size: int | None = None) -> FastAPI:
    """The server for one engine. `model_name` is what requests must name in "model"."""
    async_engine = AsyncEngine(engine, max_waiting, static_batch_size)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="minivllm", lifespan=lifespan)
    app.state.engine = async_engine

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if err.status == 503 else None
        return JSONResponse(error_body(err.message, err.kind, err.param, err.code), err.status, headers=headers)

    @app.exception_handler(Exception)
    async def failure(request: Request, err: Exception) -> JSONResponse:
        """Anything a route did not expect: a 500 that says what raised (the server still logs
        the traceback)."""
        return await api_error(request, server_error(err))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(err.errors())
        return JSONResponse(error_body(message, param=param), 400)

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_name}`",
                           param="model", code="model_not_found")

    async def submit(request_id: str, prompt: str | list[int], make_params: Any, request: Request) -> RequestStream:
        """Hand a request to the engine thread; every refusal becomes its 4xx or 503."""
        try:
            params: SamplingParams = make_params()
            return await unless_disconnected(request, async_engine.add(request_id, prompt, params))
        except ValueError as err:
            raise APIError(400, str(err))
        except Overloaded as err:
            raise APIError(503, str(err), kind="server_overloaded")
        except EngineDead as err:
            raise server_error(err)

    async def answer(stream: RequestStream, chunks: Chunks, n: int, include_usage: bool, streaming: bool,
                     request: Request, respond: Any) -> Response:
        """Stream the outputs as server-sent events, or wait for the last and answer once."""
        if streaming:
            return StreamingResponse(abort_if_left(stream, stream_events(stream, chunks, n, include_usage)),
                                     media_type="text/event-stream")
        try:
            output = await unless_disconnected(request, stream.final())
        except ClientGone:
            async_engine.abort(stream.request_id)
            return Response(status_code=499)  # nobody reads it: the client is gone
        except EngineDead as err:
            raise server_error(err)
        return JSONResponse(respond(output, chunks.request_id, chunks.created, model_name, chunks.top_logprobs))

    async def abort_if_left(stream: RequestStream, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """Relay the events; if the client disconnects first, Starlette cancels this generator
        at its current `await`, and the `finally` aborts the request (its KV blocks are freed
        before the engine's next step). If making an event fails, the stream ends with an
        error event: the 200 and the events before it are already on their way."""
        try:
            async for event in events:
                yield event
        except Exception as err:  # not a disconnect: that cancels, which is no Exception
            if not isinstance(err, EngineDead):  # (the engine thread logged its own failure)
                log.exception("a streamed answer failed")
            error = server_error(err)
            yield sse(error_body(error.message, error.kind))
            yield DONE
        finally:
            if not stream.done:
                async_engine.abort(stream.request_id)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await submit(request_id, body.prompt, body.sampling_params, request)
        chunks = Chunks(request_id, int(time.time()), model_name, chat=False, top_logprobs=body.top_logprobs_wanted)
        return await answer(stream, chunks, body.n, body.include_usage, body.stream, request, completion_response)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        prompt = chat_prompt(engine.get_tokenizer(), [m.as_template_input() for m in body.messages], model_name)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await submit(request_id, prompt, body.sampling_params, request)
        chunks = Chunks(request_id, int(time.time()), model_name, chat=True, top_logprobs=body.top_logprobs_wanted)
        return await answer(stream, chunks, body.n, body.include_usage, body.stream, request, chat_response)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "minivllm",
                "max_model_len": engine.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if async_engine.alive:
            return Response(status_code=200)
        reason = f"{type(async_engine.error).__name__}: {async_engine.error}" if async_engine.error else "stopped"
        return JSONResponse(error_body(f"the engine is not running ({reason})", "engine_unavailable"), 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(async_engine.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return {
            "model": model_name, "scheduler": "continuous" if static_batch_size is None else "static",
            "static_batch_size": static_batch_size, "max_waiting": max_waiting,
            "max_model_len": engine.max_model_len, "vocab_size": engine.model.config.vocab_size,
            "block_size": engine.block_manager.block_size, "num_kv_blocks": engine.block_manager.num_blocks,
            "max_num_seqs": engine.scheduler.max_num_seqs,
            "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
            "environment": environment(engine.model),
        }

    return app


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]], model_name: str) -> list[int]:
    """The token ids of the messages rendered by the checkpoint's chat template, ending where
    the assistant's answer starts (render_chat)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, f"the model `{model_name}` has no chat template, so it cannot chat: use "
                            "/v1/completions, or start the server with --chat-template FILE")
    try:
        return render_chat(tokenizer, messages)[1]
    except Exception as err:  # templates refuse what they cannot render (say, two user turns in a row)
        raise APIError(400, f"the chat template could not render these messages: {err}", param="messages")


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, unless the client disconnects first: then cancel it and raise ClientGone.
    (Once the body is read, the next ASGI message a server can receive is the disconnect.)"""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()  # also when this handler itself is cancelled
    if not task.done() or task.cancelled():
        raise ClientGone()
    return task.result()


def describe_validation_error(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic's errors as one sentence for OpenAI's error body, and the field they are about."""
    messages, params = [], []
    for e in errors:
        loc = [str(part) for part in e.get("loc", ()) if part != "body"]
        field = ".".join(loc) or None
        if e.get("type") == "json_invalid":
            messages.append(f"malformed JSON: {e.get('ctx', {}).get('error', e.get('msg'))}")
        elif e.get("type") == "extra_forbidden":
            messages.append(f"unknown or unsupported field `{field}`")
        else:
            messages.append(f"{field}: {e.get('msg')}" if field else str(e.get("msg")))
        params.append(field)
    return "; ".join(messages), params[0] if params else None
