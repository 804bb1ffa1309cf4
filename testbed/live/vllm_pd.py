"""vLLM's PD protocol on the mock nodes (`nodes.protocol: vllm`), as vllm-router and vLLM's
NixlConnector speak it (requests recorded from vllm-router 0.1.17 in tests/fixtures/routers).

Stage 1, prefill node: POST /v1/completions or /v1/chat/completions with `max_tokens: 1` and
`kv_transfer_params: {do_remote_decode: true, ...}`. The node computes the prompt and keeps its
KV (counted in `testbed_kv_held_bytes`); it answers a one-token completion whose
`kv_transfer_params` say where the KV waits: {do_remote_prefill: true, do_remote_decode: false,
remote_engine_id, remote_block_ids, remote_request_id, remote_host, remote_port, tp_size}.
`remote_host:remote_port` is the prefill node's HTTP address (NIXL's side channel here). The KV is
freed once pulled or after `nodes.kv_hold_timeout_s` (vLLM's abort timeout).

Stage 2, decode node: the original request with those `kv_transfer_params`. The decode node
asks `remote_host:remote_port` to send it the held KV (POST /testbed/kv/pull, run secret); the
bytes cross the testbed's TCP KV transport to the decode's receiver, over the shaped link when
the prefill is remote, so every transfer starts after its prefill has ended. Then it decodes
and answers (streamed or not) as vLLM does.

Both stages carry vllm-router's `X-Request-Id`; each node logs its stamps under it
(`testbed.live.stage_log`). Requests a vLLM engine would serve but this pair cannot (a decode
node asked to prefill, a prefill node asked to decode) are refused with a 400 naming why.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from testbed.core.engine.decode_batch import AdmissionError
from testbed.core.engine.decode_loop import KV_TIMEOUT_S, decode_seq
from testbed.core.engine.prefill_queue import PrefillJob
from testbed.core.json_types import JSONObject
from testbed.core.kv.kv_receive_types import TransferResult
from testbed.live import decode_node, prefill_node
from testbed.live.clock import now
from testbed.live.common import REGISTRY_KEY, ServiceConfig, bad_request, int_field
from testbed.live.credentials import SECRET_HEADER
from testbed.live.engine_load import add_load_route
from testbed.live.kv_transport import TransferFailed
from testbed.live.openai_api import (
    EXTENSION,
    Limits,
    ParsedRequest,
    RequestError,
    chunk,
    full_response,
    parse,
    usage,
    usage_chunk,
)
from testbed.live.prom import ScrapeTimeMetrics
from testbed.live.stage_log import StageLog

REQUEST_ID_HEADER = "X-Request-Id"
PULL_PATH = "/testbed/kv/pull"
ENGINE_ID_PREFIX = "testbed-"


@dataclass
class Held:
    """A finished prefill's KV waiting for its decode node."""

    request_id: str
    tokens: int
    layer_bytes: list[int]
    prefill_end: float
    expiry: asyncio.TimerHandle | None = None

    @property
    def bytes(self) -> int:
        return sum(self.layer_bytes)


@dataclass
class VllmPrefill:
    log: StageLog
    held: dict[str, Held]
    expired: int = 0
    pulled: int = 0

    @property
    def held_bytes(self) -> int:
        return sum(h.bytes for h in self.held.values())


@dataclass
class VllmDecode:
    log: StageLog
    session: aiohttp.ClientSession | None = None


VLLM_PREFILL = web.AppKey("vllm_prefill", VllmPrefill)
VLLM_DECODE = web.AppKey("vllm_decode", VllmDecode)


def openai_kind(request: web.Request) -> str:
    return "chat" if request.path.endswith("/chat/completions") else "completions"


async def read_body(request: web.Request) -> dict[str, object]:
    try:
        body = await request.json()
    except ValueError:
        raise bad_request("body is not JSON") from None
    if not isinstance(body, dict):
        raise bad_request("body must be a JSON object")
    return body


