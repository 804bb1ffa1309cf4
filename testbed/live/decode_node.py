"""Mock decode instance: waits for all of a request's KV, admits it into the continuous batch
(BS_max and KV memory permitting), runs calibrated steps and streams token counts.

POST /decode {request_id, transfer_id, input_tokens, output_tokens, kv_bytes_paper}
  -> 200, NDJSON stream: {"event": "kv", ...} {"event": "admitted", ...}
     {"event": "tokens", "n": cumulative, "t": ...}... {"event": "done", ...}
     or {"event": "error", "kind": a FailureKind, "reason": ...}. Closing the request aborts the sequence.
POST /testbed/fault {slow, until_s} -> step times x slow until then (a slowed instance).
GET /status -> {running, waiting, bs_max, kv_used_bytes, kv_capacity_bytes}: the batch, for the
     router's long-term loop (`testbed.live.role_control`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry

from testbed.core.engine.decode_batch import AdmissionError, Batch
from testbed.core.engine.decode_blocks import decode_batch_for
from testbed.core.engine.decode_loop import KV_TIMEOUT_S, DecodeLoop, decode_seq
from testbed.core.engine.kvsize import KVModel
from testbed.core.failures import FailureKind as K
from testbed.core.fault_timeline import SlowDown
from testbed.core.json_types import JSONObject
from testbed.live.clock import now, sleep_until
from testbed.live.common import (
    REGISTRY_KEY,
    DecodeStatus,
    ServiceConfig,
    add_common_routes,
    add_fault_route,
    bad_request,
    int_field,
    node_middlewares,
    node_request,
)
from testbed.live.kv_transport import KVReceiver, receiver_idle_timeout
from testbed.live.prom import ScrapeTimeMetrics
from testbed.live.series import sample_forever
from testbed.metrics.series_format import Sample, SeriesWriter

log = logging.getLogger("testbed.decode")

StreamEvent = JSONObject  # one event of a request's decode stream ({"event": ..., ...})


@dataclass
class DecodeState:
    cfg: ServiceConfig
    loop: DecodeLoop
    receiver: KVReceiver
    kv: KVModel
    stream_interval: int
    streams: dict[str, asyncio.Queue[StreamEvent]] = field(default_factory=dict)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    completed: int = 0

    @property
    def batch(self) -> Batch:
        return self.loop.batch

    @property
    def slow(self) -> SlowDown:
        return self.loop.slow


STATE = web.AppKey("decode_state", DecodeState)


async def _batch_loop(st: DecodeState) -> None:
    """Drives the instance's `DecodeLoop` on the wall clock (step ends are absolute deadlines)."""
    loop = st.loop
    while True:
        if loop.idle:
            st.wakeup.clear()
            await st.wakeup.wait()
            loop.rest()
            continue
        # Admission is stamped when it happens: a sequence whose KV landed after the previous
        # step's deadline joins this step late, never before its KV existed.
        t = now()
        admitted, end = loop.begin(t)
        for s in admitted:
            st.streams[s.request_id].put_nowait({"event": "admitted", "t": t})
        if end is None:
            # The FCFS head waits for memory that only a finishing sequence can free.
            st.wakeup.clear()
            await st.wakeup.wait()
            loop.rest()
            continue
        await sleep_until(end)
        te = now()
        for r in loop.end_step():
            s = r.seq
            q = st.streams.get(s.request_id)
            if q is None:
                continue
            if r.finished or s.generated == 1 or s.generated % st.stream_interval == 0:
                q.put_nowait({"event": "tokens", "n": s.generated, "t": te})
            if r.finished:
                st.completed += 1
                q.put_nowait({"event": "done", "t": te})


async def handle_decode(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    body, rid = await node_request(request)
    sc = st.cfg.deployment.scenario
    top = (1 << 63) - 1
    vals = {
        name: int_field(body, name, lo, hi)
        for name, lo, hi in (
            ("transfer_id", 0, top),
            ("input_tokens", 1, sc.model.max_context_tokens),
            ("output_tokens", 1, sc.serving.max_output_tokens),
            ("kv_bytes_paper", 0, top),
        )
    }
    if rid in st.streams:
        raise bad_request(f"request {rid!r} is already decoding here")

    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)

    async def emit(ev: StreamEvent) -> None:
        await resp.write(json.dumps(ev).encode() + b"\n")

    q: asyncio.Queue[StreamEvent] = asyncio.Queue()
    st.streams[rid] = q
    try:
        result = await asyncio.wait_for(st.receiver.expect(vals["transfer_id"]), KV_TIMEOUT_S)
        if not result.ok:
            await emit({"event": "error", "kind": K.KV_TRANSFER, "reason": f"kv transfer failed: {result.reason}"})
            return resp
        await emit({"event": "kv", "first_byte": result.first_byte, "complete": result.complete, "bytes": result.bytes})
        seq = decode_seq(st.kv, rid, vals["input_tokens"], vals["output_tokens"], vals["kv_bytes_paper"])
        try:
            st.loop.submit(seq)
        except AdmissionError as e:
            await emit({"event": "error", "kind": K.DECODE_ERROR, "reason": str(e)})
            return resp
        st.wakeup.set()
        while True:
            ev = await q.get()
            await emit(ev)
            if ev["event"] == "done":
                break
        await resp.write_eof()
        return resp
    except TimeoutError:
        await emit(
            {
                "event": "error",
                "kind": K.KV_TRANSFER,
                "reason": f"kv transfer did not complete within {KV_TIMEOUT_S:g} s",
            }
        )
        return resp
    finally:
        st.streams.pop(rid, None)
        if st.loop.abort(rid):
            st.wakeup.set()


