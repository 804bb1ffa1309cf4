"""One simulated request: its routing plan, lifecycle and every stamp, in paper time; and the
one place its stamps become a `RequestRecord` (wire seconds since the start, like a live run's,
so every summary, report and comparison reads a simulated run as it reads an emulated one)."""

from __future__ import annotations

import math

from testbed.core.lifecycle import Lifecycle
from testbed.core.prefill_queue import PrefillJob
from testbed.core.routing import RoutePlan
from testbed.core.scaling import Scale
from testbed.core.record import RequestRecord, StageTimes
from testbed.traces.types import TraceRequest

NAN = math.nan


class SimRequest:
    __slots__ = ("index", "tr", "rid", "life", "plan", "job", "arrival", "routed", "queued", "start", "end",
                 "modelled", "transfer_start", "transfer_end", "admitted", "first", "last", "kv_paper", "kv_wire",
                 "tail_bytes", "move_start", "move_end", "move_wire", "moved", "prefill_seen", "outcome", "reason")

    def __init__(self, index: int, tr: TraceRequest, arrival: float) -> None:
        self.index = index
        self.tr = tr
        self.rid = tr.request_id
        self.life = Lifecycle(tr.request_id)
        self.plan: RoutePlan | None = None
        self.job: PrefillJob | None = None
        self.arrival = arrival
        self.routed = NAN
        self.queued = NAN
        self.start = NAN
        self.end = NAN
        self.modelled = NAN
        self.transfer_start = NAN
        self.transfer_end = NAN
        self.admitted = NAN
        self.first = NAN
        self.last = NAN
        self.kv_paper = 0
        self.kv_wire = 0
        self.tail_bytes = 0.0         # paper bytes the prefill releases when its compute ends
        self.move_start = NAN
        self.move_end = NAN
        self.move_wire = 0
        self.moved = False            # the moved cached prefix has reached the prefill node
        self.prefill_seen = False     # the router has the prefill's answer (its KV is in the sender's sockets)
        self.outcome = "pending"
        self.reason = ""

    def record(self, scale: Scale) -> RequestRecord:
        """The request's row of records.csv: wire seconds, wire and paper bytes."""
        s = scale.speedup
        tr = self.tr
        times = StageTimes(arrival=self.arrival / s, router_arrival=self.arrival / s, routed=self.routed / s,
                           prefill_queued=self.queued / s, prefill_start=self.start / s, prefill_end=self.end / s,
                           transfer_start=self.transfer_start / s, transfer_end=self.transfer_end / s,
                           decode_admitted=self.admitted / s, first_token=self.first / s, last_token=self.last / s,
                           decode_first_token=self.first / s, decode_last_token=self.last / s)
        rec = RequestRecord(tr.request_id, self.index, tr.input_tokens, tr.output_tokens, times=times)
        rec.prefill_modelled = self.modelled / s
        rec.kv_bytes_paper = self.kv_paper
        rec.kv_bytes_wire = self.kv_wire
        rec.outcome = self.outcome
        rec.reason = self.reason
        if self.outcome == "completed":
            rec.tokens_received = tr.output_tokens
        plan = self.plan
        if plan is not None:
            d = plan.d
            rec.prefill_cluster = d.prefill_cluster
            rec.prefill_node = d.prefill_node
            rec.decode_node = d.decode_node
            rec.crossed_wan, rec.route_reason = d.crossed_wan, d.reason
            rec.threshold = NAN if d.threshold is None else float(d.threshold)
            rec.cached_tokens = d.cached_tokens
            rec.decode_cached_tokens = d.decode_cached_tokens
            if d.cache_move is not None:
                rec.cache_move_tokens = d.cache_move.tokens - d.cache_move.from_tokens
                rec.times.cache_move_start = self.move_start / s
                rec.times.cache_move_end = self.move_end / s
                rec.cache_move_bytes_paper = plan.move_bytes_paper
                rec.cache_move_bytes_wire = self.move_wire
        return rec
