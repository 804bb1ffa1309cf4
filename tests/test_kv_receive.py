"""Receiver state machine of the KV transfer layer: reassembly over connections, isolation of bad
connections, verification, expectations and the stale sweep; and the sender machine driving it."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.core.frames import HEADER, MAGIC, MAX_PAYLOAD, encode_abort, encode_data, encode_end, payload_pattern
from testbed.core.kv_receive import (
    CloseConnection,
    ConnectionLost,
    IncomingTransfer,
    Reassembler,
    ReceiveEvent,
    TransferCompleted,
    TransferFailed,
    TransferResult,
)
from testbed.core.kv_send import DataEncoder, SendPath

pytestmark = pytest.mark.pure


def data(tid: int, offset: int, total: int, n: int, layer: int = 0, checksum: bool = False) -> bytes:
    head, view = encode_data(tid, layer, offset, total, payload_pattern(tid, offset, n), checksum)
    return head + bytes(view)


def results(events: list[ReceiveEvent]) -> dict[int, TransferResult]:
    return {e.result.transfer_id: e.result for e in events if isinstance(e, (TransferCompleted, TransferFailed))}


def stream_of_one_transfer() -> bytes:
    return data(1, 0, 300, 100) + data(1, 200, 300, 100, layer=2) + data(1, 100, 300, 100, layer=1) + encode_end(1, 3, 300)


def test_whole_stream_completes_the_transfer() -> None:
    rx = Reassembler()
    conn = rx.connection_made("peer")
    (ev,) = rx.data_received(conn, stream_of_one_transfer(), 5.0)
    assert ev == TransferCompleted(TransferResult(1, True, 300, 5.0, 5.0, "", 3, 1), claimed=False)
    assert rx.bytes_received == 300 and rx.transfers_completed == 1 and rx.active == 0


def test_stream_fed_byte_by_byte_completes_on_the_last_byte() -> None:
    rx = Reassembler()
    conn = rx.connection_made()
    raw = stream_of_one_transfer()
    for i, byte in enumerate(raw[:-1]):
        assert rx.data_received(conn, bytes([byte]), float(i)) == []
    (ev,) = rx.data_received(conn, raw[-1:], 1e6)
    assert isinstance(ev, TransferCompleted)
    assert ev.result.first_byte == float(HEADER.size + 99)  # when the first frame was whole
    assert ev.result.complete == 1e6


def test_trailing_partial_frame_waits_then_fails_its_transfer_when_the_connection_drops() -> None:
    rx = Reassembler()
    conn = rx.connection_made("10.0.0.1:5")
    partial = data(2, 0, 100, 100)[:70]
    events = rx.data_received(conn, stream_of_one_transfer() + partial, 1.0)
    assert list(results(events)) == [1]
    assert rx.active == 0  # transfer 2's header arrived, but no frame of it yet
    events = rx.connection_lost(conn, 2.0)
    assert events[0] == ConnectionLost(conn, "connection from 10.0.0.1:5 lost mid-frame")
    r = results(events)[2]
    assert not r.ok and r.reason == "connection from 10.0.0.1:5 lost mid-frame"


def test_out_of_order_ranges_over_several_connections_complete_once_all_arrived() -> None:
    rx = Reassembler()
    conns = [rx.connection_made(f"p{i}") for i in range(3)]
    total, step = 1000, 100
    pieces = [(off, off // 250) for off in range(0, total, step)]
    random.Random(3).shuffle(pieces)
    assert rx.data_received(conns[0], encode_end(9, 4, total), 0.0) == []  # END may come first
    events: list[ReceiveEvent] = []
    for i, (off, layer) in enumerate(pieces):
        events = rx.data_received(conns[i % 3], data(9, off, total, step, layer), float(i + 1))
        if i < len(pieces) - 1:
            assert events == []
            t = rx.transfer(9)
            assert t is not None and not t.complete and t.received == (i + 1) * step
    r = results(events)[9]
    assert r.ok and r.bytes == total and r.connections == 3 and r.layers_done == 4
    assert (r.first_byte, r.complete) == (0.0, float(len(pieces)))


@pytest.mark.parametrize(
    "second", [(0, 100), (50, 100), (0, 10), (99, 1), (90, 20), (150, 10)],
    ids=["same", "overlap-right", "inside-left", "inside-right", "straddle", "inside-second"],
)
def test_duplicate_and_overlapping_ranges_fail_the_transfer(second: tuple[int, int]) -> None:
    rx = Reassembler()
    conn = rx.connection_made()
    rx.data_received(conn, data(5, 0, 300, 100) + data(5, 140, 300, 40), 0.0)
    off, n = second
    r = results(rx.data_received(conn, data(5, off, 300, n), 1.0))[5]
    assert not r.ok and r.reason == f"duplicate or overlapping DATA at offset {off} length {n}"
    assert r.bytes == 140


def test_adjacent_and_empty_ranges_are_not_overlaps() -> None:
    t = IncomingTransfer(1, 100, 0.0, 0.0)
    for off, n in [(40, 10), (60, 10), (50, 10), (0, 0), (50, 0), (0, 40), (70, 30)]:
        assert t.add_range(off, n), (off, n)
    assert (t.starts, t.ends) == ([0], [100])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12)), max_size=30))
def test_add_range_matches_a_set_of_bytes(ranges: list[tuple[int, int]]) -> None:
    t = IncomingTransfer(1, 100, 0.0, 0.0)
    have: set[int] = set()
    for off, n in ranges:
        new = set(range(off, off + n))
        ok = t.add_range(off, n)
        assert ok == (not new & have)
        if ok:
            have |= new
    # Stored ranges are sorted, disjoint, non-adjacent, and cover exactly the accepted bytes.
    assert all(e < s for e, s in zip(t.ends, t.starts[1:]))
    assert {b for s, e in zip(t.starts, t.ends) for b in range(s, e)} == have


def test_bad_frame_fails_only_the_transfers_of_its_connection() -> None:
    rx = Reassembler()
    a, b = rx.connection_made("A"), rx.connection_made("B")
    rx.data_received(a, data(1, 0, 200, 100), 0.0)
    rx.data_received(a, data(2, 0, 200, 100), 0.0)
    rx.data_received(b, data(2, 100, 200, 100) + data(3, 0, 200, 100), 0.0)
    assert rx.carried(a) == [1, 2] and rx.carried(b) == [2, 3]
    # A good frame of transfer 4 and garbage in one read: the good frame still counts.
    events = rx.data_received(a, data(4, 0, 50, 50) + b"\x00GARBAGE" * 8, 1.0)
    assert events[0] == CloseConnection(a, "A", "bad magic 0x00474152 (expected 0x4b565446)")
    failed = results(events)
    assert sorted(failed) == [1, 2, 4]
    assert all(not r.ok and r.reason.startswith("bad frame from A: bad magic") for r in failed.values())
    assert failed[4].bytes == 50 and failed[2].bytes == 200
    assert rx.data_received(a, data(3, 100, 200, 100), 2.0) == []  # a broken connection is deaf
    assert rx.connection_lost(a, 3.0, "ConnectionResetError()") == []
    r3 = results(rx.data_received(b, data(3, 100, 200, 100) + encode_end(3, 1, 200), 4.0))[3]
    assert r3.ok and rx.transfers_failed == 3 and rx.transfers_completed == 1


def test_bad_length_fails_the_transfer_it_names_even_if_never_seen() -> None:
    rx = Reassembler()
    conn = rx.connection_made("A")
    bad = HEADER.pack(MAGIC, 1, 1, 0, 300, 0, 0, MAX_PAYLOAD + 1, 0, MAX_PAYLOAD + 1, 0, 0)
    events = rx.data_received(conn, bad, 0.0)
    assert isinstance(events[0], CloseConnection) and "length" in events[0].reason
    r = results(events)[300]
    assert not r.ok and str(MAX_PAYLOAD + 1) in r.reason and r.bytes == 0


def test_abort_fails_with_the_senders_reason_and_stragglers_are_dropped() -> None:
    rx = Reassembler()
    conn = rx.connection_made()
    r = results(rx.data_received(conn, data(8, 0, 50, 10) + encode_abort(8, "prefill node out of memory"), 0.0))[8]
    assert not r.ok and r.reason == "aborted by sender: prefill node out of memory"
    assert rx.data_received(conn, data(8, 10, 50, 10), 1.0) == []  # dropped, connection still usable
    assert results(rx.data_received(conn, data(9, 0, 10, 10) + encode_end(9, 1, 10), 1.0))[9].ok


def test_totals_that_disagree_fail_the_transfer() -> None:
    rx = Reassembler()
    conn = rx.connection_made()
    r = results(rx.data_received(conn, data(1, 0, 100, 10) + data(1, 10, 200, 10), 0.0))[1]
    assert r.reason == "DATA at offset 10 says total 200, expected 100"
    r = results(rx.data_received(conn, data(2, 0, 100, 10) + encode_end(2, 1, 99), 0.0))[2]
    assert r.reason == "END says total 99, data said 100"


def test_verify_checks_the_pattern_and_requires_a_checksum() -> None:
    rx = Reassembler(verify=True)
    conn = rx.connection_made()
    head, view = encode_data(600, 0, 0, 64, payload_pattern(600, 8, 32), checksum=True)  # CRC fine, wrong bytes
    ev = rx.data_received(conn, head + bytes(view) + data(601, 0, 32, 32, checksum=False), 0.0)
    r = results(ev)
    assert r[600].reason == "DATA at offset 0 length 32 does not match the pattern"
    assert r[601].reason == "DATA at offset 0 has no checksum in verify mode"
    ok = data(602, 0, 32, 32, checksum=True) + encode_end(602, 1, 32)
    assert results(rx.data_received(conn, ok, 0.0))[602].ok


def test_crc_mismatch_breaks_the_connection() -> None:
    rx = Reassembler()
    conn = rx.connection_made("A")
    frame = bytearray(data(7, 0, 64, 64, checksum=True))
    frame[-1] ^= 0xFF
    events = rx.data_received(conn, bytes(frame), 0.0)
    assert isinstance(events[0], CloseConnection) and "crc32 mismatch" in events[0].reason
    assert not results(events)[7].ok


def test_clean_close_at_a_frame_boundary_fails_nothing() -> None:
    rx = Reassembler()
    a, b = rx.connection_made(), rx.connection_made()
    rx.data_received(a, data(1, 0, 20, 10), 0.0)
    assert rx.connection_lost(a, 1.0) == []
    assert results(rx.data_received(b, data(1, 10, 20, 10) + encode_end(1, 1, 20), 2.0))[1].ok


def test_connection_error_fails_its_transfers_with_the_error() -> None:
    rx = Reassembler()
    a, b = rx.connection_made("A"), rx.connection_made("B")
    rx.data_received(a, data(1, 0, 20, 10), 0.0)
    rx.data_received(b, data(2, 0, 20, 10), 0.0)
    events = rx.connection_lost(a, 1.0, "ConnectionResetError(104)")
    assert events[0] == ConnectionLost(a, "connection from A lost: ConnectionResetError(104)")
    assert list(results(events)) == [1] and rx.carried(b) == [2]


def test_expected_results_are_claimed_others_kept_and_handed_out_once() -> None:
    rx = Reassembler()
    conn = rx.connection_made()
    assert rx.expect(1) is None
    (ev,) = rx.data_received(conn, data(1, 0, 5, 5) + encode_end(1, 1, 5), 0.0)
    assert isinstance(ev, TransferCompleted) and ev.claimed
    (ev,) = rx.data_received(conn, data(2, 0, 5, 5) + encode_end(2, 1, 5), 0.0)
    assert isinstance(ev, TransferCompleted) and not ev.claimed
    kept = rx.expect(2)
    assert kept == ev.result
    assert rx.expect(2) is None  # handed out once; now waits (and nothing more will come)
    assert rx.expect(1) is None  # claimed results are not kept
    rx.keep(kept, 1.0)           # a claimer that went away gives it back
    assert rx.expect(2) == kept


def test_sweep_fails_idle_transfers_and_forgets_old_results() -> None:
    rx = Reassembler(idle_timeout=10.0, result_ttl=100.0)
    conn = rx.connection_made()
    rx.data_received(conn, data(1, 0, 20, 10), 0.0)
    rx.data_received(conn, data(2, 0, 20, 10), 5.0)
    rx.data_received(conn, data(3, 0, 1, 1) + encode_end(3, 1, 1), 5.0)
    assert rx.sweep(10.0) == []
    r = results(rx.sweep(10.5))
    assert list(r) == [1] and r[1].reason == "no frames for 10 s" and r[1].complete == 10.5
    rx.data_received(conn, data(2, 10, 20, 5), 12.0)  # activity keeps 2 alive
    assert rx.sweep(20.0) == []
    assert list(results(rx.sweep(22.5))) == [2]
    # Stragglers of a finished transfer are dropped while its tombstone lasts...
    assert rx.data_received(conn, data(1, 10, 20, 10), 50.0) == [] and rx.active == 0
    rx.sweep(105.5)              # 3's result (kept at 5.0) is forgotten; 1's and 2's are younger
    assert rx.expect(3) is None
    stored = rx.expect(1)
    assert stored is not None and not stored.ok
    rx.sweep(200.0)
    # ...and after it, the same id is a new transfer.
    assert results(rx.data_received(conn, data(1, 0, 10, 10) + encode_end(1, 1, 10), 201.0))[1].ok


def test_close_fails_transfers_and_waiting_expectations() -> None:
    rx = Reassembler()
    conn = rx.connection_made()
    rx.expect(1)
    rx.expect(2)
    rx.data_received(conn, data(1, 0, 20, 10), 0.0)
    events = rx.close(3.0)
    r = results(events)
    assert sorted(r) == [1, 2] and all(not x.ok and x.reason == "receiver closed" for x in r.values())
    assert all(isinstance(e, TransferFailed) and e.claimed for e in events)
    assert r[1].bytes == 10 and rx.transfers_failed == 1  # an expectation alone is no transfer
    assert rx.connection_lost(conn, 4.0, "ConnectionAbortedError()") == []


def test_sender_machine_striped_over_connections_reassembles_in_any_interleaving() -> None:
    """Both machines wired by a deterministic fake network: each connection delivers its bytes
    in order but in random pieces, and connections progress at random relative speeds."""
    rng = random.Random(11)
    tx, rx = SendPath(chunk_bytes=1000), Reassembler(verify=True)
    enc = DataEncoder(1000, checksum=True)
    conns = {tx.connection_opened(): rx.connection_made(f"c{i}") for i in range(3)}
    pipes: dict[int, bytearray] = {c: bytearray() for c in conns}
    plans = {tid: [rng.randrange(0, 5000) for _ in range(4)] for tid in range(10, 16)}
    transfers = {tid: tx.start(tid, sum(sizes), len(sizes)) for tid, sizes in plans.items()}
    for tid, sizes in plans.items():
        for layer, n in enumerate(sizes):
            tx.send_layer(transfers[tid], layer, n)
    ready = [e.transfer for t in transfers.values() for e in tx.finish(t)]
    done: dict[int, TransferResult] = {}
    for _ in range(100_000):
        if len(done) == len(plans):
            break
        conn = rng.choice(list(conns))
        if rng.random() < 0.5:
            chunk = tx.take()
            if chunk is not None:
                assert tx.begin_write(conn, chunk, 0.0)
                head, view = enc.encode(chunk)
                pipes[conn] += head + bytes(view)
                ready += [e.transfer for e in tx.chunk_written(conn)]
            elif ready:
                t = ready.pop()
                end = tx.begin_end(t, 0.0)
                assert end is not None
                pipes[conn] += end
                tx.end_written(t)
        pipe = pipes[conn]
        n = rng.randrange(0, len(pipe) + 1)
        piece = bytes(pipe[:n])
        del pipe[:n]
        done.update(results(rx.data_received(conns[conn], piece, 1.0)))
    else:
        pytest.fail(f"only {sorted(done)} of {sorted(plans)} completed")
    assert all(r.ok and r.bytes == sum(plans[tid]) and r.layers_done == 4 for tid, r in done.items())
    assert max(r.connections for r in done.values()) == 3
    assert rx.bytes_received == tx.stats.bytes_sent == sum(map(sum, plans.values()))
    assert tx.stats.transfers_sent == len(plans) and all(not p for p in pipes.values())
