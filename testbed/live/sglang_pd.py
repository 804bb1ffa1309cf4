"""SGLang's PD protocol on the mock nodes (`nodes.protocol: sglang`), as sglang-router 0.3.2
calls it (requests recorded in tests/fixtures/routers/sglang-router.json).

The router sends one request to a prefill and a decode node at once (/generate,
/v1/completions or /v1/chat/completions) with `bootstrap_host`, `bootstrap_port` and a random
64-bit `bootstrap_room`. The prefill node's bootstrap service (POST /testbed/bootstrap on its
HTTP port, which is the bootstrap port the router is given) takes the decode node's
registration for the room: where its KV receiver is. The prefill waits for that registration
(up to BOOTSTRAP_TIMEOUT_S), then computes and *pushes* the KV layer by layer as it is computed,
over the testbed's TCP KV transport (the shaped link when the prefill is remote); it answers
once every byte is handed to TCP. The decode node registers, waits for the KV, decodes and
answers in the request's shape. The transfer is arranged before the prefill starts.

sglang-router sends no request id header: both nodes log their stamps under `room-<room>`, the
id the decode's answer carries. Start-up routes: /health, /server_info, /model_info (and the
`get_` spellings), /get_load for power_of_two.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from testbed.core.engine.prefill_queue import PrefillJob
from testbed.live import decode_node, prefill_node
from testbed.live.clock import now
from testbed.live.common import ServiceConfig, bad_request
from testbed.live.credentials import SECRET_HEADER
from testbed.live.engine_load import add_load_route
from testbed.live.openai_api import Limits, ParsedRequest, full_response
from testbed.live.stage_log import StageLog
from testbed.live.vllm_pd import (
    admit_and_answer,
    error_response,
    generate_answer,
    openai_kind,
    parse_request,
    prefix_after_hint,
    prefix_hint,
    read_body,
)

BOOTSTRAP_PATH = "/testbed/bootstrap"
# How long a prefill waits for its decode node to register for the room (SGLang's
# SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT is 300 s; a registration here takes one HTTP call).
BOOTSTRAP_TIMEOUT_S = 30.0
ROOM_MAX = (1 << 64) - 1


@dataclass
class Rooms:
    """The prefill side's bootstrap service: per room, the decode node registered for it."""

    log: StageLog
    waiting: dict[int, asyncio.Future[str]] = field(default_factory=dict)

    def slot(self, room: int) -> asyncio.Future[str]:
        fut = self.waiting.get(room)
        if fut is None:
            fut = self.waiting[room] = asyncio.get_running_loop().create_future()
        return fut


@dataclass
class SglangDecode:
    log: StageLog
    session: aiohttp.ClientSession | None = None


ROOMS = web.AppKey("sglang_rooms", Rooms)
SGLANG_DECODE = web.AppKey("sglang_decode", SglangDecode)


def transfer_id(room: int) -> int:
    """The KV transfer id of a room: the receiver's ids are below 2**63."""
    return room & ((1 << 62) - 1)


def _room(body: dict[str, object]) -> tuple[str, int, int]:
    host, port, room = body.get("bootstrap_host"), body.get("bootstrap_port"), body.get("bootstrap_room")
    if not isinstance(host, str) or not host:
        raise bad_request(
            "this node serves only SGLang's disaggregated requests: field 'bootstrap_host' is required "
            "(a PD router adds bootstrap_host, bootstrap_port and bootstrap_room)"
        )
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise bad_request("field 'bootstrap_port' must be a port number")
    if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room <= ROOM_MAX:
        raise bad_request("field 'bootstrap_room' must be an integer in [0, 2**64)")
    return host, port, room


def _parse(request: web.Request, body: dict[str, object], limits: Limits) -> tuple[ParsedRequest, bool]:
    """The request as the OpenAI parser takes it, and whether it is /generate."""
    if request.path != "/generate":
        return parse_request(body, openai_kind(request), limits), False
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise bad_request("field 'sampling_params' must be an object")
    prompt = body.get("input_ids") if body.get("input_ids") is not None else body.get("text")
    if prompt is None:
        raise bad_request("field 'text' or 'input_ids' is required")
    as_openai: dict[str, object] = {"prompt": prompt, "stream": bool(body.get("stream"))}
    if sp.get("max_new_tokens") is not None:
        as_openai["max_tokens"] = sp["max_new_tokens"]
    if sp.get("min_new_tokens") is not None:
        as_openai["min_tokens"] = sp["min_new_tokens"]
    return parse_request(as_openai, "completions", limits), True


# -- prefill side


async def handle_bootstrap(request: web.Request) -> web.Response:
    """POST /testbed/bootstrap {room, decode_node}: the decode node registers for a room."""
    st = request.app[prefill_node.STATE]
    rooms = request.app[ROOMS]
    body = await read_body(request)
    room, dnode_id = body.get("room"), str(body.get("decode_node"))
    dnode = st.cfg.deployment.nodes.get(dnode_id)
    if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room <= ROOM_MAX:
        raise bad_request("field 'room' must be an integer in [0, 2**64)")
    if dnode is None or dnode.role != "decode" or dnode.kv is None:
        raise bad_request(f"field 'decode_node': unknown decode node {dnode_id!r}")
    fut = rooms.slot(room)
    if fut.done():
        raise bad_request(f"room {room} already has a decode node")
    fut.set_result(dnode_id)
    return web.json_response({"room": room, "registered": now()})


