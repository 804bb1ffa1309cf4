"""The router: OpenAI-style API in front, policy from `testbed.core.policy` behind.

For each request it looks up every cluster's usable cached prefix in the global index, asks
the policy for a prefill and a decode instance (and any cross-cluster cache move), opens the
decode stream (the decode node then waits for KV), starts the cache move and the prefill (whose
node streams KV to the decode node), and relays tokens to the client as they come. The final
chunk carries a `testbed` field with the request's record, every timestamp in unix seconds
(`testbed.core.record`), for the replayer's records. With a control loop
(`testbed.live.link_control`) the threshold and the bandwidth state follow the measured WAN.
When the deployment is held for outside clients (`testbed.live.held`), the router writes every
request's record itself.

Besides the OpenAI routes it answers what vLLM's server does for load generators: `/version`,
`max_model_len` in `/v1/models`, and `/metrics` with vLLM's histogram names (wire seconds, which
are paper seconds at speedup 1) and each decode node's KV-cache usage, read from the node's own
`/metrics` at scrape time and labelled `engine=<node>`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import math
import random
import uuid
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from testbed.core.bandwidth import BandwidthController, ControlSample, ThresholdChange
from testbed.core.cache_book import CacheBook, cache_book_for
from testbed.core.control import Recent, controller_for
from testbed.core.health import HealthBook, HealthChange, Outcome
from testbed.core.kvsize import KVModel
from testbed.core.lifecycle import Event, InvalidTransition, Lifecycle
from testbed.core.load_aware import router_policy
from testbed.core.longterm import RoleMeter, controller_for as longterm_for
from testbed.core.policy import BandwidthState, LoadTracker, NoCapacity, Policy
from testbed.core.record import (
    NAN, NO_TRACE_INDEX, PrefillReport, RecordFormatError, RequestRecord, report_from_wire,
)
from testbed.core.request_ids import RequestIds, client_id
from testbed.core.routing import RoutePlan, route
from testbed.core.scenario import Scenario
from testbed.core.servicetime import PrefillTime
from testbed.live.clock import now
from testbed.live.common import REGISTRY_KEY, SCRAPE_KEY, ServiceConfig, add_common_routes, bad_request
from testbed.live.held import HELD_KEY, HOLD_PATH, HeldRecords, hold_records_path, post_hold
from testbed.live.link_control import LinkControl
from testbed.live.role_control import RoleControl
from testbed.live.openai_api import (
    Limits, ParsedRequest, RequestError, block_hashes, chunk, full_response, load_body, parse, record_extension,
    usage_chunk,
)
from testbed.live.series import sample_forever
from testbed.metrics.series_format import Sample, SeriesWriter
from testbed.model.retune import role_planner

log = logging.getLogger("testbed.router")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
PROBE_INTERVAL_S = 0.5     # wire seconds between health probes of one instance
PROBE_TIMEOUT_S = 2.0
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
STAGE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
SCRAPE_TIMEOUT_S = 1.0     # a decode node's /metrics, read when the router's is scraped
KV_GAUGE = "vllm:kv_cache_usage_perc"


@dataclass
class RouterMetrics:
    ttft: Histogram
    tpot: Histogram
    e2e: Histogram
    success: Counter
    failed: Counter
    routed: Counter
    itl: Histogram
    queue: Histogram
    prefill: Histogram
    decode: Histogram
    kv_usage: Gauge
    gpu_cache_usage: Gauge


@dataclass
class RouterState:
    cfg: ServiceConfig
    policy: Policy
    tracker: LoadTracker
    kv: KVModel
    prefill_time: dict[str, PrefillTime]
    session: aiohttp.ClientSession
    metrics: RouterMetrics
    decisions: SeriesWriter
    threshold: float | None
    book: CacheBook | None = None
    recent: Recent = field(default_factory=lambda: Recent(200))
    bandwidth: BandwidthState = "scarce"
    bandwidth_bps: float | None = None     # the control loop's estimate of the inter-DC link (paper bit/s)
    cache_aware: bool = False
    transfer_ids: itertools.count[int] = field(
        default_factory=lambda: itertools.count(random.getrandbits(24) << 32))
    inflight: int = 0
    cache_moves: int = 0
    tails: list[float] = field(default_factory=list)   # KV transfer tails of offloaded requests (wire s), for the control loop
    health: HealthBook = field(default_factory=lambda: HealthBook(()))
    retries: int = 0
    held: HeldRecords | None = None       # the deployment is held: the router writes the records
    ids: RequestIds = field(default_factory=RequestIds)
    history: Recent | None = None         # the long-term loop's window of arrivals
    unroutable: frozenset[str] = frozenset()   # role slots' nodes not in service (the long-term loop)

    def note_health(self, node: str, outcome: Outcome, reason: str = "", probe: bool = False) -> None:
        change = self.health.report(node, outcome, now(), reason, probe=probe)
        if change is not None:
            _log_health(self, change)


def _log_health(st: RouterState, ch: HealthChange) -> None:
    log.warning("instance %s is %s: %s", ch.node, ch.new, ch.reason)
    st.decisions.write([Sample("health", 1.0 if ch.new == "up" else 0.0,
                               {"node": ch.node, "state": ch.new, "reason": ch.reason})])


STATE = web.AppKey("router_state", RouterState)


class RequestFailed(Exception):
    """A request attempt that failed: why, which instance is to blame if one is, and what that
    says about it (`refused`: nothing answers there; `failed`: it answered badly or broke off)."""

    def __init__(self, reason: str, node: str = "", outcome: Outcome = "failed", retryable: bool = True) -> None:
        super().__init__(reason)
        self.node, self.outcome, self.retryable = node, outcome, retryable


@dataclass
class _Progress:
    """One request as the router sees it: its lifecycle and the record the final chunk carries."""

    life: Lifecycle
    rec: RequestRecord


_Plan = RoutePlan


def _route(st: RouterState, req: ParsedRequest, rid: str, avoid: frozenset[str] = frozenset()) -> _Plan:
    """Route to instances believed up; `avoid` (a retry's failed instances) too, unless nothing
    else is left of the role needed."""
    sc = st.cfg.deployment.scenario
    hashes = req.hash_ids or block_hashes(req.content, sc.model.block_tokens)
    return route(st, sc, rid, req.input_tokens, hashes, now(), st.cfg.scale, st.health.down() | st.unroutable, avoid,
                 output_tokens=req.output_tokens)


async def _move_cache(st: RouterState, rid: str, plan: _Plan, tid: int, prog: _Progress) -> None:
    """Have the source cluster's node send the cached prefix to the prefill node (the bytes
    cross the WAN); the prefill node waits for it before computing."""
    assert plan.move_src is not None
    st.cache_moves += 1
    src = st.cfg.deployment.nodes[plan.move_src]
    body = {"request_id": rid, "transfer_id": tid, "bytes": max(st.cfg.scale.wire_bytes(plan.move_bytes_paper), 1),
            "dest_node": plan.d.prefill_node}
    prog.rec.times.cache_move_start = now()
    try:
        async with st.session.post(f"{src.http.url}/cache/send", json=body) as r:
            res: dict[str, Any] = await r.json()
    except (aiohttp.ClientError, ValueError) as e:
        res = {"error": f"cache move source {plan.move_src} unreachable: {e}"}
    if "error" in res:
        # The source aborts the transfer, so the waiting prefill fails with the reason at once.
        log.warning("request %s: %s", rid, res["error"])


async def _drive(st: RouterState, req: ParsedRequest, rid: str, node_rid: str, plan: _Plan, prog: _Progress
                 ) -> AsyncIterator[int]:
    """Run one attempt of a request through prefill, transfer and decode (the nodes know the
    attempt as `node_rid`); yields cumulative token counts."""
    dep = st.cfg.deployment
    d = plan.d
    tid = next(st.transfer_ids)
    move_tid = next(st.transfer_ids) if d.cache_move is not None else None
    pnode, dnode = dep.nodes[d.prefill_node], dep.nodes[d.decode_node]
    kv_paper = st.kv.total(req.input_tokens)
    decode_body = {"request_id": node_rid, "transfer_id": tid, "input_tokens": req.input_tokens,
                   "output_tokens": req.output_tokens, "kv_bytes_paper": kv_paper}
    prefill_body = {"request_id": node_rid, "transfer_id": tid, "input_tokens": req.input_tokens,
                    "cached_tokens": d.cached_tokens, "decode_cached_tokens": d.decode_cached_tokens,
                    "cache_in_transfer": move_tid, "decode_node": d.decode_node}
    book = st.book
    rec, times = prog.rec, prog.rec.times

    def note_tail() -> None:
        if d.crossed_wan and math.isfinite(times.prefill_end) and math.isfinite(times.transfer_end):
            st.tails.append(max(times.transfer_end - times.prefill_end, 0.0))

    prefill_blame: list[tuple[str, Outcome]] = []      # set when the prefill node itself failed

    def prefill_finished(rep: PrefillReport) -> None:
        st.tracker.prefill_done(d, plan.work)
        times.merge(rep.times)
        rec.prefill_modelled, rec.cache_move_bytes_wire = rep.prefill_modelled, rep.cache_move_bytes_wire
        if rep.error:
            node, outcome = prefill_blame[0] if prefill_blame else ("", "failed")
            raise RequestFailed(rep.error, node, outcome)
        st.note_health(d.prefill_node, "ok")
        if math.isfinite(times.transfer_end):
            note_tail()
        if book is not None:
            if math.isfinite(rep.times.cache_move_end):
                book.moved(rid, plan.hashes, d)
            book.prefilled(rid, plan.hashes, req.input_tokens, d)

    move_task: asyncio.Task[None] | None = None
    try:
        dresp = await st.session.post(f"{dnode.http.url}/decode", json=decode_body)
    except aiohttp.ClientError as e:
        raise RequestFailed(f"decode node {d.decode_node} unreachable: {e}", d.decode_node, _outcome(e)) from None
    if dresp.status != 200:
        text = await dresp.text()
        dresp.release()
        raise RequestFailed(f"decode node {d.decode_node} answered {dresp.status}: {text[:200]}",
                            d.decode_node if dresp.status >= 500 else "", retryable=dresp.status >= 500)

    async def prefill() -> PrefillReport:
        try:
            async with st.session.post(f"{pnode.http.url}/prefill", json=prefill_body) as r:
                res: Any = await r.json()
                if r.status in (200, 502):     # the node's own report, failed or not
                    return report_from_wire(res)
                err = res.get("error") if isinstance(res, dict) else None
                if r.status >= 500:
                    prefill_blame.append((d.prefill_node, "failed"))
                return PrefillReport(error=str(err) if err else f"prefill node answered {r.status}")
        except RecordFormatError as e:
            prefill_blame.append((d.prefill_node, "failed"))
            return PrefillReport(error=f"prefill node {d.prefill_node} answered a malformed report: {e}")
        except (aiohttp.ClientError, ValueError) as e:
            prefill_blame.append((d.prefill_node, _outcome(e)))
            return PrefillReport(error=f"prefill node {d.prefill_node} unreachable: {e}")

    if move_tid is not None:
        move_task = asyncio.create_task(_move_cache(st, rid, plan, move_tid, prog))
    times.prefill_sent = now()
    ptask = asyncio.create_task(prefill())
    line_task: asyncio.Task[bytes] = asyncio.create_task(dresp.content.readline())
    prefill_seen = False
    try:
        while True:
            waiting: set[asyncio.Task[Any]] = {line_task}
            if not prefill_seen:
                waiting.add(ptask)
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if ptask in done and not prefill_seen:
                prefill_seen = True
                prefill_finished(ptask.result())
            if line_task not in done:
                continue
            try:
                line = line_task.result()
                ev = json.loads(line) if line else None
            except (aiohttp.ClientError, ConnectionError, ValueError) as e:
                raise RequestFailed(f"decode node {d.decode_node} stream broke: {type(e).__name__}: {e}",
                                    d.decode_node) from None
            if not isinstance(ev, dict):
                raise RequestFailed(f"decode node {d.decode_node} closed the stream early", d.decode_node)
            kind = ev.get("event")
            if kind == "kv":
                times.transfer_end = float(ev["complete"])
                times.transfer_first_received = float(ev["first_byte"])
                rec.kv_bytes_wire = int(ev["bytes"])
                if prefill_seen:
                    note_tail()
                if book is not None:
                    book.kv_complete(rid, plan.hashes, req.input_tokens, d)
            elif kind == "admitted":
                times.decode_admitted = float(ev["t"])
            elif kind == "tokens":
                t = float(ev["t"])
                if math.isnan(times.decode_first_token):
                    times.decode_first_token = t
                times.decode_last_token = t
                yield int(ev["n"])
            elif kind == "done":
                st.note_health(d.decode_node, "ok")
                break
            elif kind == "error":
                raise RequestFailed(str(ev.get("reason", "decode failed")))
            line_task = asyncio.create_task(dresp.content.readline())
        if not prefill_seen:
            res = await ptask
            prefill_seen = True
            prefill_finished(res)
        if move_task is not None:
            await move_task
    finally:
        line_task.cancel()
        if not prefill_seen:
            ptask.cancel()
            st.tracker.prefill_done(d, plan.work)
        if move_task is not None and not move_task.done():
            move_task.cancel()
        if book is not None:
            book.finished(rid, d)
        dresp.close()


def _outcome(e: BaseException) -> Outcome:
    """A connection that cannot be made (refused, no route) proves nothing answers there; a
    timeout or a broken reply may be passing."""
    return "refused" if isinstance(e, aiohttp.ClientConnectorError) else "failed"


def _replay_lifecycle(prog: _Progress) -> None:
    """Drive the request's state machine through its stamps in time order. Stamps come from
    three processes over two connections, so they are checked once all are in: an order the
    machine rejects (say, admitted before its KV arrived) is a testbed bug worth failing on."""
    for t, ev in prog.rec.times.lifecycle_events():
        prog.life.apply(ev, t)
    if not prog.life.done:
        raise RequestFailed(f"incomplete lifecycle: stopped in state {prog.life.state.value}")


def _note_route(rec: RequestRecord, plan: _Plan, kv_paper: int) -> None:
    d = plan.d
    rec.prefill_cluster, rec.prefill_node = d.prefill_cluster, d.prefill_node
    rec.decode_cluster, rec.decode_node = d.decode_cluster, d.decode_node
    rec.cached_tokens, rec.decode_cached_tokens = d.cached_tokens, d.decode_cached_tokens
    rec.crossed_wan, rec.route_reason = d.crossed_wan, d.reason
    rec.threshold = NAN if d.threshold is None else float(d.threshold)
    rec.kv_bytes_paper = kv_paper
    if d.cache_move is not None:
        rec.cache_move_tokens = d.cache_move.tokens - d.cache_move.from_tokens
        rec.cache_move_src = plan.move_src or ""
        rec.cache_move_bytes_paper = plan.move_bytes_paper


def _ext(prog: _Progress, tokens: int) -> dict[str, Any]:
    rec = prog.rec
    rec.outcome, rec.reason, rec.tokens_received = prog.life.state.value, prog.life.reason, tokens
    return record_extension(rec)


def _note_decision(st: RouterState, rid: str, req: ParsedRequest, plan: _Plan, prog: _Progress) -> None:
    d = plan.d
    prog.rec.times.routed = now()
    st.metrics.routed.labels(cluster=d.prefill_cluster).inc()
    st.decisions.write([Sample("decision", float(d.incremental_tokens),
                               {"request_id": rid, "prefill": d.prefill_node, "decode": d.decode_node,
                                "cached": str(d.cached_tokens), "bandwidth": st.bandwidth,
                                "threshold": "" if d.threshold is None else f"{d.threshold:g}",
                                "reason": d.reason})])
    # What the request moves: the KV the decode side lacks (paper bytes).
    _note_route(prog.rec, plan, st.kv.incremental(req.input_tokens, d.decode_cached_tokens))


def _retry_progress(old: _Progress, reason: str) -> _Progress:
    """A fresh attempt's progress: the client's arrival kept, the failed attempt's stages not."""
    rec = RequestRecord(old.rec.request_id, old.rec.trace_index, old.rec.input_tokens, old.rec.output_tokens,
                        retries=old.rec.retries + 1, retry_reason=reason)
    rec.times.router_arrival = old.rec.times.router_arrival
    return _Progress(Lifecycle(old.rec.request_id), rec)


