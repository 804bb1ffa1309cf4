"""Who may call what: the router's OpenAI routes need the deployment's API key, sent as the
`openai` package and vLLM-compatible load generators send it (`Authorization: Bearer KEY`);
control routes (a node's faults and work, the router's hold) need the run secret, which only the
deployment's own parts hold (`testbed.live.credentials`). /health and /metrics stay open, as on
real engines: health checks, Prometheus and foreign routers call them without credentials.

A wrong or missing key is answered 401 with OpenAI's error body; a missing or wrong run secret
403. Keys are compared in constant time (`hmac.compare_digest`).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web

from testbed.live.credentials import API_KEY_FILE, SECRET_HEADER

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = frozenset({"/health", "/metrics"})


def _same(given: str, want: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), want.encode())


def bearer(request: web.Request) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header (scheme case-insensitive), else None."""
    scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _error(status: int, message: str, code: str | None, headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    return web.Response(status=status, text=json.dumps(body), content_type="application/json", headers=headers)


def has_run_secret(request: web.Request, secret: str) -> bool:
    return _same(request.headers.get(SECRET_HEADER, ""), secret)


def forbidden(request: web.Request) -> web.Response:
    return _error(
        403,
        f"{request.method} {request.path} is for the deployment's own runner and router "
        f"(header {SECRET_HEADER}: the run's secret)",
        "forbidden",
    )


def api_key_middleware(
    api_key: str, prefixes: Iterable[str] = ("/v1/",)
) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Routes under `prefixes` answer 401 unless the request carries `api_key` as a Bearer token."""
    prefixes = tuple(prefixes)

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith(prefixes):
            token = bearer(request)
            if token is None or not _same(token, api_key):
                why = "You didn't provide an API key" if token is None else "Incorrect API key provided"
                return _error(
                    401,
                    f"{why}: send it as `Authorization: Bearer KEY` (the `openai` package's "
                    f"api_key). A held deployment prints its key and writes it to {API_KEY_FILE} "
                    "in its run directory.",
                    None if token is None else "invalid_api_key",
                    {"WWW-Authenticate": 'Bearer realm="testbed"'},
                )
        return await handler(request)

    return check


def run_secret_middleware(
    secret: str, open_paths: Iterable[str] = OPEN_PATHS, guarded: Callable[[str], bool] | None = None
) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Every route but `open_paths` (or, with `guarded`, those it names) answers 403 without the
    run secret."""
    open_ = frozenset(open_paths)

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        needs = guarded(request.path) if guarded is not None else request.path not in open_
        if needs and not has_run_secret(request, secret):
            return forbidden(request)
        return await handler(request)

    return check


# What foreign routers call on a node speaking an engine's protocol (`nodes.protocol` vllm or
# sglang): they cannot send the run secret. vllm-router 0.1.17 sends workers an empty
# `Authorization: Bearer` whatever the client sent; sglang-router 0.3.2 sends its own --api-key.
ENGINE_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/generate",
        "/server_info",
        "/get_server_info",
        "/model_info",
        "/get_model_info",
        "/get_load",
        "/v1/models",
    }
)


def engine_route_middleware(
    allowed_hosts: Iterable[str], api_key: str, paths: Iterable[str] = ENGINE_PATHS
) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Engine routes answer only the deployment's own addresses (its router's and nodes', as the
    KV receiver does) with 403, and 401 a non-empty Bearer token that is not the API key (an
    empty one is what vllm-router sends)."""
    hosts, guarded = frozenset(allowed_hosts), frozenset(paths)

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in guarded:
            if request.remote not in hosts:
                return _error(
                    403, f"{request.method} {request.path} answers only this deployment's router", "forbidden"
                )
            token = bearer(request)
            if token is not None and not _same(token, api_key):
                return _error(401, "Incorrect API key provided", "invalid_api_key")
        return await handler(request)

    return check