async def handle_status(request: web.Request) -> web.Response:
    b = request.app[STATE].batch
    status: DecodeStatus = {
        "running": len(b.running),
        "waiting": len(b.waiting),
        "bs_max": b.bs_max,
        "kv_used_bytes": b.kv_used,
        "kv_capacity_bytes": b.kv_capacity,
    }
    return web.json_response(status)


def _collect(st: DecodeState) -> list[Sample]:
    return [Sample(*x) for x in st.loop.samples(st.receiver.bytes_received)]


def _metrics(reg: CollectorRegistry, st: DecodeState) -> None:
    """vLLM's scheduler and KV gauges and the testbed's counters, labelled as vLLM labels
    (`model_name`, `engine`: the node). The counters were gauges without the `_total` suffix before."""
    b = st.batch
    ScrapeTimeMetrics({"model_name": st.cfg.deployment.scenario.model.name, "engine": st.cfg.node_id}).gauge(
        "vllm:num_requests_running", "Sequences in the decode batch", lambda: len(b.running)
    ).gauge("vllm:num_requests_waiting", "Sequences with KV waiting for admission", lambda: len(b.waiting)).gauge(
        "vllm:kv_cache_usage_perc", "KV memory in use, fraction", lambda: b.kv_used / b.kv_capacity
    ).gauge(
        "vllm:gpu_cache_usage_perc",
        "KV memory in use, fraction (vLLM's older name, removed in vLLM 0.10)",
        lambda: b.kv_used / b.kv_capacity,
    ).gauge(
        "testbed_slowdown_factor",
        "Step-time factor of an injected slowdown in force (1: none)",
        lambda: st.slow.at(now()),
    ).counter("testbed_kv_bytes_received", "KV bytes received (wire)", lambda: st.receiver.bytes_received).counter(
        "testbed_decode_steps", "Decode steps run", lambda: st.loop.steps
    ).counter("testbed_decode_completed", "Sequences finished", lambda: st.completed).register(reg)


def make_app(cfg: ServiceConfig, testbed_routes: bool = True) -> web.Application:
    """The node's app; without `testbed_routes`, no work route: an engine protocol adds its own."""
    sc = cfg.deployment.scenario
    node = cfg.deployment.nodes[cfg.node_id]
    hw = sc.hardware[sc.cluster(node.cluster).hardware]
    if hw.decode is None:
        raise ValueError(f"{cfg.node_id}: hardware of cluster {node.cluster!r} has no decode profile")
    app = web.Application(client_max_size=1 << 20, middlewares=node_middlewares(cfg))
    reg = CollectorRegistry()
    app[REGISTRY_KEY] = reg
    slow = SlowDown()

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        receiver = KVReceiver(
            verify=sc.transfer.checksum,
            rcvbuf=sc.transfer.rcvbuf_bytes,
            idle_timeout=receiver_idle_timeout(sc.transfer.resume_timeout_s),
            allowed_hosts=cfg.deployment.node_hosts(),
        )
        assert node.kv is not None
        await receiver.start(cfg.deployment.kv_bind(cfg.node_id), node.kv.port)
        batch = decode_batch_for(hw, KVModel.from_spec(sc.model), sc.scale.speedup, compiled=False)
        st = DecodeState(
            cfg, DecodeLoop(batch, slow), receiver, KVModel.from_spec(sc.model), sc.serving.stream_interval
        )
        app[STATE] = st
        _metrics(reg, st)
        series = SeriesWriter(cfg.series_path(), cfg.node_id)
        tasks = [
            asyncio.create_task(_batch_loop(st)),
            asyncio.create_task(sample_forever(series, lambda: _collect(st), cfg.sample_interval)),
        ]
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await receiver.close()
        series.close()

    app.cleanup_ctx.append(lifecycle)
    if testbed_routes:
        app.router.add_post("/decode", handle_decode)
    app.router.add_get("/status", handle_status)
    add_common_routes(app)
    add_fault_route(app, slow)
    return app
