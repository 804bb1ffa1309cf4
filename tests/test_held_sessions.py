"""A held deployment's records name each request's session from the client's header (the
replayer's and aiperf's X-Session-ID, aiperf's default X-Correlation-ID) and number its turns
by arrival."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.live.held import HeldRecords
from testbed.live.router.records import MAX_SESSION_CHARS, Seen, held_record, session_header

pytestmark = pytest.mark.pure


def test_the_session_comes_from_the_first_header_that_names_it() -> None:
    assert session_header({"X-Session-ID": "s1", "X-Correlation-ID": "c1"}) == "s1"
    assert session_header({"X-Correlation-ID": "conv-7"}) == "conv-7"
    assert session_header({}) == ""
    # Hostile bytes do not reach the records: no separators, no control characters, bounded.
    assert session_header({"X-Session-ID": 'a,b"c\nd\x00e'}) == "abcde"
    assert len(session_header({"X-Session-ID": "x" * 10_000})) == MAX_SESSION_CHARS


def test_turns_are_numbered_by_arrival_per_session(tmp_path: Path) -> None:
    held = HeldRecords(tmp_path / "records.csv")
    assert [held.next_turn(s) for s in ("a", "b", "a", "", "a", "b")] == [1, 1, 2, 0, 3, 2]


def test_a_held_record_carries_its_session_and_turn() -> None:
    rec = held_record(Seen(1.0, session="conv-7", turn=2))
    assert (rec.session_id, rec.turn) == ("conv-7", 2)
    assert held_record(Seen(1.0)).session_id == ""
