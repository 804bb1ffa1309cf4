"""One attempt of a request through the nodes: route it, note the decision, then drive the
prefill, any cross-cluster cache move and the KV transfer while relaying the decode node's
token stream (`drive`)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

from testbed.core.failures import FailureKind as K
from testbed.core.failures import failure_kind
from testbed.core.json_types import JSONObject
from testbed.core.record import PrefillReport, RecordFormatError, report_from_wire
from testbed.core.router.health import Outcome
from testbed.core.router.route_step import RoutePlan, note_route
from testbed.core.router.route_step import route as route_books
from testbed.core.router.router_books import decision_line
from testbed.live.clock import now
from testbed.live.openai_api import ParsedRequest, block_hashes
from testbed.live.router.state import Progress, RequestFailed, RouterState, log, outcome_of
from testbed.live.router.vllm_metrics import note_prefix
from testbed.metrics.series_format import Sample


def route(st: RouterState, req: ParsedRequest, rid: str, avoid: frozenset[str] = frozenset()) -> RoutePlan:
    """Route to instances believed up; `avoid` (a retry's failed instances) too, unless nothing
    else is left of the role needed."""
    sc = st.cfg.deployment.scenario
    hashes = req.hash_ids or block_hashes(req.content, sc.model.block_tokens)
    return route_books(
        st,
        sc,
        rid,
        req.input_tokens,
        hashes,
        now(),
        st.cfg.scale,
        st.health.down() | st.unroutable,
        avoid,
        output_tokens=req.output_tokens,
    )


def note_decision(st: RouterState, rid: str, req: ParsedRequest, plan: RoutePlan, prog: Progress) -> None:
    d = plan.d
    prog.rec.times.routed = now()
    st.metrics.routed.labels(cluster=d.prefill_cluster).inc()
    note_prefix(st.metrics, req.input_tokens, d.cached_tokens)
    st.decisions.write([Sample(*decision_line(rid, d, st.bandwidth))])
    note_route(prog.rec, plan)
    # What the request moves: the KV the decode side lacks (paper bytes).
    prog.rec.kv_bytes_paper = st.kv.incremental(req.input_tokens, d.decode_cached_tokens)


async def _move_cache(st: RouterState, rid: str, plan: RoutePlan, tid: int, prog: Progress) -> None:
    """Have the source cluster's node send the cached prefix to the prefill node (the bytes
    cross the WAN); the prefill node waits for it before computing."""
    assert plan.move_src is not None
    st.cache_moves += 1
    src = st.cfg.deployment.nodes[plan.move_src]
    body = {
        "request_id": rid,
        "transfer_id": tid,
        "bytes": max(st.cfg.scale.wire_bytes(plan.move_bytes_paper), 1),
        "dest_node": plan.d.prefill_node,
    }
    prog.rec.times.cache_move_start = now()
    try:
        async with st.session.post(f"{src.http.url}/cache/send", json=body) as r:
            res: JSONObject = await r.json()
    except (aiohttp.ClientError, ValueError) as e:
        res = {"error": f"cache move source {plan.move_src} unreachable: {e}"}
    if "error" in res:
        # The source aborts the transfer, so the waiting prefill fails with the reason at once.
        log.warning("request %s: %s", rid, res["error"])


def _decode_error(ev: Mapping[str, object], node: str) -> RequestFailed:
    """The decode node's `error` event: its kind names what failed (its KV, or the node itself)."""
    try:
        kind = failure_kind(str(ev.get("kind", "")), f"decode node {node}'s error event") or K.DECODE_ERROR
    except ValueError as e:
        return RequestFailed(str(e), K.DECODE_ERROR, node)
    return RequestFailed(
        str(ev.get("reason", "decode failed")), kind, at=node if kind in (K.DECODE_DOWN, K.DECODE_ERROR) else ""
    )