def parse_request(body: dict[str, object], kind: str, limits: Limits) -> ParsedRequest:
    try:
        return parse(body, kind, limits)
    except RequestError as e:
        raise bad_request(str(e)) from None


def error_response(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "server_error" if status >= 500 else "invalid_request_error"}}
    return web.json_response(body, status=status)


def prefix_hint(body: Mapping[str, object], tokens: int) -> tuple[int, int]:
    """The mock engine's prefix-cache hit and the prefix its decode node holds, in tokens: a real
    engine finds these in its own prefix cache (vLLM's, SGLang's radix tree); the mock has none
    and takes the testbed router's `testbed.cached_tokens` / `decode_cached_tokens` (its books'
    view, as the testbed protocol's prefill request carries it), 0 without them."""
    ext = body.get(EXTENSION)
    hint = ext if isinstance(ext, dict) else {}

    def tok(key: str, default: int) -> int:
        v = hint.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= tokens:
            raise bad_request(f"field 'testbed.{key}' must be an integer in [0, {tokens}]")
        return v

    cached = tok("cached_tokens", 0)
    return cached, tok("decode_cached_tokens", cached)


def prefix_after_hint(body: Mapping[str, object]) -> str:
    """The request on this node whose prompt computes the end of the cached prefix, which the
    prefill then waits for (`testbed.prefix_after`, as the testbed protocol's `prefix_after`); ""
    without it. A real engine finds such blocks in its own cache once they are computed."""
    ext = body.get(EXTENSION)
    v = ext.get("prefix_after", "") if isinstance(ext, dict) else ""
    if not isinstance(v, str) or len(v) > prefill_node.MAX_ID_CHARS:
        raise bad_request(
            f"field 'testbed.prefix_after' must be a request id (a string of at most {prefill_node.MAX_ID_CHARS} "
            "characters)"
        )
    return v


# -- prefill side


