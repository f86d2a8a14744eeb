"""A cap on the size of a request body (`minivllm serve --max-request-bytes`, issue 36).

Why: a server that reads any body whole before looking at it can be made to hold a 20 MB JSON
string, parse it, and tokenize it, all before it can say no; one such request slows everyone
else. A prompt the model could read is at most max_model_len tokens, a few bytes each, so a
body of megabytes is a mistake (or an attack) long before it is a prompt.

How: a plain ASGI middleware in front of every route. A body that announces its length
(Content-Length) above the cap is answered 413 before a byte of it is read. One sent in
chunks without a length is read up to the cap and no further: past it, 413. A body within the
cap is handed on to the route unchanged (the route would read it whole anyway).

The price: a body within the cap is held once more, here, while it arrives.
"""
from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minivllm.entrypoints.openai.responses import error_body

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # 4 MiB: room for a long context of text or token ids in JSON


def too_large(limit: int) -> JSONResponse:
    return JSONResponse(error_body(f"the request body is larger than this server's limit of {limit} bytes "
                                   f"(minivllm serve --max-request-bytes)", code="request_too_large"), 413)


class BodyLimitMiddleware:
    """Answers 413 to a request whose body is over `max_bytes`, reading no more of it than that."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for name, v in scope["headers"] if name == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await too_large(self.max_bytes)(scope, receive, send)
            return
        if length is not None:  # announced and within the cap: the server reads no more than announced
            await self.app(scope, receive, send)
            return
        body, more = [], True
        size = 0
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: nobody to answer
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await too_large(self.max_bytes)(scope, receive, send)
                return
            body.append(message.get("body", b""))
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
