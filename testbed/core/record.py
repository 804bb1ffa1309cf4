"""One request's record: when each stage happened, where it ran, what it moved, how it ended.

Each timestamp has one name from the prefill node through the router and the final SSE chunk
to records.csv (`StageTimes`). On the wire (the prefill node's `PrefillReport` to the router,
the `testbed` object of the router's final chunk) times are unix seconds and a stage that never
happened is null; in a record they are seconds since the run's `t0` and NaN. Wire dicts are
read strictly: a missing or unknown field, or a value of the wrong type, raises
`RecordFormatError` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from testbed.core.errors import UserError
from testbed.core.failures import Failure, failure_kind
from testbed.core.json_types import JSONObject
from testbed.core.lifecycle import Event

NAN = float("nan")
# The serving side never learns a request's place in the client's trace.
NO_TRACE_INDEX = -1


class RecordFormatError(UserError, ValueError):
    """A wire dict or a stored row that does not fit the schema; the message names the field."""


# Not frozen: the router and the client stamp stages as they happen (a copy per token would
# cost more than the rest of a chunk's handling).
@dataclass(slots=True)
class StageTimes:
    """When each stage of one request happened (NaN: it never did), in the order a request
    lives through them."""

    arrival: float = NAN  # the client sent the request
    router_arrival: float = NAN  # the router received it
    routed: float = NAN  # the router decided
    cache_move_start: float = NAN  # the router asked the source cluster for the cached prefix
    prefill_sent: float = NAN  # the router sent the prefill to its node
    prefill_queued: float = NAN  # the prefill node queued it
    cache_wait_start: float = NAN  # the prefill node began waiting for the moved prefix
    cache_move_end: float = NAN  # the moved prefix is at the prefill node
    prefill_start: float = NAN
    transfer_start: float = NAN  # the first layer's KV handed to the sender (before prefill_end)
    transfer_first_sent: float = NAN  # the sender wrote the first KV byte
    prefill_end: float = NAN
    transfer_sent: float = NAN  # every KV byte handed to TCP
    transfer_first_received: float = NAN  # the decode node received the first KV byte
    transfer_end: float = NAN  # the decode node holds every KV byte
    decode_admitted: float = NAN
    decode_first_token: float = NAN  # the decode node produced the first token
    decode_last_token: float = NAN
    first_token: float = NAN  # the client saw the first token
    last_token: float = NAN

    def since(self, t0: float) -> StageTimes:
        """The same stamps relative to `t0`."""
        return StageTimes(*(getattr(self, n) - t0 for n in TIME_NAMES))

    def merge(self, other: StageTimes) -> None:
        """Take every stage `other` saw."""
        for n in TIME_NAMES:
            v = getattr(other, n)
            if not math.isnan(v):
                setattr(self, n, v)

    def lifecycle_events(self) -> list[tuple[float, Event]]:
        """The lifecycle events these stamps mean, in time order; ties keep the order the
        lifecycle expects them in."""
        order = (
            (self.routed, Event.ROUTE),
            (self.prefill_sent, Event.ENQUEUE_PREFILL),
            (self.prefill_start, Event.START_PREFILL),
            (self.transfer_start, Event.TRANSFER_START),
            (self.prefill_end, Event.END_PREFILL),
            (self.transfer_end, Event.KV_COMPLETE),
            (self.decode_admitted, Event.ADMIT),
            (self.decode_first_token, Event.FIRST_TOKEN),
            (self.decode_last_token, Event.FINISH),
        )
        stamps = sorted((t, i, ev) for i, (t, ev) in enumerate(order) if not math.isnan(t))
        return [(t, ev) for t, _, ev in stamps]


TIME_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(StageTimes))
# What the client itself observes; everything else in the stamps comes from the serving side.
CLIENT_TIMES: frozenset[str] = frozenset({"arrival", "first_token", "last_token"})


@dataclass(slots=True)
class RequestRecord:
    """One request of a run. Bytes are KV bytes: `_paper` in the paper's units, `_wire` as sent."""

    request_id: str
    trace_index: int
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # prefix the prefill cluster already held
    prefill_cluster: str = ""
    prefill_node: str = ""
    decode_cluster: str = ""
    decode_node: str = ""
    crossed_wan: bool = False  # KV crossed datacenters
    threshold: float = NAN  # routing threshold in force (tokens), NaN if none
    route_reason: str = ""  # the policy's reason for its decision
    prefill_modelled: float = NAN  # modelled prefill duration, wire seconds
    tokens_received: int = 0
    kv_bytes_paper: int = 0  # KV the request shipped to its decode node (what that side lacked)
    kv_bytes_wire: int = 0  # KV bytes the decode node received
    outcome: str = "pending"  # completed | failed
    reason: str = ""
    decode_cached_tokens: int = 0  # prefix the decode cluster already held (its KV did not ship)
    cache_move_tokens: int = 0  # cached prefix tokens moved between clusters before the prefill
    cache_move_src: str = ""  # prefill node that sent them
    cache_move_bytes_paper: int = 0
    cache_move_bytes_wire: int = 0  # what arrived at the prefill node
    retries: int = 0  # times the router routed it again (a failure before any token)
    retry_reason: str = ""  # what failed the attempt before
    failure_kind: str = ""  # what failed it (`testbed.core.failures.FailureKind`; empty when it completed)
    failure_node: str = ""  # the instance it failed at (empty: none, e.g. a KV transfer, a deadline)
    retry_kind: str = ""  # what failed the attempt before (a `FailureKind`; empty without a retry)
    retry_node: str = ""  # the instance the attempt before failed at (empty: none)
    # The trace's session (`testbed.core.sessions`): the client's knowledge, never on the wire.
    session_id: str = ""  # empty: the trace has no sessions
    turn: int = 0  # 1 = a session's first turn; 0: no sessions
    parent_index: int = -1  # trace index of the turn this one follows (-1: none)
    times: StageTimes = field(default_factory=StageTimes)

    @property
    def ttft(self) -> float:
        return self.times.first_token - self.times.arrival

    @property
    def tpot(self) -> float:
        if self.tokens_received < 2:
            return NAN
        return (self.times.last_token - self.times.first_token) / (self.tokens_received - 1)

    def fail(self, f: Failure, reason: str) -> None:
        """The request failed for good: `reason` for people, `f`'s kind and node as data."""
        self.outcome, self.reason = "failed", reason
        self.failure_kind, self.failure_node = f.kind.value, f.node

    def take_served(self, served: RequestRecord) -> None:
        """Take what the serving side reported (`served`), keeping what the client knows
        itself: the trace's request, what it sent and saw, and its verdict."""
        for n in SERVED_FIELDS:
            setattr(self, n, getattr(served, n))
        for n in TIME_NAMES:
            if n not in CLIENT_TIMES:
                setattr(self.times, n, getattr(served.times, n))