async def prefill_completion(request: web.Request) -> web.Response:
    st = request.app[prefill_node.STATE]
    vs = request.app[VLLM_PREFILL]
    sc = st.cfg.deployment.scenario
    body = await read_body(request)
    ktp = body.get("kv_transfer_params")
    if not isinstance(ktp, dict) or ktp.get("do_remote_decode") is not True:
        raise bad_request(
            "this prefill node serves only vLLM's prefill stage: it needs "
            "'kv_transfer_params.do_remote_decode: true' (its KV is decoded elsewhere)"
        )
    if ktp.get("do_remote_prefill"):
        raise bad_request("'kv_transfer_params.do_remote_prefill' on a prefill node: it cannot decode")
    req = parse_request(body, openai_kind(request), Limits(sc.model.max_context_tokens, sc.serving.max_output_tokens))
    rid = request.headers.get(REQUEST_ID_HEADER) or f"cmpl-{uuid.uuid4().hex}"
    if rid in st.pending or rid in vs.held:
        raise bad_request(f"request {rid!r} is already here")
    arrival = now()
    tokens = req.input_tokens
    cached, ship_from = prefix_hint(body, tokens)
    after = prefix_after_hint(body)
    duration = st.cfg.scale.wire_seconds(st.model_time(tokens - cached, cached))
    job = PrefillJob(rid, tokens - cached, cached, duration, after=after)
    rep = await prefill_node.run_job(st, job, None, tokens, 0, None)
    t = rep.times
    if rep.error:
        vs.log.write(rid, stage="prefill", prefill_arrival=arrival, error=rep.error)
        return error_response(500, rep.error)
    # The decode pulls the blocks it lacks (vLLM's decode computes its own prefix hit first).
    layer_bytes = st.kv.layer_bytes(tokens, ship_from, sc.scale.byte_scale)
    held = Held(rid, tokens, layer_bytes, t.prefill_end)
    remote_id = f"{rid}-{uuid.uuid4().hex[:8]}"
    vs.held[remote_id] = held
    held.expiry = asyncio.get_running_loop().call_later(sc.nodes.kv_hold_timeout_s, _expire, vs, remote_id)
    vs.log.write(
        rid,
        stage="prefill",
        prefill_arrival=arrival,
        prefill_queued=t.prefill_queued,
        prefill_start=t.prefill_start,
        prefill_end=t.prefill_end,
        input_tokens=tokens,
        prefill_modelled=duration,
        kv_bytes_held=held.bytes,
        kv_bytes_paper=sum(st.kv.layer_bytes(tokens, ship_from, 1.0)),
        remote_request_id=remote_id,
    )
    http = st.cfg.deployment.nodes[st.cfg.node_id].http
    kv_params: JSONObject = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": ENGINE_ID_PREFIX + st.cfg.node_id,
        "remote_block_ids": list(range(-(-tokens // sc.model.block_tokens))),
        "remote_request_id": remote_id,
        "remote_host": http.host,
        "remote_port": http.port,
        "tp_size": 1,
    }
    out = full_response(req, rid, req.model or sc.model.name, 1, {"kv_transfer_params": kv_params})
    return web.json_response(out)


def _number(ev: JSONObject, key: str) -> float:
    """A number of a decode stream event (the node's own events: always there and numeric)."""
    v = ev[key]
    assert isinstance(v, int | float), (key, v)
    return float(v)


def _expire(vs: VllmPrefill, remote_id: str) -> None:
    held = vs.held.pop(remote_id, None)
    if held is not None:
        vs.expired += 1
        vs.log.write(held.request_id, stage="kv_expired", kv_freed=now())


async def handle_pull(request: web.Request) -> web.Response:
    """POST /testbed/kv/pull {remote_request_id, transfer_id, decode_node}: send the held KV to
    that decode node's receiver; answers once every byte is handed to TCP (404: not held)."""
    st = request.app[prefill_node.STATE]
    vs = request.app[VLLM_PREFILL]
    body = await read_body(request)
    remote_id, tid = body.get("remote_request_id"), int_field(body, "transfer_id")
    dnode = st.cfg.deployment.nodes.get(str(body.get("decode_node")))
    if dnode is None or dnode.role != "decode" or dnode.kv is None:
        raise bad_request(f"field 'decode_node': unknown decode node {body.get('decode_node')!r}")
    held = vs.held.pop(str(remote_id), None)
    if held is None:
        return error_response(404, f"no KV held for {remote_id!r}: never prefilled here, already pulled, or timed out")
    if held.expiry is not None:
        held.expiry.cancel()
    start = now()
    transfer = st.sender.start((dnode.kv.host, dnode.kv.port), tid, held.bytes, len(held.layer_bytes))
    for i, n in enumerate(held.layer_bytes):
        transfer.send_layer(i, n)
    try:
        sent = await transfer.finish()
    except TransferFailed as e:
        vs.log.write(held.request_id, stage="kv_pull", transfer_start=start, error=f"kv transfer failed: {e.reason}")
        return error_response(502, f"kv transfer failed: {e.reason}")
    vs.pulled += 1
    first = transfer.first_send
    vs.log.write(
        held.request_id,
        stage="kv_pull",
        transfer_start=start,
        transfer_first_sent=first,
        transfer_sent=sent,
        kv_bytes_wire=held.bytes,
    )
    return web.json_response({"transfer_start": start, "first_byte_sent": first, "sent": sent})


def make_prefill_app(cfg: ServiceConfig) -> web.Application:
    app = prefill_node.make_app(cfg, testbed_routes=False)
    log = StageLog(cfg)
    vs = VllmPrefill(log, {})
    app[VLLM_PREFILL] = vs
    app.router.add_post("/v1/completions", prefill_completion)
    app.router.add_post("/v1/chat/completions", prefill_completion)
    app.router.add_post(PULL_PATH, handle_pull)
    add_load_route(app, "prefill")
    ScrapeTimeMetrics({"model_name": cfg.deployment.scenario.model.name, "engine": cfg.node_id}).gauge(
        "testbed_kv_held_bytes", "KV of finished prefills waiting to be pulled", lambda: vs.held_bytes
    ).register(app[REGISTRY_KEY])

    async def close(app: web.Application) -> AsyncIterator[None]:
        yield
        for h in vs.held.values():
            if h.expiry is not None:
                h.expiry.cancel()
        log.close()

    app.cleanup_ctx.append(close)
    return app


# -- decode side


def _remote(ktp: Any) -> tuple[str, int, str]:
    if not isinstance(ktp, dict) or ktp.get("do_remote_prefill") is not True:
        raise bad_request(
            "this decode node serves only vLLM's decode stage: it needs 'kv_transfer_params' with "
            "'do_remote_prefill: true' from a prefill node's answer (it does not prefill)"
        )
    host, port, rrid = ktp.get("remote_host"), ktp.get("remote_port"), ktp.get("remote_request_id")
    if not isinstance(host, str) or not host:
        raise bad_request("field 'kv_transfer_params.remote_host' must be a non-empty string")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise bad_request("field 'kv_transfer_params.remote_port' must be a port number")
    if not isinstance(rrid, str) or not rrid:
        raise bad_request("field 'kv_transfer_params.remote_request_id' must be a non-empty string")
    return host, port, rrid


async def decode_completion(request: web.Request) -> web.StreamResponse:
    st = request.app[decode_node.STATE]
    vd = request.app[VLLM_DECODE]
    sc = st.cfg.deployment.scenario
    body = await read_body(request)
    host, port, rrid = _remote(body.get("kv_transfer_params"))
    req = parse_request(body, openai_kind(request), Limits(sc.model.max_context_tokens, sc.serving.max_output_tokens))
    rid = request.headers.get(REQUEST_ID_HEADER) or f"cmpl-{uuid.uuid4().hex}"
    if rid in st.streams:
        raise bad_request(f"request {rid!r} is already decoding here")
    model = req.model or sc.model.name
    stamps: dict[str, float | int | str | None] = {"decode_arrival": now()}
    tid = secrets.randbits(62)
    arrived = st.receiver.expect(tid)
    q: asyncio.Queue[decode_node.StreamEvent] = asyncio.Queue()
    st.streams[rid] = q
    assert vd.session is not None
    try:
        pull = {"remote_request_id": rrid, "transfer_id": tid, "decode_node": st.cfg.node_id}
        headers = {SECRET_HEADER: st.cfg.deployment.credentials.run_secret}
        stamps["kv_pull_sent"] = now()
        try:
            async with vd.session.post(f"http://{host}:{port}{PULL_PATH}", json=pull, headers=headers) as r:
                if r.status != 200:
                    reason = f"kv pull from {host}:{port} answered {r.status}: {(await r.text())[:300]}"
                    vd.log.write(rid, stage="decode", **stamps, error=reason)
                    return error_response(502 if r.status >= 500 else 500, reason)
        except aiohttp.ClientError as e:
            vd.log.write(rid, stage="decode", **stamps, error=f"kv pull from {host}:{port} failed: {e}")
            return error_response(502, f"kv pull from {host}:{port} failed: {e}")
        return await admit_and_answer(request, st, req, rid, model, q, stamps, vd.log, arrived)
    finally:
        st.streams.pop(rid, None)
        if st.loop.abort(rid):
            st.wakeup.set()


async def admit_and_answer(
    request: web.Request,
    st: decode_node.DecodeState,
    req: ParsedRequest,
    rid: str,
    model: str,
    q: asyncio.Queue[decode_node.StreamEvent],
    stamps: dict[str, float | int | str | None],
    log: StageLog,
    arrived: asyncio.Future[TransferResult],
    generate: bool = False,
) -> web.StreamResponse:
    """The decode side of both engine protocols once its KV is on its way (pulled, or pushed by the
    prefill): wait for it, stamp it, have the decode loop admit the request and answer its tokens;
    a KV that fails or does not come within KV_TIMEOUT_S, or a request that cannot fit, is a logged
    error answer."""
    try:
        res: TransferResult | None = await asyncio.wait_for(arrived, KV_TIMEOUT_S)
    except TimeoutError:
        res = None
    if res is None or not res.ok:
        reason = "kv transfer failed: " + (f"not complete within {KV_TIMEOUT_S:g} s" if res is None else res.reason)
        log.write(rid, stage="decode", **stamps, error=reason)
        return error_response(502, reason)
    stamps |= {
        "transfer_first_received": res.first_byte,
        "transfer_end": res.complete,
        "kv_bytes_received": res.bytes,
    }
    try:
        st.loop.submit(decode_seq(st.kv, rid, req.input_tokens, req.output_tokens))
    except AdmissionError as e:
        log.write(rid, stage="decode", **stamps, error=str(e))
        return error_response(500, str(e))
    st.wakeup.set()
    return await answer(request, req, rid, model, q, stamps, log, generate)


async def answer(
    request: web.Request,
    req: ParsedRequest,
    rid: str,
    model: str,
    q: asyncio.Queue[decode_node.StreamEvent],
    stamps: dict[str, float | int | str | None],
    log: StageLog,
    generate: bool = False,
) -> web.StreamResponse:
    """Tokens as the decode loop makes them: SSE chunks as vLLM streams them, or one response
    (`generate`: SGLang's /generate shape, cumulative text and meta_info)."""
    resp: web.StreamResponse | None = None
    if req.stream:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
    sent = 0
    while True:
        ev = await q.get()
        if ev["event"] == "admitted":
            stamps["decode_admitted"] = _number(ev, "t")
        elif ev["event"] == "tokens":
            n = min(int(_number(ev, "n")), req.output_tokens)
            if sent == 0:
                stamps["decode_first_token"] = _number(ev, "t")
            if resp is not None and n > sent:
                fin = req.output.finish if n >= req.output_tokens else None
                # continuous_usage_stats: the count so far in every chunk (a router counts tokens by it)
                extra: JSONObject | None = {"usage": usage(req, n)} if req.continuous_usage else None
                out = (
                    generate_answer(req, rid, n, fin)
                    if generate
                    else chunk(req, rid, model, sent, n - sent, fin, extra)
                )
                await resp.write(_sse(out))
            sent = max(sent, n)
        elif ev["event"] == "done":
            stamps |= {"decode_last_token": _number(ev, "t"), "output_tokens": sent}
            break
    log.write(rid, stage="decode", input_tokens=req.input_tokens, **stamps)
    if resp is None:
        if generate:
            return web.json_response(generate_answer(req, rid, sent, req.output.finish))
        return web.json_response(full_response(req, rid, model, sent, {}))
    if req.include_usage:
        await resp.write(_sse(usage_chunk(req, rid, model, sent)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def generate_answer(req: ParsedRequest, rid: str, tokens: int, finish: str | None) -> dict[str, object]:
    """SGLang's /generate answer after `tokens` tokens (streamed chunks carry the text so far)."""
    meta = {
        "id": rid,
        "finish_reason": None if finish is None else {"type": finish, "length": tokens},
        "prompt_tokens": req.input_tokens,
        "completion_tokens": tokens,
        "cached_tokens": 0,
    }
    return {"text": req.output.text(0, tokens), "meta_info": meta}


def _sse(obj: Mapping[str, object]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def make_decode_app(cfg: ServiceConfig) -> web.Application:
    app = decode_node.make_app(cfg, testbed_routes=False)
    log = StageLog(cfg)
    vd = VllmDecode(log)
    app[VLLM_DECODE] = vd

    async def session(app: web.Application) -> AsyncIterator[None]:
        vd.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        yield
        await vd.session.close()
        log.close()

    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/completions", decode_completion)
    app.router.add_post("/v1/chat/completions", decode_completion)
    add_load_route(app, "decode")
    return app
