"""The HTTP routes (chapters 10 and 15): an OpenAI-compatible API over the background engine.

    POST /v1/completions        a prompt (text or token ids), or a batch of them -> completion(s)
    POST /v1/chat/completions   messages -> the checkpoint's chat template -> completion(s)
    POST /v1/chat/completions/batch  vLLM's: a list of conversations -> one answer each
    POST /invocations           SageMaker's: a chat or a completion request, told apart by its body
    GET  /v1/models             the one model this server serves (/v1/models/{id}: its card)
    GET  /health                200 while the engine thread runs (GET or POST /ping: the same, SageMaker's name)
    GET  /load                  vLLM's: the generating requests in flight (load.py, with the ORCA header)
    POST /tokenize, /detokenize vLLM's: text or messages -> token ids, token ids -> text
    GET  /tokenizer_info        vLLM's: the tokenizer's class, special tokens, chat template
    GET  /version               the minivllm version
    GET  /metrics               Prometheus text: queue, KV cache, tokens, latency histograms
    GET  /server_info           the engine's settings, device and model shape (for benchmarks)

The routes are module-level coroutines that read the server (its engine and settings) from
`app.state.server`; `build_app` only assembles them. Every handler only validates, hands the
request to the engine (a thread, or a core process) and relays what comes back: nothing here waits on the model, so one slow request never holds up
the others. Bad input is answered with OpenAI's error body and a 4xx before the request ever
reaches the engine (or, for what only the engine can judge, as soon as it refuses). Like vLLM's
server, this one tokenizes the prompts itself, so that it can refuse a max_tokens the context
cannot hold (400, never a silent cap) before queueing anything, and hands the engine token ids.
With an API key (`api_key`), every /v1 route wants it (auth.py). A failure inside the server is
a 500 with the same body, whose message says what raised (in a student copy, the exercise whose
stub it was); once a streamed answer has begun, its status is already sent, so the error comes as
one last event, `data: {"error": ...}`, before `data: [DONE]` (as vLLM does; the openai client
raises it as an APIError). Every other error, an unknown route (404) or method (405) included,
has the same body.

Issue 36: prompts are tokenized in a worker thread (`asyncio.to_thread`): a 2 MB prompt takes
seconds to tokenize, and on the event loop those seconds would stall every other request and
/health. Prompts given as a few token ids (at most INLINE_TOKEN_IDS, nothing to tokenize) are
checked on the loop instead: the hop to a thread and back costs more than checking them. Bodies
above `max_request_bytes` are refused with 413 before they are read (body_limit.py).
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from minivllm.engine.async_engine import (
    AsyncEngine,
    EngineDead,
    EngineFailed,
    Overloaded,
    RequestStream,
    merge,
)
from minivllm.engine.async_llm import AsyncLLM
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.llm import render_chat
from minivllm.entrypoints.openai.auth import APIKeyMiddleware, check_api_key
from minivllm.entrypoints.openai.body_limit import (
    DEFAULT_MAX_REQUEST_BYTES,
    BodyLimitMiddleware,
)
from minivllm.entrypoints.openai.load import FORMAT_HEADER, ServerLoad, orca_header
from minivllm.entrypoints.openai.protocol import (
    APIError,
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_max_tokens,
)
from minivllm.entrypoints.openai.responses import (
    Echo,
    Shown,
    chat_response,
    completion_response,
    error_body,
    prompt_only,
)
from minivllm.entrypoints.openai.sse import DONE, Chunks, sse, stream_events
from minivllm.request.outputs import RequestOutput
from minivllm.request.sampling_params import SamplingParams

T = TypeVar("T")
MAX_LOGPROBS = 20  # vLLM's default cap on the alternatives per token a request may ask for
# Token-id prompts of at most this many ids in all are checked on the event loop: measured on this
# course's CPU, 32 ids take 7 µs there and 97 µs through asyncio.to_thread; 480 ids, 67 and 156 µs.
# Up to this bound the loop is held for at most ~0.3 ms; longer prompts go to the thread as text does.
INLINE_TOKEN_IDS = 2048
log = logging.getLogger("minivllm.entrypoints.openai")


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def server_error(err: Exception) -> APIError:
    """What the client is told when something failed inside the server: a 500 naming it, or a
    503 while the server shuts down."""
    if isinstance(err, EngineDead) and not isinstance(err, EngineFailed):
        return APIError(503, str(err), kind="engine_unavailable")
    message = str(err) if isinstance(err, EngineFailed) else f"{type(err).__name__}: {err}"
    return APIError(500, message, kind="internal_server_error")


@dataclass(frozen=True)
class Server:
    """What the routes need, kept in app.state.server: the engine (chapter 10's thread or
    chapter 15's frontend over a core process) and the server's settings."""

    engine: AsyncEngine | AsyncLLM
    model_name: str
    max_waiting: int
    static_batch_size: int | None
    max_logprobs: int
    return_tokens_as_token_ids: bool = False  # the default of the request field of that name
    force_include_usage: bool = False  # every stream carries usage (every chunk, and a last chunk), asked for or not
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    per_request_metrics: bool = False  # a "metrics" field with the request's timings (a stream: on its usage chunk)
    trust_request_chat_template: bool = False  # a request may bring its own chat template (Jinja the server runs)
    load: ServerLoad = field(default_factory=ServerLoad)  # GET /load


def build_app(engine: LLMEngine | AsyncLLM, model_name: str, max_waiting: int = 512,
              static_batch_size: int | None = None, max_logprobs: int = MAX_LOGPROBS,
              api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              root_path: str = "", return_tokens_as_token_ids: bool = False,
              enable_force_include_usage: bool = False, enable_prompt_tokens_details: bool = False,
              enable_per_request_metrics: bool = False, trust_request_chat_template: bool = False) -> FastAPI:
    """The server for one engine: an LLMEngine stepped by a thread of this process (chapter 10),
    or an AsyncLLM, whose core runs in a process of its own (chapter 15; it brings its own
    max_waiting, and static batches are chapter 10's only). `model_name` is what requests must
    name in "model"; max_logprobs: the most alternatives per token a request may ask for (more
    is a 400; -1: no cap, so that -1, the whole vocabulary, may be asked for); api_key: None
    leaves the server open, a key makes every /v1 route want it; max_request_bytes: larger
    request bodies are a 413, refused before they are read. vLLM's flags: root_path, the prefix
    a proxy in front of the server adds to every path (routes answer with and without it);
    return_tokens_as_token_ids, the default of the request field;
    enable_force_include_usage, usage in every stream, asked for or not;
    enable_prompt_tokens_details, usage.prompt_tokens_details.cached_tokens;
    enable_per_request_metrics, the request's timings in a "metrics" field;
    trust_request_chat_template, a request's own chat_template is run (otherwise a 400)."""
    if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int) or max_logprobs < -1:
        raise ValueError(f"max_logprobs must be an integer >= 0, or -1 for no cap, got {max_logprobs!r}")
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be an integer >= 1, got {max_request_bytes!r}")
    if api_key is not None:
        check_api_key(api_key)
    if not isinstance(root_path, str) or (root_path and (not root_path.startswith("/") or root_path.endswith("/"))):
        raise ValueError(f"root_path must be empty or a path such as /api (a leading /, no trailing /), "
                         f"got {root_path!r}")
    if isinstance(engine, AsyncLLM):
        if static_batch_size is not None:
            raise ValueError("static_batch_size is chapter 10's one-process server's: pass an LLMEngine")
        async_engine, max_waiting = engine, engine.max_waiting
    else:
        async_engine = AsyncEngine(engine, max_waiting, static_batch_size)
    async_engine.metrics.model_name = model_name  # the label of the vllm: series
    app = FastAPI(title="minivllm", lifespan=lifespan)
    app.root_path = root_path  # (vLLM sets it so; the constructor's argument is deprecated)
    app.state.server = Server(async_engine, model_name, max_waiting, static_batch_size, max_logprobs,
                              return_tokens_as_token_ids, enable_force_include_usage, enable_prompt_tokens_details,
                              enable_per_request_metrics, trust_request_chat_template)
    app.state.engine = async_engine
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)  # added last: the outermost
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(ClientGone, client_gone)
    app.add_exception_handler(Exception, failure)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.include_router(routes)
    return app


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the engine with the server, stop it with the server."""
    engine = app.state.server.engine
    if isinstance(engine, AsyncLLM):
        await engine.start()  # spawns the core and waits until it is ready
    else:
        engine.start()
    yield
    engine.shutdown()


# ---- what goes wrong, as OpenAI's error body ----

async def api_error(request: Request, err: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if err.status == 503 else None
    return JSONResponse(error_body(err.message, err.kind, err.param, err.code), err.status, headers=headers)


async def http_error(request: Request, err: HTTPException) -> JSONResponse:
    """Starlette's own refusals (an unknown route: 404, a wrong method: 405) in OpenAI's shape."""
    kind = {404: "NotFoundError", 405: "MethodNotAllowed"}.get(err.status_code, "invalid_request_error")
    message = f"{request.method} {request.url.path}: {err.detail}"
    return JSONResponse(error_body(message, kind), err.status_code, headers=getattr(err, "headers", None))


async def client_gone(request: Request, err: ClientGone) -> Response:
    return Response(status_code=499)  # nobody reads it: the client is gone


async def failure(request: Request, err: Exception) -> JSONResponse:
    """Anything a route did not expect: a 500 that says what raised (the server still logs the
    traceback)."""
    return await api_error(request, server_error(err))


async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
    message, param = describe_validation_error(err.errors())
    return JSONResponse(error_body(message, param=param), 400)


# ---- the routes ----

routes = APIRouter()


@routes.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await generating(request, complete(request.app.state.server, body, request))


async def complete(server: Server, body: CompletionRequest, request: Request) -> Response:
    params = checked_params(server, body)
    prompts = body.prompts()
    work = partial(tokenized, server, prompts, body.add_special_tokens, body.truncate_prompt_tokens,
                   body.truncation_side)
    ids_only = all(not isinstance(p, str) for p in prompts) and sum(map(len, prompts)) <= INLINE_TOKEN_IDS
    pairs = work() if ids_only else await asyncio.to_thread(work)
    texts, prompts = zip(*pairs)
    check_fit(server, "max_tokens", body.max_tokens, prompts)
    request_id, created = f"cmpl-{body.request_id or uuid.uuid4().hex}", int(time.time())
    streams = await submit(server, request_id, list(prompts), params, request)
    tokenizer = server.engine.tokenizer
    echo = [echo_of(text, ids, tokenizer) for text, ids in zip(texts, prompts)] if body.echo else None
    shown = shown_for(server, body, prompt_logprobs=body.prompt_logprobs is not None)
    chunks = Chunks(request_id, created, server.model_name, chat=False, top_logprobs=body.top_logprobs_wanted,
                    n=body.n, echo=echo, prompts=list(prompts), token_ids=shown.token_ids,
                    as_token_ids=shown.as_token_ids, cached_tokens=shown.cached_tokens, metrics=shown.metrics)
    respond = partial(completion_response, request_id=request_id, created=created, model=server.model_name,
                      top_logprobs=body.top_logprobs_wanted, echo=echo, show_prompt_logprobs=shown.prompt_logprobs,
                      shown=shown)
    return await answer(server, streams, chunks, body, request, respond, prompt_only if body.scores_only else None)


@routes.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await generating(request, chat(request.app.state.server, body, request))


async def chat(server: Server, body: ChatCompletionRequest, request: Request) -> Response:
    params = checked_params(server, body)
    prompt = await conversation_ids(server, body)
    check_fit(server, *body.max_tokens_field, [prompt])
    request_id, created = f"chatcmpl-{body.request_id or uuid.uuid4().hex}", int(time.time())
    streams = await submit(server, request_id, [prompt], params, request)
    # vLLM shows the prompt's logprobs whenever they were computed: asked for, or for echo
    shown = shown_for(server, body, prompt_logprobs=body.prompt_logprobs is not None or body.echo)
    chunks = Chunks(request_id, created, server.model_name, chat=True, top_logprobs=body.top_logprobs_wanted,
                    n=body.n, prompts=[prompt], role=body.answer_role, chat_echo=body.echoed,
                    token_ids=shown.token_ids, as_token_ids=shown.as_token_ids, cached_tokens=shown.cached_tokens,
                    metrics=shown.metrics)
    respond = partial(chat_response, request_id=request_id, created=created, model=server.model_name,
                      top_logprobs=body.top_logprobs_wanted, shown=shown, role=body.answer_role, echo=body.echoed)
    return await answer(server, streams, chunks, body, request, respond)


@routes.post("/v1/chat/completions/batch")
async def batch_chat_completions(body: BatchChatCompletionRequest, request: Request) -> Response:
    """vLLM's: every conversation is one engine request (they run in the same steps); choice i
    answers conversation i, usage counts them all."""
    return await generating(request, batch_chat(request.app.state.server, body, request))


async def batch_chat(server: Server, body: BatchChatCompletionRequest, request: Request) -> Response:
    params = checked_params(server, body)
    conversations = body.conversations()
    prompts = [await conversation_ids(server, conversation) for conversation in conversations]
    check_fit(server, *body.max_tokens_field, prompts)
    request_id, created = f"chatcmpl-{body.request_id or uuid.uuid4().hex}", int(time.time())
    streams = await submit(server, request_id, prompts, params, request)
    shown = shown_for(server, body, prompt_logprobs=False)
    respond = partial(chat_response, request_id=request_id, created=created, model=server.model_name,
                      top_logprobs=body.top_logprobs_wanted, shown=shown, role=[c.answer_role for c in conversations],
                      echo=[c.echoed for c in conversations])
    chunks = Chunks(request_id, created, server.model_name, chat=True)  # never used: a batch does not stream
    return await answer(server, streams, chunks, body, request, respond)


@routes.post("/invocations")
async def invocations(request: Request) -> Response:
    """SageMaker's one route for every request (vLLM's): a body with `messages` is a chat
    request, one with `prompt` a completion request, each checked and answered as on its own
    route."""
    try:
        body = await request.json()
    except ValueError as err:
        raise APIError(400, f"malformed JSON: {err}")
    kind = None
    if isinstance(body, dict):
        kind = ChatCompletionRequest if "messages" in body else CompletionRequest if "prompt" in body else None
    if kind is None:
        raise APIError(400, "Cannot find a suitable handler for this request: /invocations takes a chat completion "
                            "(a JSON object with `messages`) or a completion (a JSON object with `prompt`)")
    try:
        parsed = kind.model_validate(body)
    except ValidationError as err:
        raise RequestValidationError(err.errors())
    return await (chat_completions if kind is ChatCompletionRequest else completions)(parsed, request)


@routes.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    server = request.app.state.server
    card = {"id": server.model_name, "object": "model", "created": 0, "owned_by": "minivllm",
            "max_model_len": server.engine.max_model_len}
    return {"object": "list", "data": [card]}


@routes.get("/v1/models/{model_id:path}")
async def model_card(model_id: str, request: Request) -> dict[str, Any]:
    server = request.app.state.server
    check_model(server, model_id)
    return (await models(request))["data"][0]


@routes.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    """vLLM's: the token ids the server would run for this text (or these messages), with no
    limit on the length (a count is often what is asked)."""
    server = request.app.state.server
    tokenizer = the_tokenizer(server, body.model)
    if body.messages is not None:
        messages = [m.as_template_input() for m in body.messages]
        generation_prompt = body.add_generation_prompt and not body.continue_final_message
        ids = await asyncio.to_thread(chat_prompt, tokenizer, messages, server.model_name, generation_prompt,
                                      body.continue_final_message, tools=body.tools,
                                      **body.template_options(server.trust_request_chat_template))
    else:
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": server.engine.max_model_len, "tokens": ids, "token_strs": strs}


@routes.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    server = request.app.state.server
    tokenizer = the_tokenizer(server, body.model)
    vocab_size = server.engine.engine_info()["vocab_size"]
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", param="tokens")
    return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}


@routes.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """vLLM's: what a client needs to tokenize as the server does (lm-evaluation-harness asks it
    first, then uses /tokenize and /detokenize instead of downloading a tokenizer)."""
    server = request.app.state.server
    tokenizer = the_tokenizer(server, None)
    info = {"tokenizer_class": type(tokenizer).__name__, "model_max_length": server.engine.max_model_len,
            "chat_template": getattr(tokenizer, "chat_template", None), "vocab_size": len(tokenizer)}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = getattr(tokenizer, name, None)
        info[name] = token if isinstance(token, str) or token is None else str(token)
        info[f"{name}_id"] = getattr(tokenizer, f"{name}_id", None)
    return info


@routes.get("/version")
async def version() -> dict[str, str]:
    return {"version": importlib.metadata.version("minivllm")}


@routes.get("/health")
async def health(request: Request) -> Response:
    engine = request.app.state.server.engine
    if engine.alive:
        return Response(status_code=200)
    reason = f"{type(engine.error).__name__}: {engine.error}" if engine.error else "stopped"
    return JSONResponse(error_body(f"the engine is not running ({reason})", "engine_unavailable"), 503)


@routes.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request) -> Response:
    """SageMaker's health check: /health under the name it polls."""
    return await health(request)


