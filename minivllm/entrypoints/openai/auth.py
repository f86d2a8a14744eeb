"""Access control (chapter 10): `minivllm serve --api-key KEY` (or the environment variable
MINIVLLM_API_KEY, else vLLM's VLLM_API_KEY) makes every /v1 route want the header `Authorization: Bearer KEY`, as vLLM's
--api-key does. Without it the answer is 401 with OpenAI's error body. /health and /metrics stay
open: load balancers and Prometheus ask them without credentials, and they hold no one's text.

It is a plain ASGI middleware, in front of every route: a request without the key never reaches
a handler, so it cannot queue work, and a route added later is covered without a decorator.
Keys are compared in constant time, on their SHA-256 digests: comparing the strings themselves
would stop at the first differing character, and the time an answer takes would tell an
attacker how much of a guess is right; comparing digests of fixed length also hides the key's
length. An API key only keeps out who lacks it; on a network, it needs TLS (a proxy in front)
to stay secret.
"""
from __future__ import annotations

import hashlib
import hmac

from starlette.responses import JSONResponse
from starlette.routing import get_route_path
from starlette.types import ASGIApp, Receive, Scope, Send

from minivllm.entrypoints.openai.responses import error_body

API_KEY_VARIABLE = "MINIVLLM_API_KEY"
VLLM_API_KEY_VARIABLE = "VLLM_API_KEY"  # vLLM's name, read when MINIVLLM_API_KEY is not set: a vLLM deployment stays closed


def check_api_key(api_key: object) -> None:
    """A key a client can send in a header: a non-empty string of visible ASCII characters."""
    if not isinstance(api_key, str) or not api_key or not all("!" <= ch <= "~" for ch in api_key):
        raise ValueError("an API key must be a non-empty string of visible ASCII characters (no spaces), got "
                         + (repr(api_key) if not isinstance(api_key, str) else f"{len(api_key)} characters"))


def protected(path: str) -> bool:
    """The routes that want the key: everything under /v1, and SageMaker's /invocations, which
    generates as /v1 does. `path` is the route's path, after any --root-path."""
    return path in ("/v1", "/invocations") or path.startswith("/v1/")


class APIKeyMiddleware:
    """Answers 401 to a /v1 request whose Authorization header is not `Bearer <api_key>`."""

    def __init__(self, app: ASGIApp, api_key: str):
        check_api_key(api_key)
        self.app = app
        self.digest = hashlib.sha256(api_key.encode()).digest()

    def authorized(self, scope: Scope) -> bool:
        # The raw header bytes (ASGI gives names in lower case): no decoding to get wrong.
        value = next((v for name, v in scope["headers"] if name == b"authorization"), b"")
        scheme, _, key = value.partition(b" ")
        matches = hmac.compare_digest(hashlib.sha256(key.strip()).digest(), self.digest)  # whatever the scheme
        return matches and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and protected(get_route_path(scope)) and not self.authorized(scope):
            body = error_body("Incorrect or missing API key: send the header `Authorization: Bearer <key>`",
                              param="Authorization", code="invalid_api_key")
            await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)
