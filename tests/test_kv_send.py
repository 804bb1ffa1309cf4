"""Sender state machine of the KV transfer layer: chunking, striping, END, losses, aborts."""

from __future__ import annotations

import pytest

from testbed.core.frames import FrameDecoder, FrameType, payload_pattern
from testbed.core.kv_send import (
    TERMINAL,
    TRANSITIONS,
    Chunk,
    ConnId,
    DataEncoder,
    OutgoingTransfer,
    Phase,
    ReadyForEnd,
    SendEvent,
    SendFailed,
    SendPath,
    SendStats,
    Step,
    TransferSent,
)

pytestmark = pytest.mark.pure


def write(path: SendPath, conn: ConnId, now: float = 0.0) -> tuple[Chunk, list[SendEvent]]:
    """Take the next chunk and write it whole on `conn`."""
    chunk = path.take()
    assert chunk is not None
    assert path.begin_write(conn, chunk, now)
    return chunk, path.chunk_written(conn)


def spans(chunks: list[Chunk]) -> list[tuple[int, int, int]]:
    return [(c.layer, c.offset, c.length) for c in chunks]


def test_layers_are_cut_into_chunks_of_chunk_bytes() -> None:
    path = SendPath(chunk_bytes=100)
    t = path.start(1, 450, 3)
    assert path.send_layer(t, 0, 250) == 3
    assert path.send_layer(t, 1, 0) == 0
    assert path.send_layer(t, 2, 200) == 2
    assert t.queued == 450 and t.outstanding == 5
    assert path.stats.backlog_bytes == 450 and path.queued_chunks == 5
    taken = [path.take() for _ in range(5)]
    assert path.take() is None
    chunks = [c for c in taken if c is not None]
    # Offsets continue across layers; a layer's last chunk is short, never merged with the next.
    assert spans(chunks) == [(0, 0, 100), (0, 100, 100), (0, 200, 50), (2, 250, 100), (2, 350, 100)]
    assert all(c.transfer is t for c in chunks)


def test_free_connections_steal_chunks_so_transfers_stripe() -> None:
    path = SendPath(chunk_bytes=10)
    a, b = path.start(1, 40, 1), path.start(2, 20, 1)
    path.send_layer(a, 0, 40)
    path.send_layer(b, 0, 20)
    c0, c1, c2 = (path.connection_opened() for _ in range(3))
    # c0 is slow: it takes one chunk and is still writing it while the others take the rest.
    first = path.take()
    assert first is not None and path.begin_write(c0, first, 1.0)
    got: dict[ConnId, list[Chunk]] = {c1: [], c2: []}
    for conn in [c1, c2, c1, c2, c1]:
        chunk, _ = write(path, conn, 2.0)
        got[conn].append(chunk)
    assert path.take() is None
    # FIFO over transfers: a's chunks first, then b's, alternating between the free connections.
    assert [(c.transfer.transfer_id, c.offset) for c in got[c1]] == [(1, 10), (1, 30), (2, 10)]
    assert [(c.transfer.transfer_id, c.offset) for c in got[c2]] == [(1, 20), (2, 0)]
    assert a.conns == {c0, c1, c2} and b.conns == {c1, c2}
    assert a.first_send == 1.0 and b.first_send == 2.0
    assert path.carried(c0) == [1] and path.carried(c2) == [1, 2]
    assert a.outstanding == 1 and a.written == 30 and b.outstanding == 0 and b.written == 20
    assert path.stats.backlog_bytes == 0 and path.stats.bytes_sent == 50


def test_end_only_after_finish_and_every_chunk_written() -> None:
    path = SendPath(chunk_bytes=10)
    conn = path.connection_opened()
    t = path.start(7, 25, 2)
    path.send_layer(t, 0, 15)
    path.send_layer(t, 1, 10)
    _, ev = write(path, conn)
    assert ev == []
    assert (path.finish(t), t.phase) == ([], Phase.DRAINING)
    with pytest.raises(RuntimeError, match="END before every chunk"):
        path.begin_end(t, 0.0)
    assert write(path, conn)[1] == []
    _, ev = write(path, conn)
    assert (ev, t.phase) == ([ReadyForEnd(t)], Phase.ENDING)
    end = path.begin_end(t, 5.0)
    assert end is not None
    (frame,) = FrameDecoder().feed(end)
    h = frame.header
    assert (h.type, h.transfer_id, h.layer, h.total) == (FrameType.END, 7, 2, 25)
    assert path.end_written(t) == [TransferSent(t)]
    assert t.phase is Phase.SENT and t.done and t.written == 25 and t.first_send == 0.0
    assert path.transfer(7) is None and path.carried(conn) == []
    assert path.stats == SendStats(bytes_sent=25, backlog_bytes=0, transfers_sent=1, transfers_failed=0)