@routes.get("/load")
async def load(request: Request) -> dict[str, int]:
    """vLLM's: how many generating requests are in flight (load.py)."""
    return {"server_load": request.app.state.server.load.count}


@routes.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.server.engine.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@routes.get("/server_info")
async def server_info(request: Request) -> dict[str, Any]:
    server = request.app.state.server
    return {"model": server.model_name, "scheduler": "continuous" if server.static_batch_size is None else "static",
            "static_batch_size": server.static_batch_size, "max_waiting": server.max_waiting,
            "engine_core": "process" if isinstance(server.engine, AsyncLLM) else "thread",
            **server.engine.engine_info()}


# ---- what the routes share ----

def check_model(server: Server, name: str) -> None:
    if name != server.model_name:
        raise APIError(404, f"The model `{name}` does not exist; this server serves `{server.model_name}`",
                       param="model", code="model_not_found")


def checked_params(server: Server, body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    """What both generating routes check first: the model (404), the logprobs asked for and the
    sampling parameters (400); returns the request's SamplingParams."""
    check_model(server, body.model)
    body.check_logprobs(server.max_logprobs, server.engine.engine_info()["vocab_size"])
    return bad_request_unless(body.sampling_params)


async def generating(request: Request, work: Awaitable[Response]) -> Response:
    """A generating route's response, counted in /load while it runs, with the ORCA load report
    when the request asks for one (load.py)."""
    server = request.app.state.server
    response = await server.load.counted(work)
    response.headers.update(orca_header(server.engine.metrics, request.headers.get(FORMAT_HEADER)))
    return response


def shown_for(server: Server, body: CompletionRequest | ChatCompletionRequest, prompt_logprobs: bool) -> Shown:
    """What the answer shows besides the text: the request's fields and the server's flags."""
    return Shown(body.top_logprobs_wanted, body.return_token_ids,
                 body.logprobs_as_token_ids(server.return_tokens_as_token_ids), prompt_logprobs,
                 server.prompt_tokens_details, server.per_request_metrics)


async def conversation_ids(server: Server, body: ChatCompletionRequest) -> list[int]:
    """The token ids of a chat request's messages through the chat template (in a worker
    thread), cut by truncate_prompt_tokens if it asks."""
    messages = [m.as_template_input() for m in body.messages]
    prompt = await asyncio.to_thread(chat_prompt, server.engine.tokenizer, messages, server.model_name,
                                     body.generation_prompt, body.continue_final_message,
                                     **body.template_options(server.trust_request_chat_template))
    if body.truncate_prompt_tokens is not None:
        prompt = truncated(server, prompt, body.truncate_prompt_tokens, body.truncation_side)
    return prompt


def the_tokenizer(server: Server, model: str | None) -> Any:
    """The engine's tokenizer, for the side endpoints (their `model` may be left out)."""
    if model is not None:
        check_model(server, model)
    if server.engine.tokenizer is None:
        raise APIError(400, f"the model `{server.model_name}` has no tokenizer: it takes and gives token ids only")
    return server.engine.tokenizer


def tokenized(server: Server, prompts: list[str | list[int]], add_special_tokens: bool = True,
              truncate: int | None = None, side: str = "left") -> list[tuple[str | None, list[int]]]:
    """Each prompt's (text or None, token ids), through the engine's own tokenize; a prompt it
    refuses is a 400 that says which one. add_special_tokens=False: a text prompt's tokens
    without the tokenizer's BOS and the like; truncate (vLLM's truncate_prompt_tokens): keep
    only `truncate` of the prompt's tokens (-1: max_model_len), its last ones (side "left") or its
    first ("right"), and echo those, not the text.
    Slow for long texts: the routes call it in a worker thread."""
    tokenizer, pairs = server.engine.tokenizer, []
    for i, prompt in enumerate(prompts):
        text = prompt if isinstance(prompt, str) else None
        try:
            if text is not None and tokenizer is not None and (not add_special_tokens or truncate is not None):
                prompt = tokenizer.encode(text, add_special_tokens=add_special_tokens)  # checked below as ids
            if truncate is not None and not isinstance(prompt, str):
                kept = truncated(server, prompt, truncate, side)
                prompt, text = kept, (text if len(kept) == len(prompt) else None)  # echo: the tokens kept
            pairs.append((text, server.engine.tokenize(prompt)[1]))
        except ValueError as err:
            raise APIError(400, f"prompt {i}: {err}" if len(prompts) > 1 else str(err), param="prompt")
    return pairs


def truncated(server: Server, token_ids: list[int], keep: int, side: str = "left") -> list[int]:
    """vLLM's truncate_prompt_tokens: `keep` tokens (-1: max_model_len of them), cut on the left
    (the last ones stay, the default) or on the right (vLLM's truncation_side="right": the first ones)."""
    if keep == 0:
        raise APIError(400, "truncate_prompt_tokens must be at least 1 (or -1: the model's context)",
                       param="truncate_prompt_tokens")
    keep = server.engine.max_model_len if keep == -1 else keep
    return token_ids[:keep] if side == "right" else token_ids[-keep:]


def check_fit(server: Server, name: str, max_tokens: int | None, prompts: list[list[int]]) -> None:
    """Every prompt and max_tokens within the context (check_max_tokens), or a 400."""
    for i, prompt in enumerate(prompts):
        where = f"prompt {i}: " if len(prompts) > 1 else ""
        check_max_tokens(name, max_tokens, len(prompt), server.engine.max_model_len, where)


async def submit(server: Server, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 request: Request) -> list[RequestStream]:
    """Hand every prompt to the engine at once (they join the same step). If one is refused,
    the others are taken back, and the refusal becomes its 4xx or 503. One prompt runs under
    the request's id, a batch's under id-0, id-1, ... (as in vLLM)."""
    engine = server.engine
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    adds = asyncio.gather(*(engine.add(i, p, params) for i, p in zip(ids, prompts)), return_exceptions=True)
    try:
        results = await unless_disconnected(request, adds)
    except ClientGone:
        for i in ids:  # the ones already taken in, and those still on their way (unknown ids are ignored)
            engine.abort(i)
        raise
    refusals = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    if not refusals:
        return results
    for i, result in zip(ids, results):
        if isinstance(result, RequestStream):
            engine.abort(i)
    i, err = refusals[0]
    where = f"prompt {i}: " if len(prompts) > 1 else ""
    if isinstance(err, ValueError):
        raise APIError(400, f"{where}{err}")
    if isinstance(err, Overloaded):
        raise APIError(503, str(err), kind="server_overloaded")
    if isinstance(err, EngineDead):
        raise server_error(err)
    raise err


async def answer(server: Server, streams: list[RequestStream], chunks: Chunks,
                 body: CompletionRequest | ChatCompletionRequest, request: Request,
                 respond: Callable[[list[RequestOutput]], dict[str, Any]],
                 shown: Callable[[RequestOutput], RequestOutput] | None = None) -> Response:
    """Stream the outputs as server-sent events (if the body asks), or wait for every prompt's
    last output and answer once (respond: the prompts' final outputs -> the body). shown: what
    the client sees of an output (prompt_only, to score a prompt), or None for all of it."""
    shown = shown or (lambda output: output)
    if body.stream:
        outputs = ((i, shown(output)) async for i, output in merge(streams))
        events = stream_events(outputs, chunks, *body.stream_usage(server.force_include_usage))
        return StreamingResponse(abort_if_left(server, streams, events), media_type="text/event-stream")
    try:
        outputs = await unless_disconnected(request, asyncio.gather(*(s.final() for s in streams)))
    except ClientGone:
        for stream in streams:
            server.engine.abort(stream.request_id)
        raise
    except EngineDead as err:
        raise server_error(err)
    return JSONResponse(respond([shown(output) for output in outputs]))


async def abort_if_left(server: Server, streams: list[RequestStream], events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Relay the events; if the client disconnects first, Starlette cancels this generator at
    its current `await`, and the `finally` aborts the requests still running (their KV blocks
    are freed before the engine's next step). If making an event fails, the stream ends with an
    error event: the 200 and the events before it are already on their way."""
    try:
        async for event in events:
            yield event
    except Exception as err:  # not a disconnect: that cancels, which is no Exception
        if not isinstance(err, EngineDead):  # (the engine logged its own failure)
            log.exception("a streamed answer failed")
        error = server_error(err)
        yield sse(error_body(error.message, error.kind))
        yield DONE
    finally:
        for stream in streams:
            if not stream.done:
                server.engine.abort(stream.request_id)


def bad_request_unless(make: Callable[[], T]) -> T:
    """make(), with a ValueError (a value the engine refuses) as a 400."""
    try:
        return make()
    except ValueError as err:
        raise APIError(400, str(err))


def echo_of(text: str | None, token_ids: list[int], tokenizer: Any) -> Echo:
    """What echo sends back of a prompt: its text as given, or its token ids decoded (without
    a tokenizer: no text, and the first token by its id, as logprobs name tokens then)."""
    if tokenizer is None:
        return Echo(text or "", f"token_id:{token_ids[0]}")
    return Echo(tokenizer.decode(token_ids) if text is None else text, tokenizer.decode(token_ids[:1]))


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]], model_name: str, generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                **options: Any) -> list[int]:
    """The token ids of the messages rendered by the checkpoint's chat template, or the
    request's (render_chat), ending where the assistant's answer starts (generation_prompt), or
    inside the last message, left open for the model to continue (continue_final_message).
    options: render_chat's tools, documents and template_kwargs."""
    if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise APIError(400, f"the model `{model_name}` has no chat template, so it cannot chat: use "
                            "/v1/completions, or start the server with --chat-template FILE")
    try:
        return render_chat(tokenizer, messages, chat_template, generation_prompt, continue_final_message,
                           **options)[1]
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
        elif e.get("type") == "value_error":  # a validator's own sentence, without pydantic's "Value error, "
            error = e.get("ctx", {}).get("error", e.get("msg"))
            messages.append(f"{field}: {error}" if field else str(error))
        else:
            messages.append(f"{field}: {e.get('msg')}" if field else str(e.get("msg")))
        params.append(field)
    return "; ".join(messages), params[0] if params else None
