"""One attempt of a simulated request: its routing plan, lifecycle and every stamp, in paper
time; and the one place its stamps become a `RequestRecord` (wire seconds since the start, like
a live run's, so every summary, report and comparison reads a simulated run as it reads an
emulated one). A retry is a new attempt (`retry`): the client's arrival kept, the failed
attempt's stages not, as the live router's retry record (`testbed.live.router.records`)."""

from __future__ import annotations

import math

from testbed.core.engine.prefill_queue import PrefillJob
from testbed.core.failures import Failure
from testbed.core.lifecycle import Lifecycle
from testbed.core.record import RequestRecord, StageTimes
from testbed.core.router.retries import retry_id
from testbed.core.router.route_step import RoutePlan, note_route
from testbed.core.schema.scaling import Scale
from testbed.traces.types import TraceRequest

NAN = math.nan


class SimRequest:
    # Its stamps (paper seconds) and what it moved are named as their fields of the record
    # (`RequestRecord`, `StageTimes`), which `record` copies by the same names.
    __slots__ = (
        "index",
        "tr",
        "rid",
        "life",
        "plan",
        "job",
        "arrival",
        "routed",
        "prefill_queued",
        "prefill_start",
        "prefill_end",
        "prefill_modelled",
        "transfer_start",
        "transfer_end",
        "decode_admitted",
        "decode_first_token",
        "decode_last_token",
        "kv_bytes_paper",
        "kv_bytes_wire",
        "tail_bytes",
        "cache_move_start",
        "cache_move_end",
        "cache_move_bytes_wire",
        "moved",
        "prefill_seen",
        "outcome",
        "reason",
        "failure",
        "retries",
        "retried",
        "gone",
        "relay",
        "relay_last",
        "kv_range",
        "move_range",
    )

    def __init__(
        self,
        index: int,
        tr: TraceRequest,
        arrival: float,
        retries: int = 0,
        retried: Failure | None = None,
        relay: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        self.index = index
        self.tr = tr
        self.rid = retry_id(tr.request_id, retries)  # what the nodes know this attempt by
        self.life = Lifecycle(tr.request_id)
        self.plan: RoutePlan | None = None
        self.job: PrefillJob | None = None
        self.arrival = arrival
        self.routed = NAN
        self.prefill_queued = NAN
        self.prefill_start = NAN
        self.prefill_end = NAN
        self.prefill_modelled = NAN
        self.transfer_start = NAN
        self.transfer_end = NAN
        self.decode_admitted = NAN
        self.decode_first_token = NAN  # the client sees them `relay`, `relay_last` later
        self.decode_last_token = NAN
        self.kv_bytes_paper = 0
        self.kv_bytes_wire = 0
        self.tail_bytes = 0.0  # paper bytes the prefill releases when its compute ends
        self.cache_move_start = NAN
        self.cache_move_end = NAN
        self.cache_move_bytes_wire = 0
        self.moved = False  # the moved cached prefix has reached the prefill node
        self.prefill_seen = False  # the router has the prefill's answer (its KV is delivered)
        self.outcome = "pending"
        self.reason = ""
        self.failure: Failure | None = None  # what failed the request for good
        self.retries = retries
        self.retried = retried  # what failed the attempt before
        self.gone = False  # this attempt failed or was given up: late events ignore it
        self.relay, self.relay_last = relay  # paper seconds from the decode node's first, last token to the client
        self.kv_range: tuple[float, float] | None = None  # its KV's byte positions in its path
        self.move_range: tuple[float, float] | None = None  # its moved prefix's, in the move's path

    def retry(self, f: Failure) -> SimRequest:
        """The next attempt of the same request, after `f` failed this one."""
        return SimRequest(self.index, self.tr, self.arrival, self.retries + 1, f, (self.relay, self.relay_last))

    def tokens_sent(self, t: float) -> bool:
        """The client has seen a token by `t` (a retry could not take it back)."""
        return not math.isnan(self.decode_first_token) and self.decode_first_token + self.relay <= t

    def record(self, scale: Scale) -> RequestRecord:
        """The request's row of records.csv: wire seconds, wire and paper bytes."""
        s = scale.speedup
        tr = self.tr
        times = StageTimes(
            arrival=self.arrival / s,
            router_arrival=self.arrival / s,
            routed=self.routed / s,
            prefill_queued=self.prefill_queued / s,
            prefill_start=self.prefill_start / s,
            prefill_end=self.prefill_end / s,
            transfer_start=self.transfer_start / s,
            transfer_end=self.transfer_end / s,
            decode_admitted=self.decode_admitted / s,
            first_token=(self.decode_first_token + self.relay) / s,
            last_token=(self.decode_last_token + self.relay_last) / s,
            decode_first_token=self.decode_first_token / s,
            decode_last_token=self.decode_last_token / s,
        )
        rec = RequestRecord(
            tr.request_id, self.index, tr.input_tokens, tr.output_tokens, times=times, retries=self.retries
        )
        if self.retried is not None:
            f = self.retried
            rec.retry_reason, rec.retry_kind, rec.retry_node = f.detail, f.kind.value, f.node
        rec.prefill_modelled = self.prefill_modelled / s
        rec.kv_bytes_paper = self.kv_bytes_paper
        rec.kv_bytes_wire = self.kv_bytes_wire
        rec.outcome = self.outcome
        rec.reason = self.reason
        if self.failure is not None:
            rec.failure_kind, rec.failure_node = self.failure.kind.value, self.failure.node
        if self.outcome == "completed":
            rec.tokens_received = tr.output_tokens
        plan = self.plan
        if plan is not None:
            note_route(rec, plan)
            if plan.d.cache_move is not None:
                rec.times.cache_move_start = self.cache_move_start / s
                rec.times.cache_move_end = self.cache_move_end / s
                rec.cache_move_bytes_wire = self.cache_move_bytes_wire
        return rec