def test_finish_of_a_drained_or_empty_transfer_is_ready_at_once() -> None:
    path = SendPath(chunk_bytes=10)
    t = path.start(1, 0, 3)
    for layer in range(3):
        path.send_layer(t, layer, 0)
    assert path.finish(t) == [ReadyForEnd(t)]
    assert path.begin_end(t, 9.0) is not None and t.first_send == 9.0  # END is the first thing sent


def test_connection_loss_fails_only_the_transfers_it_carried() -> None:
    path = SendPath(chunk_bytes=10)
    c0, c1 = path.connection_opened(), path.connection_opened()
    a, b, c = path.start(1, 30, 1), path.start(2, 20, 1), path.start(3, 10, 1)
    path.send_layer(a, 0, 30)
    write(path, c0)            # a on c0
    path.send_layer(b, 0, 20)
    chunk = path.take()        # a's second chunk, in flight on c0 when it is lost
    assert chunk is not None and chunk.transfer is a and path.begin_write(c0, chunk, 0.0)
    write(path, c1)            # a's third chunk on c1
    write(path, c1)            # b on c1
    events = path.connection_lost(c0, "reset by peer")
    assert [type(e) for e in events] == [SendFailed]
    (failed,) = events
    assert isinstance(failed, SendFailed) and failed.transfer is a and failed.reason == "reset by peer"
    (abort,) = FrameDecoder().feed(failed.abort)
    assert abort.header.type == FrameType.ABORT and abort.header.transfer_id == 1
    assert abort.payload == b"reset by peer"
    assert a.phase is Phase.FAILED and a.failed == "reset by peer" and a.outstanding == 0
    assert not path.alive(c0) and path.connections == [c1]
    assert path.carried(c1) == [2]  # a is forgotten everywhere
    # The chunk in flight is settled by the loss: writing it "completes" nothing.
    assert path.chunk_written(c0) == [] and path.stats.bytes_sent == 30
    assert path.connection_lost(c0, "again") == []
    # b (carried by c1 only) and c (not yet written anywhere) are unaffected.
    path.send_layer(c, 0, 10)
    write(path, c1)
    write(path, c1)
    assert path.take() is None
    assert path.finish(b) == [ReadyForEnd(b)] and path.finish(c) == [ReadyForEnd(c)]
    assert path.stats.transfers_failed == 1 and path.stats.backlog_bytes == 0


def test_loss_of_a_connection_with_nothing_unfinished_fails_nothing() -> None:
    path = SendPath(chunk_bytes=10)
    conn = path.connection_opened()
    t = path.start(1, 10, 1)
    path.send_layer(t, 0, 10)
    write(path, conn)
    path.finish(t)
    assert path.begin_end(t, 0.0) is not None
    path.end_written(t)
    assert path.connection_lost(conn, "closed") == [] and t.phase is Phase.SENT


def test_failed_transfer_chunks_are_dropped_and_its_layers_only_counted() -> None:
    path = SendPath(chunk_bytes=10)
    conn = path.connection_opened()
    t, other = path.start(1, 50, 2), path.start(2, 10, 1)
    path.send_layer(t, 0, 30)
    path.send_layer(other, 0, 10)
    taken = path.take()
    assert taken is not None
    (ev,) = path.fail(t, "prefill died")
    assert isinstance(ev, SendFailed) and ev.transfer is t
    assert path.fail(t, "twice") == [] and t.failed == "prefill died"
    assert not path.begin_write(conn, taken, 0.0)   # failed while the writer was connecting
    assert path.send_layer(t, 1, 20) == 0 and t.queued == 50
    nxt = path.take()
    assert nxt is not None and nxt.transfer is other  # t's queued chunks are skipped
    assert path.stats.backlog_bytes == 10 and t.outstanding == 0
    assert path.finish(t) == [] and t.phase is Phase.FAILED  # the driver reports the failure
    assert path.stats.transfers_failed == 1