# Field name -> type name ("float", "int", "bool", "str"): annotations are strings here.
FIELD_TYPES: dict[str, str] = {f.name: str(f.type) for f in dataclasses.fields(RequestRecord) if f.name != "times"}
_SESSION = frozenset({"session_id", "turn", "parent_index"})
_IDENTITY = frozenset({"request_id", "trace_index", "input_tokens", "output_tokens", *_SESSION})
_CLIENT_VERDICT = frozenset({"tokens_received", "outcome", "reason", "failure_kind", "failure_node"})
SERVED_FIELDS: tuple[str, ...] = tuple(n for n in FIELD_TYPES if n not in _IDENTITY | _CLIENT_VERDICT)
# The wire carries everything but the trace index and the session (the client's alone).
_WIRE_FIELDS: tuple[str, ...] = tuple(n for n in FIELD_TYPES if n != "trace_index" and n not in _SESSION)


def _wire_value(name: str, kind: str, v: Any) -> Any:
    # bool is an int subclass: a boolean count or time is a writer bug, not a number.
    if kind == "float":
        if v is None:
            return NAN
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RecordFormatError(f"field {name!r}: expected a number or null, got {v!r}")
        return float(v)
    if kind == "int":
        if isinstance(v, bool) or not isinstance(v, int):
            raise RecordFormatError(f"field {name!r}: expected an integer, got {v!r}")
        return v
    if kind == "bool":
        if not isinstance(v, bool):
            raise RecordFormatError(f"field {name!r}: expected true or false, got {v!r}")
        return v
    if not isinstance(v, str):
        raise RecordFormatError(f"field {name!r}: expected a string, got {v!r}")
    return v