@dataclass
class _Seen:
    """One request as its client saw it (unix seconds), for a held deployment's records."""

    arrival: float
    prog: _Progress | None = None
    first: float = NAN          # the first token chunk went out (non-streaming: the response)
    last: float = NAN
    sent: int = 0
    error: str = ""             # why it ended without a lifecycle verdict (bad request, no capacity)
    rid: str = ""               # the id claimed for it (`RouterState.ids`), released at the end


def _held_record(seen: _Seen) -> RequestRecord:
    if seen.prog is None:
        rec = RequestRecord(uuid.uuid4().hex[:16], NO_TRACE_INDEX, 0, 0)
    else:
        src = seen.prog.rec
        rec = dataclasses.replace(src, times=dataclasses.replace(src.times))
    if rec.outcome not in ("completed", "failed"):
        rec.outcome, rec.reason = "failed", seen.error or "the client disconnected before the end"
    t = rec.times
    t.arrival, t.first_token, t.last_token = seen.arrival, seen.first, seen.last
    rec.tokens_received = seen.sent
    return rec


def _observe_stages(m: RouterMetrics, times: Any, first: float, end: float) -> None:
    """vLLM's phases: queued until the prefill starts, prefill until the first token, then decode
    (the KV transfer tail and the decode admission count as prefill, as they delay the first token)."""
    for hist, a, b in ((m.queue, times.router_arrival, times.prefill_start), (m.prefill, times.prefill_start, first),
                       (m.decode, first, end)):
        if math.isfinite(a) and math.isfinite(b):
            hist.observe(max(b - a, 0.0))