def test_unsent_chunk_fails_its_transfer() -> None:
    path = SendPath(chunk_bytes=10)
    t = path.start(1, 10, 1)
    path.send_layer(t, 0, 10)
    chunk = path.take()
    assert chunk is not None
    (ev,) = path.unsent(chunk, "connect refused")
    assert isinstance(ev, SendFailed) and ev.reason == "connect refused"
    assert path.stats.backlog_bytes == 0 and t.outstanding == 0


def test_fail_during_end_and_after_sent() -> None:
    path = SendPath(chunk_bytes=10)
    t = path.start(1, 0, 1)
    path.finish(t)
    assert [type(e) for e in path.fail(t, "END write failed")] == [SendFailed]
    assert path.begin_end(t, 0.0) is None and path.end_written(t) == []
    u = path.start(1, 0, 1)  # the id is free again once the first one failed
    path.finish(u)
    path.begin_end(u, 0.0)
    path.end_written(u)
    assert path.fail(u, "late") == [] and u.phase is Phase.SENT


def test_fail_all_fails_every_unfinished_transfer() -> None:
    stats = SendStats()
    p1, p2 = SendPath(10, stats), SendPath(10, stats)
    ts = [p1.start(1, 10, 1), p1.start(2, 10, 1), p2.start(1, 10, 1)]
    for t, p in zip(ts, (p1, p1, p2)):
        p.send_layer(t, 0, 10)
    assert stats.backlog_bytes == 30
    events = p1.fail_all("sender closed")
    assert {e.transfer.transfer_id for e in events if isinstance(e, SendFailed)} == {1, 2}
    assert ts[2].phase is Phase.OPEN
    assert stats.transfers_failed == 2


def test_misuse_is_refused() -> None:
    path = SendPath(chunk_bytes=10)
    t = path.start(1, 20, 2)
    with pytest.raises(ValueError, match="already in flight"):
        path.start(1, 5, 1)
    with pytest.raises(ValueError, match="layer 2 outside 0..1"):
        path.send_layer(t, 2, 1)
    with pytest.raises(ValueError, match="overruns total 20"):
        path.send_layer(t, 0, 21)
    with pytest.raises(ValueError, match="overruns"):
        path.send_layer(t, 0, -1)
    path.send_layer(t, 0, 10)
    with pytest.raises(ValueError, match="after 10 of 20 bytes"):
        path.finish(t)
    path.send_layer(t, 1, 10)
    path.finish(t)
    with pytest.raises(RuntimeError, match="send_layer after finish"):
        path.send_layer(t, 1, 0)
    with pytest.raises(RuntimeError, match="called twice"):
        path.finish(t)
    conn = path.connection_opened()
    chunk = path.take()
    assert chunk is not None and path.begin_write(conn, chunk, 0.0)
    other = path.take()
    assert other is not None
    with pytest.raises(RuntimeError, match="already writing"):
        path.begin_write(conn, other, 0.0)
    with pytest.raises(ValueError, match="not open"):
        path.begin_write(conn + 1, other, 0.0)
    with pytest.raises(ValueError, match="chunk_bytes"):
        SendPath(0)


def test_transition_table() -> None:
    assert all(src not in TERMINAL for src, _ in TRANSITIONS)
    for phase in Phase:
        assert ((phase, Step.FAIL) in TRANSITIONS) == (phase not in TERMINAL)
    t = OutgoingTransfer(1, 0, 1)
    seen = [t.phase]
    for step in (Step.FINISH, Step.DRAINED, Step.END_WRITTEN):
        t.phase = TRANSITIONS[(t.phase, step)]
        seen.append(t.phase)
    assert seen == [Phase.OPEN, Phase.DRAINING, Phase.ENDING, Phase.SENT]


@pytest.mark.parametrize("checksum", [False, True])
def test_data_encoder_frames_decode_to_their_chunks(checksum: bool) -> None:
    path = SendPath(chunk_bytes=64)
    enc = DataEncoder(64, checksum)
    t = path.start(42, 150, 2)
    path.send_layer(t, 0, 100)
    path.send_layer(t, 1, 50)
    stream = bytearray()
    chunks = []
    while (chunk := path.take()) is not None:
        head, view = enc.encode(chunk)
        stream += head + bytes(view)
        chunks.append(chunk)
    frames = FrameDecoder().feed(bytes(stream))
    assert [(f.header.layer, f.header.offset, f.header.length) for f in frames] == spans(chunks)
    for f in frames:
        assert f.header.total == 150 and f.header.transfer_id == 42
        want = payload_pattern(42, f.header.offset, f.header.length) if checksum else bytes(f.header.length)
        assert f.payload == want