async def drive(
    st: RouterState, req: ParsedRequest, rid: str, node_rid: str, plan: RoutePlan, prog: Progress
) -> AsyncIterator[int]:
    """Run one attempt of a request through prefill, transfer and decode (the nodes know the
    attempt as `node_rid`); yields cumulative token counts."""
    dep = st.cfg.deployment
    d = plan.d
    tid = next(st.transfer_ids)
    move_tid = next(st.transfer_ids) if d.cache_move is not None else None
    pnode, dnode = dep.nodes[d.prefill_node], dep.nodes[d.decode_node]
    kv_paper = st.kv.total(req.input_tokens)
    decode_body = {
        "request_id": node_rid,
        "transfer_id": tid,
        "input_tokens": req.input_tokens,
        "output_tokens": req.output_tokens,
        "kv_bytes_paper": kv_paper,
    }
    prefill_body = {
        "request_id": node_rid,
        "transfer_id": tid,
        "input_tokens": req.input_tokens,
        "cached_tokens": d.cached_tokens,
        "decode_cached_tokens": d.decode_cached_tokens,
        "cache_in_transfer": move_tid,
        "decode_node": d.decode_node,
    }
    if d.prefix_after:
        prefill_body["prefix_after"] = d.prefix_after
    rec, times = prog.rec, prog.rec.times

    def note_tail() -> None:
        if d.crossed_wan and math.isfinite(times.prefill_end) and math.isfinite(times.transfer_end):
            st.note_tail(max(times.transfer_end - times.prefill_end, 0.0))

    prefill_blame: list[tuple[str, Outcome]] = []  # set when the prefill node itself failed

    def prefill_finished(rep: PrefillReport) -> None:
        st.tracker.prefill_done(d, plan.work, plan.rid, plan.hashes)
        times.merge(rep.times)
        rec.prefill_modelled, rec.cache_move_bytes_wire = rep.prefill_modelled, rep.cache_move_bytes_wire
        if rep.error:
            node, outcome = prefill_blame[0] if prefill_blame else ("", "failed")
            kind = K(rep.error_kind) if rep.error_kind else K.PREFILL_ERROR
            # The node's own failure happened there, whether or not it is to blame for the next route.
            at = d.prefill_node if kind in (K.PREFILL_DOWN, K.PREFILL_ERROR) else node
            raise RequestFailed(rep.error, kind, node, outcome, at=at)
        st.note_health(d.prefill_node, "ok", now())
        if math.isfinite(times.transfer_end):
            note_tail()
        st.prefilled(rid, plan, req.input_tokens, moved=math.isfinite(rep.times.cache_move_end))

    move_task: asyncio.Task[None] | None = None
    try:
        dresp = await st.session.post(f"{dnode.http.url}/decode", json=decode_body)
    except aiohttp.ClientError as e:
        raise RequestFailed(
            f"decode node {d.decode_node} unreachable: {e}", K.DECODE_DOWN, d.decode_node, outcome_of(e)
        ) from None
    if dresp.status != 200:
        text = await dresp.text()
        dresp.release()
        raise RequestFailed(
            f"decode node {d.decode_node} answered {dresp.status}: {text[:200]}",
            K.DECODE_ERROR,
            d.decode_node if dresp.status >= 500 else "",
            retryable=dresp.status >= 500,
            at=d.decode_node,
        )

    async def prefill() -> PrefillReport:
        try:
            async with st.session.post(f"{pnode.http.url}/prefill", json=prefill_body) as r:
                res: Any = await r.json()
                if r.status in (200, 502):  # the node's own report, failed or not
                    return report_from_wire(res)
                err = res.get("error") if isinstance(res, dict) else None
                if r.status >= 500:
                    prefill_blame.append((d.prefill_node, "failed"))
                return PrefillReport(
                    error=str(err) if err else f"prefill node answered {r.status}", error_kind=K.PREFILL_ERROR
                )
        except RecordFormatError as e:
            prefill_blame.append((d.prefill_node, "failed"))
            return PrefillReport(
                error=f"prefill node {d.prefill_node} answered a malformed report: {e}", error_kind=K.PREFILL_ERROR
            )
        except (aiohttp.ClientError, ValueError) as e:
            prefill_blame.append((d.prefill_node, outcome_of(e)))
            return PrefillReport(error=f"prefill node {d.prefill_node} unreachable: {e}", error_kind=K.PREFILL_DOWN)

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
                raise RequestFailed(
                    f"decode node {d.decode_node} stream broke: {type(e).__name__}: {e}", K.DECODE_DOWN, d.decode_node
                ) from None
            if not isinstance(ev, dict):
                raise RequestFailed(
                    f"decode node {d.decode_node} closed the stream early", K.DECODE_DOWN, d.decode_node
                )
            kind = ev.get("event")
            if kind == "kv":
                times.transfer_end = float(ev["complete"])
                times.transfer_first_received = float(ev["first_byte"])
                rec.kv_bytes_wire = int(ev["bytes"])
                if prefill_seen:
                    note_tail()
                st.kv_complete(rid, plan, req.input_tokens)
            elif kind == "admitted":
                times.decode_admitted = float(ev["t"])
            elif kind == "tokens":
                t = float(ev["t"])
                if math.isnan(times.decode_first_token):
                    times.decode_first_token = t
                times.decode_last_token = t
                yield int(ev["n"])
            elif kind == "done":
                st.note_health(d.decode_node, "ok", now())
                break
            elif kind == "error":
                raise _decode_error(ev, d.decode_node)
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
        st.attempt_over(rid, plan, prefill_seen)
        if move_task is not None and not move_task.done():
            move_task.cancel()
        dresp.close()