async def _handle(request: web.Request, kind: str) -> web.StreamResponse:
    st = request.app[STATE]
    seen = _Seen(now())
    try:
        return await _serve(request, kind, st, seen)
    finally:
        if seen.rid:
            st.ids.release(seen.rid)
        if st.held is not None:
            st.held.add(_held_record(seen))


async def _serve(request: web.Request, kind: str, st: RouterState, seen: _Seen) -> web.StreamResponse:
    sc = st.cfg.deployment.scenario
    try:
        text = await request.text()
    except UnicodeDecodeError:
        seen.error = "bad request: body is not JSON"
        raise bad_request("body is not JSON (not UTF-8)") from None
    try:
        body = load_body(text)
        req = parse(body, kind, Limits(sc.model.max_context_tokens, sc.serving.max_output_tokens))
    except RequestError as e:
        seen.error = f"bad request: {e}"
        raise bad_request(str(e)) from None
    model = req.model or sc.model.name
    # X-Request-Id as vLLM takes it (aiperf and vllm bench serve send one): an outside client's
    # records match the router's. An id in use, or recorded, gets a suffix (`testbed.core.request_ids`).
    asked = req.client_request_id or client_id(request.headers.get("X-Request-Id", "")) or uuid.uuid4().hex[:16]
    rid = seen.rid = st.ids.claim(asked)
    if rid != asked:
        log.info("request id %r is taken (in flight or recorded): this request is %r", asked, rid)
    cid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    t_arrival = seen.arrival
    prog = _Progress(Lifecycle(rid), RequestRecord(rid, NO_TRACE_INDEX, req.input_tokens, req.output_tokens))
    prog.rec.times.router_arrival = t_arrival
    seen.prog = prog
    try:
        plan = _route(st, req, rid)
    except NoCapacity as e:
        seen.error = f"no capacity: {e}"
        raise web.HTTPServiceUnavailable(text=json.dumps({"error": {"message": str(e)}}),
                                         content_type="application/json") from None
    _note_decision(st, rid, req, plan, prog)
    st.inflight += 1
    holding = True          # `plan` holds a decode slot in the tracker

    resp: web.StreamResponse | None = None
    if req.stream:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

    async def sse(obj: dict[str, Any] | str) -> None:
        assert resp is not None
        data = obj if isinstance(obj, str) else json.dumps(obj)
        await resp.write(f"data: {data}\n\n".encode())

    sent = 0
    first_t: float | None = None
    last_t = NAN
    deadline_paper = sc.deadline_s(req.output_tokens)

    async def attempts() -> None:
        """Drive the request; one retry elsewhere if an attempt fails before any token was sent."""
        nonlocal plan, prog, sent, first_t, holding, last_t
        while True:
            # Nodes know an attempt by its own id: a retry may land where the failed attempt is
            # still being cleaned up. Claimed like a request's id (a client may be using it).
            node_rid = rid if not prog.rec.retries else st.ids.claim(f"{rid}~retry{prog.rec.retries}")
            try:
                async for n in _drive(st, req, rid, node_rid, plan, prog):
                    t = now()
                    if first_t is None:
                        first_t = t
                        st.metrics.ttft.observe(first_t - t_arrival)
                    elif n > sent:
                        # Per token, as vLLM observes it: a chunk of k tokens after a gap g is k gaps of g / k.
                        for _ in range(n - sent):
                            st.metrics.itl.observe((t - last_t) / (n - sent))
                    if n > sent:
                        last_t = t
                    if resp is not None and n > sent:
                        await sse(chunk(req, cid, model, n - sent, sent == 0, None))
                        seen.last = now()
                        if math.isnan(seen.first):
                            seen.first = seen.last
                    sent = seen.sent = n
                return
            except RequestFailed as e:
                st.tracker.decode_done(plan.d)
                holding = False
                if e.node:
                    st.note_health(e.node, e.outcome, str(e))
                if sent or prog.rec.retries or not e.retryable:
                    raise
                avoid = frozenset({e.node} if e.node else {plan.d.prefill_node, plan.d.decode_node})
                log.warning("request %s: %s; retrying elsewhere", rid, e)
                prog = seen.prog = _retry_progress(prog, str(e))
                try:
                    plan = _route(st, req, rid, avoid)
                except NoCapacity as nc:
                    raise RequestFailed(f"{e}; no instance left to retry on: {nc}", retryable=False) from None
                holding = True
                st.retries += 1
                _note_decision(st, rid, req, plan, prog)
            finally:
                if node_rid != rid:
                    st.ids.release(node_rid)

    try:
        try:
            async with asyncio.timeout(max(st.cfg.scale.wire_seconds(deadline_paper), sc.serving.deadline_floor_wire_s)):
                await attempts()
        except TimeoutError:
            raise RequestFailed(f"deadline exceeded: no answer within {deadline_paper:.4g} s (paper)",
                                retryable=False) from None
        _replay_lifecycle(prog)
        st.metrics.success.labels(finished_reason="length").inc()
        end = now()
        st.metrics.e2e.observe(end - t_arrival)
        if first_t is not None and sent > 1:
            st.metrics.tpot.observe((end - first_t) / (sent - 1))
        if first_t is not None:
            _observe_stages(st.metrics, prog.rec.times, first_t, end)
        ext = _ext(prog, sent)
        cached = prog.rec.cached_tokens
        if resp is None:
            out = web.json_response(full_response(req, cid, model, sent, "length", ext, cached))
            seen.first = seen.last = now()
            return out
        await sse(chunk(req, cid, model, 0, sent == 0, "length", ext))
        if req.include_usage:
            await sse(usage_chunk(req, cid, model, sent, cached))
        await sse("[DONE]")
        await resp.write_eof()
        return resp
    except (RequestFailed, InvalidTransition, aiohttp.ClientError) as e:
        if isinstance(e, InvalidTransition):
            e = RequestFailed(f"stamps out of lifecycle order: {e}")
        elif isinstance(e, aiohttp.ClientError):
            e = RequestFailed(f"router: {type(e).__name__}: {e}")
        if not prog.life.done:
            prog.life.apply(Event.FAIL, now(), str(e))
        st.metrics.failed.labels(reason=str(e).split(":")[0][:40]).inc()
        log.warning("request %s failed: %s", rid, e)
        ext = _ext(prog, sent)
        err = {"error": {"message": str(e), "type": "server_error", "code": 502}, **ext}
        if resp is None:
            return web.json_response(err, status=502)
        try:
            await sse(err)
            await sse("[DONE]")
            await resp.write_eof()
        except ConnectionError:
            pass                   # the client has gone; its request is over everywhere already
        return resp
    except ConnectionError:
        # The client went away mid-stream: _drive's cleanup has released the nodes' work.
        log.info("request %s: the client disconnected", rid)
        return resp if resp is not None else web.Response(status=499)
    finally:
        st.inflight -= 1
        if holding:
            st.tracker.decode_done(plan.d)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "chat")


