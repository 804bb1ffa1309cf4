"""Mock prefill instance: calibrated compute layer by layer, KV streamed per layer. The core
`PrefillLoop` decides each job's lifecycle (FCFS, a moved-in prefix waited for), as the simulator's.

POST /prefill {request_id, transfer_id, input_tokens, cached_tokens, decode_node,
               [decode_cached_tokens], [cache_in_transfer]}
  -> 200 PrefillReport (`testbed.core.record`: its stamps, the modelled duration) once the
     compute has ended and every KV byte has been handed to TCP; 502 with the report's `error`
     set if the prefill or its transfer failed.
     The KV shipped is that of the tokens past `decode_cached_tokens` (what the decode side's
     cluster already holds; default `cached_tokens`) plus the linear state. With
     `cache_in_transfer`, the compute starts only once that transfer (a cached prefix moved here
     from another cluster, see /cache/send) has arrived at this node's KV receiver.
POST /testbed/fault {slow, until_s} -> compute times x slow until then (a slowed instance).
POST /cache/send {request_id, transfer_id, bytes, dest_node}
  -> 200 {start, sent} once `bytes` (wire) of cached KV are handed to TCP toward `dest_node`.
GET /status -> queue and sender state for the router's control loop (see `_status`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry

from testbed.core.engine.kvsize import KVModel
from testbed.core.engine.prefill_batch import BatchPolicy, PrefillPass, last_pass_layer_ready
from testbed.core.engine.prefill_loop import CACHE_IN_TIMEOUT_S, PrefillLoop, layer_ready
from testbed.core.engine.prefill_queue import PrefillJob
from testbed.core.engine.servicetime import PrefillTime
from testbed.core.failures import FailureKind as K
from testbed.core.fault_timeline import SlowDown
from testbed.core.record import NAN, PrefillReport, StageTimes, report_to_wire
from testbed.live.clock import now, sleep_until
from testbed.live.common import (
    REGISTRY_KEY,
    PrefillStatus,
    ServiceConfig,
    add_common_routes,
    add_fault_route,
    bad_request,
    int_field,
    node_middlewares,
    node_request,
)
from testbed.live.kv_sender import ConnectionStats, Dest
from testbed.live.kv_transport import KVReceiver, KVSender, TransferFailed, receiver_idle_timeout
from testbed.live.prom import ScrapeTimeMetrics
from testbed.live.series import sample_forever
from testbed.metrics.series_format import Sample, SeriesWriter

log = logging.getLogger("testbed.prefill")


@dataclass
class _Pending:
    job: PrefillJob
    transfer_id: int
    dest: tuple[str, int] | None  # None: the KV stays here until pulled (vLLM's protocol)
    tokens: int
    ship_from: int  # leading tokens whose KV the decode side already holds
    cache_in: int | None  # transfer id of a cached prefix moved here first
    done: asyncio.Future[PrefillReport]
    # batched: the moved-in prefix's arrival, before the job's first pass
    cache_wait_start: float = NAN
    cache_move_end: float = NAN
    cache_move_bytes: int = 0


@dataclass
class PrefillState:
    cfg: ServiceConfig
    loop: PrefillLoop
    sender: KVSender
    receiver: KVReceiver
    model_time: PrefillTime
    kv: KVModel
    pending: dict[str, _Pending] = field(default_factory=dict)
    running: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    started: dict[str, _Pending] = field(default_factory=dict)  # batched: in a pass, not yet ending
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    finishing: set[asyncio.Task[None]] = field(default_factory=set)
    completed: int = 0
    failed: int = 0
    moves_sent: int = 0
    # (dest, conn) -> (bytes sent, retransmits) at its last TCP sample: sending_connections.
    tcp_seen: dict[tuple[Dest, int], tuple[int, int]] = field(default_factory=dict)


STATE = web.AppKey("prefill_state", PrefillState)
MAX_ID_CHARS = 1024  # a `prefix_after` longer than any request id the router writes is refused


async def _compute_and_send(st: PrefillState, p: _Pending) -> None:
    job = p.job
    assert job.started_at is not None
    rep = PrefillReport(StageTimes(prefill_queued=job.queued_at), job.duration)
    if p.cache_in is not None:
        # The prefix moved in from another cluster must be here before attention can use it.
        rep.times.cache_wait_start = now()
        try:
            res = await asyncio.wait_for(st.receiver.expect(p.cache_in), CACHE_IN_TIMEOUT_S)
        except TimeoutError:
            raise TransferFailed(f"moved cached prefix did not arrive within {CACHE_IN_TIMEOUT_S:g} s") from None
        if not res.ok:
            raise TransferFailed(f"cache move failed: {res.reason}")
        rep.times.cache_move_end, rep.cache_move_bytes_wire = res.complete, res.bytes
        st.loop.prefix_arrived(job.request_id, now())
    assert st.loop.computing is job and job.started_at is not None
    rep.times.prefill_start = job.started_at
    if p.dest is None:  # held for a pull: nothing moves while computing
        await sleep_until(layer_ready(job, 0, 1))
        rep.times.prefill_end = end = now()
        st.loop.finish(end)
        st.completed += 1
        if not p.done.done():
            p.done.set_result(rep)
        return
    sc = st.cfg.deployment.scenario
    layer_bytes = st.kv.layer_bytes(p.tokens, p.ship_from, sc.scale.byte_scale)
    transfer = st.sender.start(p.dest, p.transfer_id, sum(layer_bytes), len(layer_bytes))
    n = len(layer_bytes)
    # Layer i's KV exists once layer i's share of the modelled compute has elapsed.
    handoff = NAN
    try:
        for i, nbytes in enumerate(layer_bytes):
            await sleep_until(layer_ready(job, i, n))
            transfer.send_layer(i, nbytes)
            if i == 0:
                handoff = now()
    except asyncio.CancelledError:
        transfer.abort("the request was cancelled")
        raise
    rep.times.prefill_end = end = now()
    st.loop.finish(end)

    async def finish() -> None:
        try:
            sent = await transfer.finish()
            st.completed += 1
            t = rep.times
            t.transfer_start, t.transfer_sent = handoff, sent
            t.transfer_first_sent = NAN if transfer.first_send is None else transfer.first_send
        except TransferFailed as e:
            st.failed += 1
            rep.error, rep.error_kind = f"kv transfer failed: {e}", K.KV_TRANSFER
        if not p.done.done():
            p.done.set_result(rep)

    task = asyncio.create_task(finish())
    st.finishing.add(task)
    task.add_done_callback(st.finishing.discard)


async def _await_prefix(st: PrefillState, p: _Pending) -> None:
    """Batched: the prefix moved in for a queued job arrives (the job may then join a pass) or
    fails (the job is dropped)."""
    p.cache_wait_start = now()
    try:
        assert p.cache_in is not None
        res = await asyncio.wait_for(st.receiver.expect(p.cache_in), CACHE_IN_TIMEOUT_S)
        reason = None if res.ok else f"cache move failed: {res.reason}"
    except TimeoutError:
        reason = f"moved cached prefix did not arrive within {CACHE_IN_TIMEOUT_S:g} s"
    if reason is not None:
        if st.loop.queue.remove(p.job.request_id):
            st.pending.pop(p.job.request_id, None)
        log.warning("prefill %s failed: %s", p.job.request_id, reason)
        _abandon(st, p, reason, K.CACHE_MOVE)
        return
    p.cache_move_end, p.cache_move_bytes = res.complete, res.bytes
    st.loop.prefix_arrived(p.job.request_id, now())
    st.wakeup.set()


async def _send_batched(st: PrefillState, p: _Pending) -> None:
    """Batched: a job whose last chunk is in the pass computing streams its KV over that pass
    (`last_pass_layer_ready`); the pass's end is its last layer's."""
    job = p.job
    assert job.started_at is not None
    # What the run is held to: its planned span from its first pass to its last's end.
    rep = PrefillReport(StageTimes(prefill_queued=job.queued_at), job.pass_start + job.pass_s - job.started_at)
    t = rep.times
    t.prefill_start = job.started_at
    if p.cache_in is not None:
        t.cache_wait_start, t.cache_move_end, rep.cache_move_bytes_wire = (
            p.cache_wait_start,
            p.cache_move_end,
            p.cache_move_bytes,
        )
    if p.dest is None:  # held for a pull (vLLM's protocol): nothing moves while computing
        await sleep_until(last_pass_layer_ready(job, 0, 1))
        t.prefill_end = now()
        st.completed += 1
        if not p.done.done():
            p.done.set_result(rep)
        return
    layer_bytes = st.kv.layer_bytes(p.tokens, p.ship_from, st.cfg.deployment.scenario.scale.byte_scale)
    transfer = st.sender.start(p.dest, p.transfer_id, sum(layer_bytes), len(layer_bytes))
    n = len(layer_bytes)
    handoff = NAN
    try:
        for i, nbytes in enumerate(layer_bytes):
            await sleep_until(last_pass_layer_ready(job, i, n))
            transfer.send_layer(i, nbytes)
            if i == 0:
                handoff = now()
    except asyncio.CancelledError:
        transfer.abort("the request was cancelled")
        raise
    t.prefill_end = now()
    try:
        sent = await transfer.finish()
        st.completed += 1
        t.transfer_start, t.transfer_sent = handoff, sent
        t.transfer_first_sent = NAN if transfer.first_send is None else transfer.first_send
    except TransferFailed as e:
        st.failed += 1
        rep.error, rep.error_kind = f"kv transfer failed: {e}", K.KV_TRANSFER
    if not p.done.done():
        p.done.set_result(rep)


async def _guarded(st: PrefillState, p: _Pending) -> None:
    """`_send_batched`, answering the router whatever it raised (the passes go on)."""
    try:
        await _send_batched(st, p)
    except asyncio.CancelledError:
        _abandon(st, p, "cancelled: the router gave up on the request", K.ROUTER_ERROR)
        raise
    except Exception as e:
        log.exception("prefill %s failed", p.job.request_id)
        _abandon(st, p, f"prefill failed: {e}", K.PREFILL_ERROR)


def _ran(st: PrefillState, request_id: str, _: asyncio.Task[None]) -> None:
    st.running.pop(request_id, None)


async def _pass_worker(st: PrefillState) -> None:
    """Batched: one forward pass = a sleep until the pass's end; the jobs it ends stream their
    layers meanwhile (`_send_batched`) and hand their last layer at its end."""
    while True:
        got = st.loop.next_pass(now())
        if not isinstance(got, PrefillPass):  # nothing ready: a submit or an arrived prefix wakes it
            st.wakeup.clear()
            await st.wakeup.wait()
            continue
        for j, _ in got.chunks:
            if j.passes == 1:
                st.started[j.request_id] = st.pending.pop(j.request_id)
        for j in got.done:
            task = asyncio.create_task(_guarded(st, st.started.pop(j.request_id)))
            st.running[j.request_id] = task
            st.finishing.add(task)
            task.add_done_callback(st.finishing.discard)
            task.add_done_callback(functools.partial(_ran, st, j.request_id))
        await sleep_until(got.end)
        st.loop.end_pass(now())


async def _worker(st: PrefillState) -> None:
    while True:
        job = st.loop.start_next(now())
        if not isinstance(job, PrefillJob):  # None: nothing waits (a live call is queued on arrival)
            st.wakeup.clear()
            await st.wakeup.wait()
            continue
        p = st.pending.pop(job.request_id)
        task = asyncio.create_task(_compute_and_send(st, p))
        st.running[job.request_id] = task
        try:
            await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and me.cancelling():  # the worker itself is stopping
                raise
            _abandon(st, p, "cancelled: the router gave up on the request", K.ROUTER_ERROR)
        except TransferFailed as e:  # only the wait for a moved-in prefix raises it in a job
            log.warning("prefill %s failed: %s", job.request_id, e.reason)
            _abandon(st, p, e.reason, K.CACHE_MOVE)
        except Exception as e:  # keep serving the queue whatever one job did
            log.exception("prefill %s failed", job.request_id)
            _abandon(st, p, f"prefill failed: {e}", K.PREFILL_ERROR)
        finally:
            st.running.pop(job.request_id, None)


def _abandon(st: PrefillState, p: _Pending, reason: str, kind: K) -> None:
    st.loop.fail(now())
    st.failed += 1
    if not p.done.done():
        p.done.set_result(PrefillReport(StageTimes(prefill_queued=p.job.queued_at), error=reason, error_kind=kind))


async def handle_prefill(request: web.Request) -> web.Response:
    st = request.app[STATE]
    body, rid = await node_request(request)
    tid = int_field(body, "transfer_id")
    tokens = int_field(body, "input_tokens", 1, st.cfg.deployment.scenario.model.max_context_tokens)
    cached = int_field(body, "cached_tokens")
    if cached > tokens:
        raise bad_request("field 'cached_tokens' exceeds 'input_tokens'")
    ship_from = int_field(body, "decode_cached_tokens") if "decode_cached_tokens" in body else cached
    if ship_from > tokens:
        raise bad_request("field 'decode_cached_tokens' exceeds 'input_tokens'")
    cache_in = int_field(body, "cache_in_transfer") if body.get("cache_in_transfer") is not None else None
    dnode = st.cfg.deployment.nodes.get(str(body.get("decode_node")))
    if dnode is None or dnode.role != "decode" or dnode.kv is None:
        raise bad_request(f"field 'decode_node': unknown decode node {body.get('decode_node')!r}")
    if rid in st.pending:
        raise bad_request(f"request {rid!r} is already queued here")
    scale = st.cfg.scale
    duration = scale.wire_seconds(st.model_time(tokens - cached, cached))
    after = body.get("prefix_after", "")
    if not isinstance(after, str) or len(after) > MAX_ID_CHARS:
        raise bad_request(f"field 'prefix_after' must be a request id (a string of at most {MAX_ID_CHARS} characters)")
    job = PrefillJob(rid, tokens - cached, cached, duration, awaits_prefix=cache_in is not None, after=after)
    rep = await run_job(st, job, (dnode.kv.host, dnode.kv.port), tokens, ship_from, cache_in, tid)
    return web.json_response(report_to_wire(rep), status=502 if rep.error else 200)


async def run_job(
    st: PrefillState,
    job: PrefillJob,
    dest: tuple[str, int] | None,
    tokens: int,
    ship_from: int,
    cache_in: int | None,
    transfer_id: int = 0,
) -> PrefillReport:
    """Queue a prefill and wait for its report; with `dest` None its KV is not sent (held)."""
    rid = job.request_id
    fut: asyncio.Future[PrefillReport] = asyncio.get_running_loop().create_future()
    st.pending[rid] = _Pending(job, transfer_id, dest, tokens, ship_from, cache_in, fut)
    st.loop.submit(job, now())
    if cache_in is not None and st.loop.batching:
        waiter = asyncio.create_task(_await_prefix(st, st.pending[rid]))
        st.finishing.add(waiter)
        waiter.add_done_callback(st.finishing.discard)
    st.wakeup.set()
    try:
        return await fut
    except asyncio.CancelledError:
        # The router gave up (its client left, or a deadline passed): drop the job, or stop it.
        if st.loop.queue.remove(rid):
            st.pending.pop(rid, None)
        elif (task := st.running.get(rid)) is not None:
            task.cancel()
        elif st.loop.batching and st.started.pop(rid, None) is not None:
            st.loop.drop(rid)  # its remaining chunks are not computed
        raise


async def handle_cache_send(request: web.Request) -> web.Response:
    """Send a cached prefix's KV to a prefill node of another cluster (a cross-cluster cache
    move): real bytes over the same connections and links as any KV."""
    st = request.app[STATE]
    body, rid = await node_request(request)
    tid = int_field(body, "transfer_id")
    nbytes = int_field(body, "bytes", 1)
    dest = st.cfg.deployment.nodes.get(str(body.get("dest_node")))
    if dest is None or dest.role != "prefill" or dest.kv is None:
        raise bad_request(f"field 'dest_node': unknown prefill node {body.get('dest_node')!r}")
    start = now()
    transfer = st.sender.start((dest.kv.host, dest.kv.port), tid, nbytes, 1)
    transfer.send_layer(0, nbytes)
    try:
        sent = await transfer.finish()
    except TransferFailed as e:
        return web.json_response({"error": f"cache move failed: {e.reason}", "start": start}, status=502)
    st.moves_sent += 1
    return web.json_response({"start": start, "first_byte_sent": transfer.first_send, "sent": sent})


async def handle_status(request: web.Request) -> web.Response:
    return web.json_response(_status(request.app[STATE]))


def _status(st: PrefillState) -> PrefillStatus:
    """Wire units: queued modelled work (s) and the KV sender's counters (bytes, segments)."""
    ls = st.sender.link_state()
    q = st.loop.queue
    return {
        "t": now(),
        "queue_depth": q.depth,
        "running": len(st.running),
        "backlog_s": q.backlog(now()),
        "queued_s": q.waiting_work(),
        "acked_bytes": ls.acked_bytes,
        "retrans_segments": ls.retrans_segments,
        "acked_segments": ls.acked_segments,
        "undelivered_bytes": ls.undelivered_bytes,
        "kv_bytes_sent": st.sender.bytes_sent,
    }