def _kind_value(name: str, v: Any) -> str:
    """A failure kind's text: empty or a `FailureKind`."""
    text = str(_wire_value(name, "str", v))
    try:
        failure_kind(text, f"field {name!r}")
    except ValueError as e:
        raise RecordFormatError(str(e)) from None
    return text


_KIND_FIELDS = frozenset({"failure_kind", "retry_kind"})


def _check_keys(obj: Any, expected: Mapping[str, str], what: str) -> None:
    if not isinstance(obj, Mapping):
        raise RecordFormatError(f"{what}: expected an object, got {type(obj).__name__}")
    missing = [n for n in expected if n not in obj]
    if missing:
        raise RecordFormatError(f"{what}: missing field {missing[0]!r}")
    unknown = sorted(k for k in obj if k not in expected)
    if unknown:
        raise RecordFormatError(f"{what}: unknown field {unknown[0]!r}")


def _stamp(t: float, t0: float) -> float | None:
    return None if math.isnan(t) else t + t0


_RECORD_WIRE: dict[str, str] = {**{n: FIELD_TYPES[n] for n in _WIRE_FIELDS}, **{n: "float" for n in TIME_NAMES}}


def record_to_wire(rec: RequestRecord, t0: float = 0.0) -> JSONObject:
    """The `testbed` object of the router's final chunk; record times are relative to `t0`."""
    out: JSONObject = {}
    for n in _WIRE_FIELDS:
        v = getattr(rec, n)
        out[n] = None if isinstance(v, float) and math.isnan(v) else v
    out.update((n, _stamp(getattr(rec.times, n), t0)) for n in TIME_NAMES)
    return out


def record_from_wire(obj: Any, trace_index: int = NO_TRACE_INDEX, t0: float = 0.0) -> RequestRecord:
    """The record a `testbed` object describes, times relative to `t0`."""
    _check_keys(obj, _RECORD_WIRE, "request record")
    kw: dict[str, Any] = {
        n: _kind_value(n, obj[n]) if n in _KIND_FIELDS else _wire_value(n, FIELD_TYPES[n], obj[n]) for n in _WIRE_FIELDS
    }
    times = StageTimes(*(_wire_value(n, "float", obj[n]) - t0 for n in TIME_NAMES))
    return RequestRecord(trace_index=trace_index, times=times, **kw)


# The stages a prefill node sees.
PREFILL_TIMES: tuple[str, ...] = (
    "prefill_queued",
    "cache_wait_start",
    "cache_move_end",
    "prefill_start",
    "transfer_start",
    "transfer_first_sent",
    "prefill_end",
    "transfer_sent",
)


@dataclass(slots=True)
class PrefillReport:
    """A prefill node's answer to the router: its stamps (`PREFILL_TIMES`, unix seconds), the
    modelled duration, what a moved-in cached prefix weighed, and why it failed if it did."""

    times: StageTimes = field(default_factory=StageTimes)
    prefill_modelled: float = NAN
    cache_move_bytes_wire: int = 0
    error: str = ""  # empty: the prefill ran and every KV byte went to TCP
    error_kind: str = ""  # the error's `FailureKind`


_REPORT_WIRE: dict[str, str] = {
    **{n: "float" for n in PREFILL_TIMES},
    "prefill_modelled": "float",
    "cache_move_bytes_wire": "int",
    "error": "str",
    "error_kind": "str",
}


def report_to_wire(rep: PrefillReport) -> JSONObject:
    out: JSONObject = {n: _stamp(getattr(rep.times, n), 0.0) for n in PREFILL_TIMES}
    out.update(
        prefill_modelled=None if math.isnan(rep.prefill_modelled) else rep.prefill_modelled,
        cache_move_bytes_wire=rep.cache_move_bytes_wire,
        error=rep.error,
        error_kind=rep.error_kind,
    )
    return out


def report_from_wire(obj: Any) -> PrefillReport:
    _check_keys(obj, _REPORT_WIRE, "prefill report")
    times = StageTimes()
    for n in PREFILL_TIMES:
        setattr(times, n, _wire_value(n, "float", obj[n]))
    return PrefillReport(
        times,
        _wire_value("prefill_modelled", "float", obj["prefill_modelled"]),
        _wire_value("cache_move_bytes_wire", "int", obj["cache_move_bytes_wire"]),
        _wire_value("error", "str", obj["error"]),
        _kind_value("error_kind", obj["error_kind"]),
    )
