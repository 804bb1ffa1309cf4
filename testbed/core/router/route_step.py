"""One routing step of the router, I/O-free: look up every cluster's usable cached prefix, ask
the policy, book the assignment, pick the source of any cache move, pin what the prefill reads
and note the arrival for the control loop. The live router and the simulator both call `route`
with their own books (`testbed.core.router_books.RouterBooks`) and clock.
"""

from __future__ import annotations

from testbed.core.engine.servicetime import PrefillTime
from testbed.core.record import NAN, RequestRecord
from testbed.core.router.router_books import RoutePlan as RoutePlan
from testbed.core.router.router_books import RouterBooks
from testbed.core.routing.placement import Placement
from testbed.core.routing.policy import Decision, NoCapacity, RoutingRequest, least_loaded_prefill
from testbed.core.schema.scaling import Scale
from testbed.core.schema.scenario import Scenario


def route(
    st: RouterBooks,
    sc: Scenario,
    rid: str,
    input_tokens: int,
    hashes: tuple[int, ...],
    now: float,
    scale: Scale,
    down: frozenset[str] = frozenset(),
    avoid: frozenset[str] = frozenset(),
    output_tokens: int = 0,
) -> RoutePlan:
    """Route one request at `now` (the driver's clock; `scale` turns paper seconds into it) to
    instances not `down`; `avoid` (a retry's failed instances) too, unless nothing else is left
    of the role needed. The arrival goes to the short-term loop's `recent` window and, with the
    long-term loop, to its longer `history` with the request's `output_tokens`."""
    cached = st.book.index.usable(hashes, input_tokens) if st.book is not None else {}
    rreq = RoutingRequest(rid, input_tokens, cached)
    out = down | avoid if avoid else down
    try:
        view = st.tracker.view(st.threshold, now, out, st.bandwidth, st.bandwidth_bps, scale.speedup)
        d = st.policy(view, rreq)
    except NoCapacity:
        if not avoid:
            raise
        out = down
        view = st.tracker.view(st.threshold, now, out, st.bandwidth, st.bandwidth_bps, scale.speedup)
        d = st.policy(view, rreq)
    pl = st.placement
    if pl is not None and pl.applies(d):
        d = _place(st, pl, d, input_tokens, hashes, out)
    consts = st.per_cluster or _per_cluster(st, sc)
    work = scale.wire_seconds(consts[d.prefill_cluster][0](d.incremental_tokens, d.cached_tokens))
    st.tracker.assign(d, work, rid, hashes)
    plan = RoutePlan(d, work, hashes, rid=rid)
    if d.cache_move is not None:
        src = next(c for c in view.clusters if c.name == d.cache_move.src_cluster)
        plan.move_src = least_loaded_prefill(src).node_id
        if pl is not None and st.book is not None and src.name in pl.instance_scoped:
            at = st.book.index.usable_at(src.name, hashes, input_tokens)
            plan.move_src = pl.move_source(st.tracker.prefill_loads(src.name, out), at)
        plan.move_bytes_paper = st.kv.incremental(d.cache_move.tokens, d.cache_move.from_tokens)
    if st.book is not None:
        st.book.routed(rid, hashes, d, plan.move_src)
    # The planner judges the length the PD cluster would compute (the scarce rule's l).
    length = input_tokens
    if st.cache_aware:
        length -= max((v for k, v in cached.items() if consts[k][1]), default=0)
    paper_now = scale.paper_seconds(now)
    st.recent.add(paper_now, length)
    if st.history is not None:
        st.history.add(paper_now, length, output_tokens)
    return plan


def _per_cluster(st: RouterBooks, sc: Scenario) -> dict[str, tuple[PrefillTime, bool]]:
    """Each cluster's prefill time model and whether it is a PD cluster, read once per books
    (a scenario's clusters never change under a router)."""
    st.per_cluster = {c.name: (st.prefill_time[c.hardware], c.kind == "pd") for c in sc.clusters}
    return st.per_cluster


def _place(
    st: RouterBooks, pl: Placement, d: Decision, input_tokens: int, hashes: tuple[int, ...], out: frozenset[str]
) -> Decision:
    """The decision with the scenario's placement inside the chosen prefill cluster."""
    c = d.prefill_cluster
    at = st.book.index.usable_at(c, hashes, input_tokens) if st.book is not None and c in pl.instance_scoped else {}
    after: dict[str, str] = {}
    if pl.in_flight and at and d.cache_move is None:
        for n, pooled in at.items():
            at[n], after[n] = st.tracker.held_prefix(n, hashes, input_tokens, pooled)
    # Each instance's new blocks for the prompt only where the cost reads them.
    loads = st.tracker.prefill_loads(c, out, hashes, input_tokens if pl.kv_overlap else 0)
    return pl.place(d, input_tokens, loads, at, after)


def note_route(rec: RequestRecord, plan: RoutePlan) -> None:
    """What the routing plan decided, in the request's record: the one copy the live router and
    the simulator both make (each adds the stamps and bytes it measured)."""
    d = plan.d
    rec.prefill_cluster, rec.prefill_node = d.prefill_cluster, d.prefill_node
    rec.decode_cluster, rec.decode_node = d.decode_cluster, d.decode_node
    rec.cached_tokens, rec.decode_cached_tokens = d.cached_tokens, d.decode_cached_tokens
    rec.crossed_wan, rec.route_reason = d.crossed_wan, d.reason
    rec.threshold = NAN if d.threshold is None else float(d.threshold)
    if d.cache_move is not None:
        rec.cache_move_tokens = d.cache_move.tokens - d.cache_move.from_tokens
        rec.cache_move_src = plan.move_src or ""
        rec.cache_move_bytes_paper = plan.move_bytes_paper