def sending_connections(
    stats: Iterable[ConnectionStats], seen: dict[tuple[Dest, int], tuple[int, int]]
) -> list[ConnectionStats]:
    """The connections that sent or retransmitted since their last sample (`seen`, updated). TCP
    updates RTT and cwnd on ACKs, so an idle connection would repeat itself, and a sender holds a
    pool to every decode instance: 48 instances wrote 1.3 GB of such repeats in 3 minutes."""
    out = []
    for c in stats:
        key, now_seen = (c.dest, c.conn), (c.bytes_sent, c.total_retrans)
        if seen.get(key) != now_seen:
            seen[key] = now_seen
            out.append(c)
    return out


def _collect(st: PrefillState) -> list[Sample]:
    out: list[Sample] = [Sample(*x) for x in st.loop.queue.samples(st.sender.backlog_bytes, st.sender.bytes_sent)]
    out += [
        # Counters, so the report can say what connection losses cost (faults, resets).
        Sample("kv_resumes", float(st.sender.resumes), {}),
        Sample("kv_bytes_resent", float(st.sender.bytes_resent), {}),
        Sample("kv_transfers_failed", float(st.sender.transfers_failed), {}),
    ]
    for c in sending_connections(st.sender.tcp_info(), st.tcp_seen):
        labels = {"dest": f"{c.dest[0]}:{c.dest[1]}", "conn": str(c.conn)}
        out += [
            Sample("tcp_rtt_us", float(c.rtt_us), labels),
            Sample("tcp_total_retrans", float(c.total_retrans), labels),
            # Every payload byte the socket put on the wire, retransmissions included
            # (tcpi_bytes_sent): with the link's packet counter it accounts for the WAN bytes.
            Sample("tcp_bytes_sent", float(c.bytes_sent), labels),
            Sample("tcp_delivery_rate_Bps", float(c.delivery_rate_Bps), labels),
            Sample("tcp_snd_cwnd", float(c.snd_cwnd), labels),
        ]
    return out


