"""The serving edge of a deployment held behind a foreign router: an HTTP pass-through on the
host's loopback, in front of the router, that stamps when each request came in and when its
first and last tokens went out, keyed by the id its answer carries (the id the nodes logged it
under). A held run's records take their client stamps from here, so their TTFT holds what a
client waits for at the deployment's door, the router's own work included (with vllm-router's
cache_aware, tens of milliseconds matching the prompt text), as a run through the testbed's
router stamps at the router. Bytes pass unchanged both ways; the edge only reads the answer's
SSE events as they go by (`AnswerScan`, I/O-free)."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import aiohttp
from aiohttp import web

from testbed.live.clock import now

# In the run directory: one JSON line per request the edge passed on.
EDGE_LOG = "edge.jsonl"
# Hop-by-hop headers (RFC 9110 7.6.1) and the ones aiohttp sets itself for the new hop.
_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
MAX_BODY = 256 * 1024 * 1024  # a prompt of tens of millions of characters still passes
ERROR_TEXT = 300  # characters of a router's error answer kept as the record's reason


@dataclass
class AnswerScan:
    """What an answer said as its bytes went by: the request id it carries (`id`, or SGLang's
    `meta_info.id`), when its first and last token events passed (server-sent events whose
    choices or text hold tokens; a final usage chunk and `[DONE]` are not tokens)."""

    streamed: bool
    request_id: str = ""
    first_token: float | None = None
    last_token: float | None = None
    _buf: bytes = b""
    _body: bytearray = field(default_factory=bytearray)

    def feed(self, data: bytes, t: float) -> None:
        if not self.streamed:
            if len(self._body) < 1 << 20:  # an id is near the top; a huge answer is not kept whole
                self._body += data
            return
        self._buf += data
        while True:
            cut = self._buf.find(b"\n\n")
            if cut < 0:
                break
            event, self._buf = self._buf[:cut], self._buf[cut + 2 :]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._event(line[5:].strip(), t)

    def end(self) -> None:
        """The answer is whole: a non-streamed one gives its id now."""
        if not self.streamed and self._body:
            obj = _json(bytes(self._body))
            if obj is not None:
                self.request_id = self.request_id or _id(obj)

    def _event(self, payload: bytes, t: float) -> None:
        if payload == b"[DONE]":
            return
        obj = _json(payload)
        if obj is None:
            return
        self.request_id = self.request_id or _id(obj)
        choices = obj.get("choices")
        if (isinstance(choices, list) and choices) or "text" in obj:
            if self.first_token is None:
                self.first_token = t
            self.last_token = t


def _json(raw: bytes) -> dict[str, object] | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _id(obj: dict[str, object]) -> str:
    rid = obj.get("id")
    meta = obj.get("meta_info")
    if not isinstance(rid, str) and isinstance(meta, dict):
        rid = meta.get("id")
    return rid if isinstance(rid, str) else ""


@dataclass(frozen=True)
class EdgeLine:
    """One request as the edge saw it (unix seconds). `request_id` is the answer's id, or
    `edge-<n>` for an answer that carried none (a router's error)."""

    request_id: str
    path: str
    status: int
    arrival: float
    first_token: float | None
    last_token: float | None
    error: str = ""

    def as_json(self) -> dict[str, object]:
        return {
            "request_id": self.request_id,
            "path": self.path,
            "status": self.status,
            "edge_arrival": self.arrival,
            "edge_first_token": self.first_token,
            "edge_last_token": self.last_token,
            "error": self.error,
        }


def read_edge_log(path: Path) -> dict[str, EdgeLine]:
    """The edge's lines by request id (a line cut short by a kill is skipped)."""
    out: dict[str, EdgeLine] = {}
    if not path.exists():
        return out
    for raw in path.read_text().splitlines():
        obj = _json(raw.encode())
        if obj is None or not isinstance(obj.get("request_id"), str):
            continue
        out[str(obj["request_id"])] = EdgeLine(
            str(obj["request_id"]),
            str(obj.get("path", "")),
            _int(obj.get("status")),
            _float(obj.get("edge_arrival")) or 0.0,
            _float(obj.get("edge_first_token")),
            _float(obj.get("edge_last_token")),
            str(obj.get("error", "")),
        )
    return out


def _float(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _int(v: object) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


# The routes a client generates through; other calls (model lists, health) pass unlogged.
GENERATION = ("/v1/completions", "/v1/chat/completions", "/generate")


class Edge:
    """The pass-through: `start()` listens on 127.0.0.1:`port` (0: a free one) and forwards
    every request to `upstream`; `stop()` closes it and the log."""

    def __init__(self, upstream: str, log_path: Path, port: int = 0, clock: Callable[[], float] = now) -> None:
        self.upstream = upstream.rstrip("/")
        self.port = port
        self._clock = clock
        self._log: IO[str] = log_path.open("a", buffering=1)  # line-buffered: a kill loses no finished line
        self._unnamed = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        # No total timeout: an answer streams as long as the decode does. auto_decompress off: the
        # bytes pass as the router sent them.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
            auto_decompress=False,
            connector=aiohttp.TCPConnector(limit=0),
        )
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_route("*", "/{tail:.*}", self._pass)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._log.close()

    async def _pass(self, request: web.Request) -> web.StreamResponse:
        arrival = self._clock()
        assert self._session is not None
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        logged = request.method == "POST" and request.path.startswith(GENERATION)
        try:
            up = await self._session.request(
                request.method, self.upstream + request.rel_url.raw_path_qs, data=body, headers=headers
            )
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            why = f"the router did not answer: {type(e).__name__}: {e}"
            if logged:
                self._write(EdgeLine(self._name(), request.path, 502, arrival, None, None, why))
            return web.Response(status=502, text=why + "\n")
        async with up:
            resp = web.StreamResponse(
                status=up.status,
                reason=up.reason,
                headers={k: v for k, v in up.headers.items() if k.lower() not in _HOP},
            )
            await resp.prepare(request)
            scan = AnswerScan(streamed=up.headers.get("Content-Type", "").startswith("text/event-stream"))
            kept = bytearray()
            try:
                async for data in up.content.iter_any():
                    scan.feed(data, self._clock())
                    if up.status >= 400 and len(kept) < ERROR_TEXT:
                        kept += data
                    await resp.write(data)
                scan.end()
                await resp.write_eof()
            finally:
                if logged:
                    error = "" if up.status < 400 else f"the router answered {up.status}: " + _text(kept)
                    first, last = (scan.first_token, scan.last_token) if scan.streamed else (None, None)
                    rid = scan.request_id or self._name()
                    self._write(EdgeLine(rid, request.path, up.status, arrival, first, last, error))
        return resp

    def _name(self) -> str:
        self._unnamed += 1
        return f"edge-{self._unnamed}"

    def _write(self, line: EdgeLine) -> None:
        if not self._log.closed:
            self._log.write(json.dumps(line.as_json()) + "\n")


def _text(raw: bytes | bytearray) -> str:
    return bytes(raw[:ERROR_TEXT]).decode("utf-8", "replace").strip()