async def prefill_request(request: web.Request) -> web.StreamResponse:
    st = request.app[prefill_node.STATE]
    rooms = request.app[ROOMS]
    sc = st.cfg.deployment.scenario
    body = await read_body(request)
    _, _, room = _room(body)
    req, generate = _parse(request, body, Limits(sc.model.max_context_tokens, sc.serving.max_output_tokens))
    rid = f"room-{room}"
    arrival = now()
    fut = rooms.slot(room)
    try:
        dnode_id = await asyncio.wait_for(asyncio.shield(fut), BOOTSTRAP_TIMEOUT_S)
    except TimeoutError:
        reason = f"no decode node registered for room {room} within {BOOTSTRAP_TIMEOUT_S:g} s"
        rooms.log.write(rid, stage="prefill", prefill_arrival=arrival, error=reason)
        return error_response(500, reason)
    finally:
        rooms.waiting.pop(room, None)
    kv = st.cfg.deployment.nodes[dnode_id].kv
    assert kv is not None
    tokens = req.input_tokens
    cached, ship_from = prefix_hint(body, tokens)
    after = prefix_after_hint(body)
    duration = st.cfg.scale.wire_seconds(st.model_time(tokens - cached, cached))
    job = PrefillJob(rid, tokens - cached, cached, duration, after=after)
    rep = await prefill_node.run_job(st, job, (kv.host, kv.port), tokens, ship_from, None, transfer_id(room))
    t = rep.times
    layer_bytes = st.kv.layer_bytes(tokens, ship_from, sc.scale.byte_scale)
    rooms.log.write(
        rid,
        stage="prefill",
        prefill_arrival=arrival,
        prefill_queued=t.prefill_queued,
        prefill_start=t.prefill_start,
        prefill_end=t.prefill_end,
        transfer_start=t.transfer_start,
        transfer_first_sent=t.transfer_first_sent,
        transfer_sent=t.transfer_sent,
        input_tokens=tokens,
        prefill_modelled=duration,
        kv_bytes_wire=sum(layer_bytes),
        kv_bytes_paper=sum(st.kv.layer_bytes(tokens, ship_from, 1.0)),
        error=rep.error or None,
    )
    if rep.error:
        return error_response(500, rep.error)
    # SGLang's prefill server answers with its one computed token; the router returns the decode's.
    if generate:
        return web.json_response(generate_answer(req, rid, 1, "length"))
    return web.json_response(full_response(req, rid, req.model or sc.model.name, 1, {}))


# -- decode side


async def decode_request(request: web.Request) -> web.StreamResponse:
    st = request.app[decode_node.STATE]
    sd = request.app[SGLANG_DECODE]
    sc = st.cfg.deployment.scenario
    body = await read_body(request)
    host, port, room = _room(body)
    req, generate = _parse(request, body, Limits(sc.model.max_context_tokens, sc.serving.max_output_tokens))
    rid = f"room-{room}"
    if rid in st.streams:
        raise bad_request(f"room {room} is already decoding here")
    stamps: dict[str, float | int | str | None] = {"decode_arrival": now()}
    arrived = st.receiver.expect(transfer_id(room))
    q: asyncio.Queue[decode_node.StreamEvent] = asyncio.Queue()
    st.streams[rid] = q
    assert sd.session is not None
    try:
        reg = {"room": room, "decode_node": st.cfg.node_id}
        headers = {SECRET_HEADER: st.cfg.deployment.credentials.run_secret}
        try:
            async with sd.session.post(f"http://{host}:{port}{BOOTSTRAP_PATH}", json=reg, headers=headers) as r:
                if r.status != 200:
                    reason = f"bootstrap at {host}:{port} answered {r.status}: {(await r.text())[:300]}"
                    sd.log.write(rid, stage="decode", **stamps, error=reason)
                    return error_response(502, reason)
        except aiohttp.ClientError as e:
            sd.log.write(rid, stage="decode", **stamps, error=f"bootstrap at {host}:{port} failed: {e}")
            return error_response(502, f"bootstrap at {host}:{port} failed: {e}")
        stamps["registered"] = now()
        model = req.model or sc.model.name
        return await admit_and_answer(request, st, req, rid, model, q, stamps, sd.log, arrived, generate)
    finally:
        st.streams.pop(rid, None)
        if st.loop.abort(rid):
            st.wakeup.set()


# -- what sglang-router reads at start-up and for power_of_two


def _info_routes(app: web.Application, cfg: ServiceConfig, role: str) -> None:
    sc = cfg.deployment.scenario

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": sc.model.name,
                "served_model_name": sc.model.name,
                "disaggregation_mode": role,
                "tp_size": 1,
                "dp_size": 1,
                "page_size": sc.model.block_tokens,
                "max_total_num_tokens": sc.model.max_context_tokens,
            }
        )

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": sc.model.name, "tokenizer_path": sc.model.name, "is_generation": True})

    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    add_load_route(app, role)


ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


def make_prefill_app(cfg: ServiceConfig) -> web.Application:
    app = prefill_node.make_app(cfg, testbed_routes=False)
    log = StageLog(cfg)
    app[ROOMS] = Rooms(log)
    for path in ROUTES:
        app.router.add_post(path, prefill_request)
    app.router.add_post(BOOTSTRAP_PATH, handle_bootstrap)
    _info_routes(app, cfg, "prefill")

    async def close(app: web.Application) -> AsyncIterator[None]:
        yield
        log.close()

    app.cleanup_ctx.append(close)
    return app


def make_decode_app(cfg: ServiceConfig) -> web.Application:
    app = decode_node.make_app(cfg, testbed_routes=False)
    log = StageLog(cfg)
    sd = SglangDecode(log)
    app[SGLANG_DECODE] = sd

    async def session(app: web.Application) -> AsyncIterator[None]:
        sd.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        yield
        await sd.session.close()
        log.close()

    app.cleanup_ctx.append(session)
    for path in ROUTES:
        app.router.add_post(path, decode_request)
    _info_routes(app, cfg, "decode")
    return app