def _metrics(reg: CollectorRegistry, st: PrefillState) -> None:
    """vLLM's scheduler gauges and the testbed's KV counters, labelled as vLLM labels (`model_name`,
    `engine`: the node). The counters were gauges without the `_total` suffix before."""
    ScrapeTimeMetrics({"model_name": st.cfg.deployment.scenario.model.name, "engine": st.cfg.node_id}).gauge(
        "vllm:num_requests_waiting", "Prefill requests waiting", lambda: st.loop.queue.depth
    ).gauge("vllm:num_requests_running", "Prefill requests computing", lambda: 1 if st.loop.busy else 0).gauge(
        "testbed_kv_backlog_bytes", "KV bytes queued, not yet written", lambda: st.sender.backlog_bytes
    ).gauge(
        "testbed_slowdown_factor",
        "Service-time factor of an injected slowdown in force (1: none)",
        lambda: st.loop.slow.at(now()),
    ).counter("testbed_kv_bytes_sent", "KV bytes written to TCP (wire)", lambda: st.sender.bytes_sent).counter(
        "testbed_prefills_completed", "Prefills whose KV was sent", lambda: st.completed
    ).counter("testbed_prefills_failed", "Prefills whose KV transfer failed", lambda: st.failed).counter(
        "testbed_prefill_passes", "Forward passes of a batching scheduler (0 under fcfs)", lambda: st.loop.stats.passes
    ).counter(
        "testbed_prefill_pass_tokens", "Uncached tokens computed in those passes", lambda: st.loop.stats.tokens
    ).counter(
        "testbed_prefill_pass_chunks", "Prompt chunks computed in those passes", lambda: st.loop.stats.chunks
    ).register(reg)


