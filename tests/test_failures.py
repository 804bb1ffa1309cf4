"""Failures as data (`testbed.core.failures`): the kinds' texts, their checks where a kind is read
back (the wire, records.csv), and the kind each point of failure names, live and simulated."""

from __future__ import annotations

import math
from typing import Any

import pytest

from testbed.core.failures import NODE_KINDS, Failure, failure_kind
from testbed.core.failures import FailureKind as K
from testbed.core.record import (
    PrefillReport,
    RecordFormatError,
    RequestRecord,
    record_from_wire,
    record_to_wire,
    report_from_wire,
    report_to_wire,
)
from testbed.live.router.drive import _decode_error
from testbed.live.router.records import Seen, held_record

pytestmark = pytest.mark.pure


def test_every_kind_reads_back_from_its_text_and_an_unknown_one_names_the_kinds() -> None:
    assert all(failure_kind(k.value) is k for k in K)
    assert failure_kind("") is None
    with pytest.raises(ValueError, match=r"^rec: unknown failure kind 'node_down' \(known: prefill_node_down, "):
        failure_kind("node_down", "rec")
    # Texts are what the files hold: lower case, one word.
    assert all(k.value == k.value.lower() and " " not in k.value for k in K)
    assert len({k.value for k in K}) == len(K)


def test_a_node_failure_has_its_role_s_kind_by_whether_the_node_answered() -> None:
    assert NODE_KINDS["decode", False] is K.DECODE_DOWN and NODE_KINDS["decode", True] is K.DECODE_ERROR
    assert NODE_KINDS["prefill", False] is K.PREFILL_DOWN and NODE_KINDS["prefill", True] is K.PREFILL_ERROR


def test_a_record_fails_with_its_kind_and_instance_as_data() -> None:
    rec = RequestRecord("r", 0, 10, 2)
    rec.fail(Failure(K.DECODE_DOWN, "pd-d0"), "decode node pd-d0 stream broke: gone")
    assert (rec.outcome, rec.reason, rec.failure_kind, rec.failure_node) == (
        "failed",
        "decode node pd-d0 stream broke: gone",
        "decode_node_down",
        "pd-d0",
    )


def test_the_wire_carries_the_kinds_and_refuses_an_unknown_one() -> None:
    rec = RequestRecord("r", 0, 10, 2, retries=1, retry_kind="prefill_node_down", retry_node="p0")
    rec.fail(Failure(K.KV_TRANSFER), "kv transfer failed: reset")
    back = record_from_wire(record_to_wire(rec))
    assert (back.failure_kind, back.failure_node, back.retry_kind, back.retry_node) == (
        "kv_transfer_failed",
        "",
        "prefill_node_down",
        "p0",
    )
    wire: dict[str, Any] = record_to_wire(rec) | {"retry_kind": "gone"}
    with pytest.raises(RecordFormatError, match=r"field 'retry_kind': unknown failure kind 'gone'"):
        record_from_wire(wire)
    rep = report_from_wire(report_to_wire(PrefillReport(error="cache move failed: x", error_kind=K.CACHE_MOVE)))
    assert (rep.error, rep.error_kind) == ("cache move failed: x", "cache_move_failed")
    assert math.isnan(rep.prefill_modelled)
    with pytest.raises(RecordFormatError, match=r"field 'error_kind': unknown failure kind 'oops'"):
        report_from_wire(report_to_wire(PrefillReport()) | {"error_kind": "oops"})


@pytest.mark.parametrize(
    "event, kind, at, blamed",
    [
        ({"event": "error", "kind": "kv_transfer_failed", "reason": "kv transfer failed: x"}, K.KV_TRANSFER, "", ""),
        ({"event": "error", "kind": "decode_node_error", "reason": "cannot hold it"}, K.DECODE_ERROR, "pd-d1", ""),
        ({"event": "error", "reason": "an older node's event"}, K.DECODE_ERROR, "pd-d1", ""),
        ({"event": "error", "kind": "melted", "reason": "?"}, K.DECODE_ERROR, "pd-d1", "pd-d1"),
    ],
)
def test_the_decode_node_s_error_event_names_its_kind(event: dict[str, Any], kind: K, at: str, blamed: str) -> None:
    e = _decode_error(event, "pd-d1")
    assert (e.kind, e.at, e.node) == (kind, at, blamed)
    assert e.failure == Failure(kind, at, str(e))


def test_a_held_record_without_a_verdict_names_why_it_ended() -> None:
    rec = held_record(Seen(1.0))
    assert (rec.outcome, rec.failure_kind) == ("failed", "client_disconnected")
    seen = Seen(1.0, error="no capacity: nothing up", error_kind=K.NO_CAPACITY)
    assert (held_record(seen).reason, held_record(seen).failure_kind) == ("no capacity: nothing up", "no_capacity")
