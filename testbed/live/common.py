"""Pieces every live service shares: config, AppKeys, health and metrics routes."""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from testbed.core.fault_timeline import MAX_SLOW_FACTOR, MIN_SLOW_FACTOR, SlowDown
from testbed.core.json_types import JSONObject
from testbed.core.schema.scaling import Scale
from testbed.live.auth import ENGINE_PATHS, OPEN_PATHS, engine_route_middleware, run_secret_middleware
from testbed.live.clock import now
from testbed.live.deployment import Deployment

REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
SLOW_KEY = web.AppKey("slowdown", SlowDown)
# Run before each /metrics scrape (the router reads its decode nodes' KV usage then).
ScrapeHook = Callable[[web.Application], Awaitable[None]]
SCRAPE_KEY: web.AppKey[ScrapeHook] = web.AppKey("before_scrape")


@dataclass(frozen=True)
class ServiceConfig:
    deployment: Deployment
    node_id: str  # "router" for the router
    sample_interval: float = 0.1  # wire seconds between time-series samples

    @property
    def scale(self) -> Scale:
        return Scale.from_spec(self.deployment.scenario.scale)

    def series_path(self) -> Path | None:
        rd = self.deployment.run_dir
        return Path(rd) / "timeseries" / f"{self.node_id}.jsonl" if rd else None


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    hook = request.app.get(SCRAPE_KEY)
    if hook is not None:
        await hook(request.app)
    body = generate_latest(request.app[REGISTRY_KEY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# The request line and each header line at most this long (aiohttp's defaults; nginx's 8 KiB
# buffers), and at most MAX_HEADERS of them (clients send 10-20; aiohttp allows 128): a request's
# head is at most ~512 KiB. Longer or more is answered 400 and the connection closed.
MAX_LINE_BYTES = 8190
MAX_FIELD_BYTES = 8190
MAX_HEADERS = 64
# For a server with no scenario (the swarm WAN agent); the services take `serving.idle_timeout_s`.
IDLE_TIMEOUT_S = 75.0


class ServerArgs(TypedDict):
    keepalive_timeout: float
    max_line_size: int
    max_field_size: int
    max_headers: int


class PrefillStatus(TypedDict):
    """GET /status of a prefill node, wire units: queued modelled work (s), the KV sender's counters."""

    t: float
    queue_depth: int
    running: int
    backlog_s: float
    queued_s: float
    acked_bytes: int
    retrans_segments: int
    acked_segments: int
    undelivered_bytes: int
    kv_bytes_sent: int


class DecodeStatus(TypedDict):
    """GET /status of a decode node: its batch."""

    running: int
    waiting: int
    bs_max: int
    kv_used_bytes: int
    kv_capacity_bytes: int


def http_server_args(idle_timeout_s: float = IDLE_TIMEOUT_S) -> ServerArgs:
    """Keyword arguments for every aiohttp server the testbed runs (`web.AppRunner`,
    `web.run_app`). aiohttp keeps an idle connection for 3630 s by default (10,000 idle ones
    held the router's RSS 54 MB up); its keep-alive timer starts when a connection is accepted
    and again after each response, and is not reset by bytes that do not finish a request, so
    `idle_timeout_s` also bounds how long a request's line and headers may take (slowloris)."""
    return {
        "keepalive_timeout": idle_timeout_s,
        "max_line_size": MAX_LINE_BYTES,
        "max_field_size": MAX_FIELD_BYTES,
        "max_headers": MAX_HEADERS,
    }


def add_common_routes(app: web.Application) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)


async def fetch_status(session: aiohttp.ClientSession, url: str, timeout_s: float) -> JSONObject | None:
    """A node's `/status` body, or None when it does not answer in time or well: the control loops
    count such a node as serving nothing rather than stall on it."""
    try:
        async with session.get(f"{url}/status", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return None
            body = await r.json()
            return body if isinstance(body, dict) else None
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None


def status_number(status: Mapping[str, object], key: str, default: float | None = None) -> float:
    """A number of a node's /status body (`fetch_status`); ValueError naming the field otherwise."""
    v = status.get(key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ValueError(f"/status field {key!r} is not a number: {v!r}")
    return float(v)


def bad_request(msg: str) -> web.HTTPBadRequest:
    """OpenAI-shaped error body, so real clients surface the message."""
    body = json.dumps({"error": {"message": msg, "type": "invalid_request_error"}})
    return web.HTTPBadRequest(text=body, content_type="application/json")


async def node_request(request: web.Request) -> tuple[JSONObject, str]:
    """The JSON object of a router-to-node request and its request id; 400 naming the field."""
    try:
        body = await request.json()
    except ValueError:
        raise bad_request("body is not JSON") from None
    if not isinstance(body, dict):
        raise bad_request("body must be a JSON object")
    rid = body.get("request_id")
    if not isinstance(rid, str) or not rid:
        raise bad_request("field 'request_id' must be a non-empty string")
    return body, rid


def int_field(body: Mapping[str, object], name: str, minimum: int = 0, maximum: int = (1 << 63) - 1) -> int:
    v = body.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or not minimum <= v <= maximum:
        raise bad_request(f"field '{name}' must be an integer in [{minimum}, {maximum}]")
    return v


async def handle_fault(request: web.Request) -> web.Response:
    """POST /testbed/fault {"slow": k, "until_s": unix seconds | null}: every modelled service
    time of this node x k until `until_s` (null: until set again; k = 1 clears)."""
    try:
        body = await request.json()
    except ValueError:
        raise bad_request("body is not JSON") from None
    if not isinstance(body, dict):
        raise bad_request("body must be a JSON object")
    k, until = body.get("slow"), body.get("until_s")
    # JSON parsers take Infinity and NaN: `slow: Infinity` hung every request of the node, and a
    # finite 1e308 does the same: the factor is bounded as the scenario's slow fault is.
    if (
        not isinstance(k, (int, float))
        or isinstance(k, bool)
        or not math.isfinite(k)
        or not MIN_SLOW_FACTOR <= k <= MAX_SLOW_FACTOR
    ):
        raise bad_request(f"field 'slow' must be a number in [{MIN_SLOW_FACTOR:g}, {MAX_SLOW_FACTOR:g}]")
    if until is not None and (
        not isinstance(until, (int, float)) or isinstance(until, bool) or not math.isfinite(until) or until < 0
    ):
        raise bad_request("field 'until_s' must be finite unix seconds >= 0 or null")
    slow = request.app[SLOW_KEY]
    slow.set(float(k), None if until is None else float(until))
    return web.json_response({"ok": True, "slow": slow.factor, "until_s": slow.until, "t": now()})


def add_fault_route(app: web.Application, slow: SlowDown) -> None:
    app[SLOW_KEY] = slow
    app.router.add_post("/testbed/fault", handle_fault)


def node_middlewares(cfg: ServiceConfig) -> list[Any]:
    """A node serves its deployment only: every route but /health and /metrics needs the run
    secret, which the router and the runner send (`testbed.live.auth`)."""
    dep = cfg.deployment
    if dep.scenario.node_protocol == "testbed":
        return [run_secret_middleware(dep.credentials.run_secret)]
    # A foreign router calls the engine routes without the run secret: they check its address.
    hosts = dep.node_hosts() | {dep.router.host} | ({"127.0.0.1"} if dep.bind_loopback else set())
    return [
        engine_route_middleware(hosts, dep.credentials.api_key),
        run_secret_middleware(dep.credentials.run_secret, guarded=lambda p: p not in OPEN_PATHS | ENGINE_PATHS),
    ]