def make_app(cfg: ServiceConfig, testbed_routes: bool = True) -> web.Application:
    """The node's app; without `testbed_routes`, no work route: an engine protocol adds its own."""
    sc = cfg.deployment.scenario
    node = cfg.deployment.nodes[cfg.node_id]
    hw = sc.hardware[sc.cluster(node.cluster).hardware]
    app = web.Application(client_max_size=1 << 20, middlewares=node_middlewares(cfg))
    reg = CollectorRegistry()
    app[REGISTRY_KEY] = reg
    slow = SlowDown()

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        t = sc.transfer
        sender = KVSender(
            t.connections, t.chunk_bytes, t.sndbuf_bytes, t.congestion, t.checksum, resume_timeout=t.resume_timeout_s
        )
        receiver = KVReceiver(
            verify=t.checksum,
            rcvbuf=t.rcvbuf_bytes,
            idle_timeout=receiver_idle_timeout(t.resume_timeout_s),
            allowed_hosts=cfg.deployment.node_hosts(),
        )
        if node.kv is not None:
            await receiver.start(cfg.deployment.kv_bind(cfg.node_id), node.kv.port)
        model_time = PrefillTime.from_spec(hw.prefill)
        loop = PrefillLoop(slow, BatchPolicy.from_spec(hw.scheduler), model_time, cfg.scale.speedup)
        st = PrefillState(cfg, loop, sender, receiver, model_time, KVModel.from_spec(sc.model))
        app[STATE] = st
        _metrics(reg, st)
        series = SeriesWriter(cfg.series_path(), cfg.node_id)
        tasks = [
            asyncio.create_task(_pass_worker(st) if st.loop.batching else _worker(st)),
            asyncio.create_task(sample_forever(series, lambda: _collect(st), cfg.sample_interval)),
        ]
        yield
        for task in tasks + list(st.finishing):
            task.cancel()
        await asyncio.gather(*tasks, *st.finishing, return_exceptions=True)
        await sender.close()
        await receiver.close()
        series.close()

    app.cleanup_ctx.append(lifecycle)
    if testbed_routes:
        app.router.add_post("/prefill", handle_prefill)
        app.router.add_post("/cache/send", handle_cache_send)
    app.router.add_get("/status", handle_status)
    add_common_routes(app)
    add_fault_route(app, slow)
    return app