async def models(request: web.Request) -> web.Response:
    spec = request.app[STATE].cfg.deployment.scenario.model
    return web.json_response({"object": "list", "data": [
        {"id": spec.name, "object": "model", "created": 0, "owned_by": "prfaas-testbed", "root": spec.name,
         "parent": None, "max_model_len": spec.max_context_tokens, "permission": []}]})


async def version(request: web.Request) -> web.Response:
    """vLLM's /version; the testbed's own version (clients only check that it answers)."""
    from importlib import metadata
    try:
        v = metadata.version("prfaas-testbed")
    except metadata.PackageNotFoundError:
        v = "unknown"
    return web.json_response({"version": v, "server": "prfaas-testbed"})


async def _node_kv_usage(st: RouterState, node: str) -> float | None:
    url = f"{st.cfg.deployment.nodes[node].http.url}/metrics"
    try:
        async with st.session.get(url, timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    for fam in text_string_to_metric_families(text):
        if fam.name == KV_GAUGE:
            return next((float(smp.value) for smp in fam.samples), None)
    return None


async def refresh_kv_usage(app: web.Application) -> None:
    """Before a scrape: every decode node's KV usage as the router's gauges (an unreachable node's
    series is dropped rather than left stale)."""
    st = app[STATE]
    m = st.metrics
    decode = sorted(k for k, n in st.cfg.deployment.nodes.items() if n.role == "decode")
    values = await asyncio.gather(*(_node_kv_usage(st, n) for n in decode))
    for node, v in zip(decode, values):
        for g in (m.kv_usage, m.gpu_cache_usage):
            if v is None:
                try:
                    g.remove(node)
                except KeyError:
                    pass
            else:
                g.labels(engine=node).set(v)


def _collect(st: RouterState) -> list[Sample]:
    out: list[Sample] = [Sample("inflight", float(st.inflight), {})]
    if st.threshold is not None:
        out.append(Sample("threshold", float(st.threshold), {}))
    for node, backlog in st.tracker.prefill_backlog.items():
        out.append(Sample("prefill_assigned", float(st.tracker.active[node]), {"node": node}))
    if st.book is not None:
        for name, pool in st.book.index.pools.items():
            lab = {"cluster": name}
            out += [Sample("cache_used_bytes_paper", float(pool.used_bytes), lab),
                    Sample("cache_pinned_bytes_paper", float(pool.pinned_bytes), lab),
                    Sample("cache_hit_tokens", float(pool.stats.hit_tokens), lab),
                    Sample("cache_evicted_bytes_paper", float(pool.stats.evicted_bytes), lab)]
    return out


async def _probe(st: RouterState, node: str) -> None:
    ep = st.cfg.deployment.nodes[node].http
    try:
        async with st.session.get(f"{ep.url}/health", timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as r:
            outcome: Outcome = "ok" if r.status == 200 else "failed"
            why = f"health probe answered {r.status}"
    except aiohttp.ClientError as e:
        outcome, why = _outcome(e), f"health probe: {type(e).__name__}: {e}"
    except TimeoutError:
        outcome, why = "failed", f"health probe: no answer within {PROBE_TIMEOUT_S:g} s"
    st.note_health(node, outcome, why, probe=True)


async def _probe_forever(st: RouterState) -> None:
    """Active health checks: a killed instance is seen even when no request goes there, a paused
    one (it accepts connections but never answers) only this way, and a recovered one comes back."""
    while True:
        due = st.health.due_probes(now())
        if due:
            await asyncio.gather(*(_probe(st, n) for n in due))
        await asyncio.sleep(PROBE_INTERVAL_S / 4)


def _cache_book(sc: Scenario, kv: KVModel) -> CacheBook | None:
    return cache_book_for(sc, kv)


def _controller(cfg: ServiceConfig, threshold: float | None) -> BandwidthController | None:
    return controller_for(cfg.deployment.scenario, threshold, cfg.deployment.inter_dc.rate)


def _make_metrics(reg: CollectorRegistry) -> RouterMetrics:
    return RouterMetrics(
        ttft=Histogram("vllm:time_to_first_token_seconds", "TTFT at the router (wire seconds)",
                       buckets=TTFT_BUCKETS, registry=reg),
        tpot=Histogram("vllm:time_per_output_token_seconds", "TPOT at the router (wire seconds)",
                       buckets=TPOT_BUCKETS, registry=reg),
        e2e=Histogram("vllm:e2e_request_latency_seconds", "End-to-end latency (wire seconds)",
                      buckets=TTFT_BUCKETS, registry=reg),
        success=Counter("vllm:request_success", "Finished requests", ["finished_reason"], registry=reg),
        failed=Counter("testbed_requests_failed", "Failed requests", ["reason"], registry=reg),
        routed=Counter("testbed_requests_routed", "Requests routed, by prefill cluster", ["cluster"], registry=reg),
        itl=Histogram("vllm:inter_token_latency_seconds", "Time between output tokens at the router (wire seconds; "
                      "a chunk of k tokens counts k gaps of its gap / k)", buckets=TPOT_BUCKETS, registry=reg),
        queue=Histogram("vllm:request_queue_time_seconds", "Router arrival to prefill start (wire seconds)",
                        buckets=STAGE_BUCKETS, registry=reg),
        prefill=Histogram("vllm:request_prefill_time_seconds", "Prefill start to first token, KV transfer tail "
                          "included (wire seconds)", buckets=STAGE_BUCKETS, registry=reg),
        decode=Histogram("vllm:request_decode_time_seconds", "First token to last token (wire seconds)",
                         buckets=STAGE_BUCKETS, registry=reg),
        kv_usage=Gauge(KV_GAUGE, "KV memory in use per decode node, fraction (read from the node at scrape time)",
                       ["engine"], registry=reg),
        gpu_cache_usage=Gauge("vllm:gpu_cache_usage_perc", "The same as vllm:kv_cache_usage_perc (vLLM's older "
                              "name)", ["engine"], registry=reg),
    )


def make_app(cfg: ServiceConfig) -> web.Application:
    sc = cfg.deployment.scenario
    app = web.Application(client_max_size=sc.serving.max_body_bytes)
    reg = CollectorRegistry()
    app[REGISTRY_KEY] = reg
    metrics = _make_metrics(reg)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        # One pooled session to every node; no per-host cap (open-loop load is unbounded).
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
        rd = cfg.deployment.run_dir
        decisions = SeriesWriter(Path(rd) / "decisions.jsonl" if rd else None, "router")
        kv = KVModel.from_spec(sc.model)
        pol = sc.policy
        st = RouterState(
            cfg=cfg, policy=router_policy(sc, cfg.deployment.resolved.intra_dc, cfg.deployment.inter_dc),
            tracker=LoadTracker(sc), kv=kv,
            prefill_time={name: PrefillTime.from_spec(hw.prefill) for name, hw in sc.hardware.items()},
            session=session, metrics=metrics, decisions=decisions, threshold=cfg.deployment.threshold,
            book=_cache_book(sc, kv), recent=Recent(pol.control.window), cache_aware=pol.cache_aware,
            bandwidth="scarce" if pol.bandwidth_state == "auto" else pol.bandwidth_state,
            health=HealthBook(cfg.deployment.nodes, probe_interval_s=PROBE_INTERVAL_S),
            held=HeldRecords(held_path) if held_path is not None else None,
        )
        app[STATE] = st
        if st.held is not None:
            app[HELD_KEY] = st.held
        Gauge("vllm:num_requests_running", "Requests in flight at the router", registry=reg) \
            .set_function(lambda: st.inflight)
        Gauge("testbed_routing_threshold_tokens", "Length threshold in force (tokens, -1 if none)",
              registry=reg).set_function(lambda: -1 if st.threshold is None else st.threshold)
        Gauge("testbed_cache_moves", "Cross-cluster cache moves started", registry=reg) \
            .set_function(lambda: st.cache_moves)
        Gauge("testbed_requests_retried", "Requests routed again after a failed attempt", registry=reg) \
            .set_function(lambda: st.retries)
        Gauge("testbed_instances_down", "Instances taken out of routing", registry=reg) \
            .set_function(lambda: len(st.health.down()))
        Gauge("testbed_request_ids_renamed", "Requests whose own id was in use or recorded, renamed id~dupN",
              registry=reg).set_function(lambda: st.ids.renamed)
        series = SeriesWriter(cfg.series_path(), "router")
        tasks = [asyncio.create_task(sample_forever(series, lambda: _collect(st), cfg.sample_interval)),
                 asyncio.create_task(_probe_forever(st))]
        ctl = _controller(cfg, st.threshold)
        if ctl is not None:
            def applied(sample: ControlSample, change: ThresholdChange | None) -> None:
                st.bandwidth_bps = sample.bandwidth_bps
                if pol.bandwidth_state == "auto":
                    st.bandwidth = sample.state
                if change is not None:
                    st.threshold = change.new

            def tails() -> list[float]:
                out, st.tails = st.tails, []
                return out

            loop = LinkControl(cfg.deployment, ctl, session, st.recent, series, decisions, pol.bandwidth_aware,
                               applied, tails, lambda: st.unroutable)
            tasks.append(asyncio.create_task(loop.run()))
        lt = longterm_for(sc, st.threshold, role_planner(sc, cfg.deployment.inter_dc.rate))
        if lt is not None:
            st.history = Recent(pol.control.long_term.window)
            st.unroutable = lt.roles.unroutable()

            def roles_applied(unroutable: frozenset[str], threshold: float | None) -> None:
                st.unroutable = unroutable
                if threshold is not None:
                    st.threshold = threshold

            roles = RoleControl(cfg.deployment, lt, RoleMeter(sc, st.tracker, lt.roles, cfg.scale.speedup), session,
                                st.history, series, decisions, st.health.down, roles_applied, ctl)
            tasks.append(asyncio.create_task(roles.run()))
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await session.close()
        series.close()
        decisions.close()
        if st.held is not None:
            st.held.close()

    held_path = hold_records_path(cfg.deployment.extra, cfg.deployment.run_dir)
    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    if held_path is not None:
        app.router.add_post(HOLD_PATH, post_hold)
    app[SCRAPE_KEY] = refresh_kv_usage
    add_common_routes(app)
    return app
