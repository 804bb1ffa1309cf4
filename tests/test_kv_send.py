"""Sender state machine of the KV transfer layer: chunking, striping, END, the receiver's answers,
acknowledgments, resume after losses and its budget, aborts."""

from __future__ import annotations

import pytest

from testbed.core.kv.frames import (
    HEADER_SIZE,
    FrameDecoder,
    FrameType,
    encode_abort,
    encode_ack,
    encode_data,
    encode_end,
    payload_pattern,
)
from testbed.core.kv.kv_send import (
    TERMINAL,
    TRANSITIONS,
    Chunk,
    CloseConnection,
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
    TransferDelivered,
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


def ack_all(path: SendPath, conn: ConnId, now: float = 0.0) -> list[SendEvent]:
    return path.data_received(conn, encode_ack(path.written_bytes(conn)), now)


def send_end(path: SendPath, t: OutgoingTransfer, conn: ConnId, now: float = 0.0) -> bytes:
    end = path.begin_end(t, conn, now)
    assert end is not None
    return end


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
    assert path.written_bytes(c1) == 3 * (HEADER_SIZE + 10) and path.unacked(c1) == 3


def test_end_only_after_finish_and_every_chunk_written_done_when_the_receiver_answers() -> None:
    path = SendPath(chunk_bytes=10)
    conn = path.connection_opened()
    t = path.start(7, 25, 2)
    path.send_layer(t, 0, 15)
    path.send_layer(t, 1, 10)
    _, ev = write(path, conn)
    assert ev == []
    assert (path.finish(t), t.phase) == ([], Phase.DRAINING)
    with pytest.raises(RuntimeError, match="END before every chunk"):
        path.begin_end(t, conn, 0.0)
    assert write(path, conn)[1] == []
    _, ev = write(path, conn)
    assert (ev, t.phase) == ([ReadyForEnd(t)], Phase.ENDING)
    end = send_end(path, t, conn, 5.0)
    (frame,) = FrameDecoder().feed(end)
    h = frame.header
    assert (h.type, h.transfer_id, h.layer, h.total) == (FrameType.END, 7, 2, 25)
    assert t.phase is Phase.SENT and not t.done and t.end_at == 5.0
    # The ACK alone does not complete it; the receiver's END (ahead of that ACK) does.
    assert path.data_received(conn, encode_end(7, 2, 25), 6.0) == [TransferDelivered(t)]
    assert ack_all(path, conn, 6.0) == []
    assert t.phase is Phase.DELIVERED and t.done and t.written == 25 and t.acked == 25 and t.first_send == 0.0
    assert path.transfer(7) is None and path.carried(conn) == [] and path.unacked(conn) == 0
    assert path.stats == SendStats(bytes_sent=25, backlog_bytes=0, transfers_sent=1, transfers_failed=0)


def test_finish_of_a_drained_or_empty_transfer_is_ready_at_once() -> None:
    path = SendPath(chunk_bytes=10)
    conn = path.connection_opened()
    t = path.start(1, 0, 3)
    for layer in range(3):
        path.send_layer(t, layer, 0)
    assert path.finish(t) == [ReadyForEnd(t)]
    send_end(path, t, conn, 9.0)
    assert t.first_send == 9.0  # END is the first thing sent


def test_acks_are_cumulative_per_connection_and_checked() -> None:
    path = SendPath(chunk_bytes=10)
    c0, c1 = path.connection_opened(), path.connection_opened()
    t = path.start(1, 40, 1)
    path.send_layer(t, 0, 40)
    for conn in (c0, c0, c1, c1):
        write(path, conn)
    frame = HEADER_SIZE + 10
    assert path.data_received(c0, encode_ack(frame), 1.0) == []
    assert (t.acked, path.unacked(c0), path.unacked(c1)) == (10, 1, 2)
    assert path.data_received(c0, encode_ack(frame + 5), 1.0) == []  # inside a frame: covers nothing more
    assert path.data_received(c0, encode_ack(frame + 5), 1.0) == []  # a repeat is harmless
    assert t.acked == 10
    assert ack_all(path, c1, 2.0) == [] and t.acked == 30
    # An ACK for more than was written, or going backwards, breaks the connection.
    events = path.data_received(c0, encode_ack(10 * frame), 3.0)
    assert isinstance(events[0], CloseConnection) and "acknowledged 580 bytes" in events[0].reason
    assert not path.alive(c0)
    assert path.take() is not None  # its unacknowledged chunk was requeued


def test_connection_loss_requeues_only_the_unacknowledged_chunks_of_the_transfers_it_carried() -> None:
    path = SendPath(chunk_bytes=10)
    c0, c1 = path.connection_opened(), path.connection_opened()
    a, b, c = path.start(1, 40, 1), path.start(2, 20, 1), path.start(3, 10, 1)
    path.send_layer(a, 0, 40)
    write(path, c0)  # a@0 on c0, acknowledged below
    write(path, c0)  # a@10 on c0, written, never acknowledged
    path.data_received(c0, encode_ack(HEADER_SIZE + 10), 0.5)
    path.send_layer(b, 0, 20)
    chunk = path.take()  # a@20, in flight on c0 when it is lost
    assert chunk is not None and chunk.transfer is a and path.begin_write(c0, chunk, 0.0)
    write(path, c1)  # a@30 on c1
    write(path, c1)  # b on c1
    events = path.connection_lost(c0, "reset by peer", 1.0)
    assert events == []  # nothing fails: a resumes
    assert a.phase is Phase.OPEN and a.resumes == 1 and a.stalled_since == 1.0 and a.last_error == "reset by peer"
    assert not path.alive(c0) and path.connections == [c1]
    # a@10 and a@20 go back to the front of the queue, ahead of b's second chunk.
    assert path.queued_chunks == 3 and path.stats.backlog_bytes == 30 and a.outstanding == 2
    assert path.stats.bytes_resent == 20 and path.stats.resumes == 1
    # The chunk that was in flight is settled by the loss: its late write completes nothing.
    assert path.chunk_written(c0) == [] and path.stats.bytes_sent == 40
    assert path.connection_lost(c0, "again") == []
    resent = [write(path, c1)[0] for _ in range(3)]
    assert [(x.transfer.transfer_id, x.offset) for x in resent] == [(1, 10), (1, 20), (2, 10)]
    # An ACK of the resent chunks is progress: the stall is over.
    ack_all(path, c1, 2.0)
    assert a.stalled_since is None and a.acked == 40 and b.acked == 20
    # b (carried by c1 only) and c (not yet written anywhere) are unaffected.
    path.send_layer(c, 0, 10)
    write(path, c1)
    assert path.take() is None
    assert path.finish(a) == [ReadyForEnd(a)] and path.finish(b) == [ReadyForEnd(b)]
    assert path.stats.transfers_failed == 0 and path.stats.backlog_bytes == 0


def test_a_lost_end_is_sent_again_and_an_end_on_a_live_connection_is_kept() -> None:
    path = SendPath(chunk_bytes=10)
    c0, c1 = path.connection_opened(), path.connection_opened()
    t = path.start(1, 20, 1)
    path.send_layer(t, 0, 20)
    write(path, c1)
    write(path, c1)
    ack_all(path, c1)
    assert path.finish(t) == [ReadyForEnd(t)]
    send_end(path, t, c0, 1.0)
    assert path.connection_lost(c0, "reset", 2.0) == [ReadyForEnd(t)]
    assert t.phase is Phase.ENDING and t.end_conn is None
    send_end(path, t, c1, 3.0)
    assert t.ends == 2 and t.end_at == 3.0
    # A loss elsewhere with nothing of t unacknowledged leaves it waiting for the answer.
    c2 = path.connection_opened()
    assert path.connection_lost(c2, "reset", 4.0) == [] and t.phase is Phase.SENT
    assert path.data_received(c1, encode_end(1, 1, 20), 5.0) == [TransferDelivered(t)]


def test_loss_after_end_with_chunks_unacknowledged_drains_again_then_ends_again() -> None:
    path = SendPath(chunk_bytes=10)
    c0, c1 = path.connection_opened(), path.connection_opened()
    t = path.start(1, 20, 1)
    path.send_layer(t, 0, 20)
    write(path, c0)
    write(path, c1)
    path.finish(t)
    send_end(path, t, c1)
    assert path.connection_lost(c0, "reset", 1.0) == [] and t.phase is Phase.DRAINING
    _, ev = write(path, c1)
    assert ev == [ReadyForEnd(t)] and t.phase is Phase.ENDING
    send_end(path, t, c1)
    assert t.ends == 2


def test_losses_that_interrupt_progress_beyond_the_budget_fail_with_the_reason() -> None:
    path = SendPath(chunk_bytes=10, max_resumes=2)
    t = path.start(1, 30, 1)
    path.send_layer(t, 0, 30)
    # Losses while stalled anyway (no ACK since the last one) do not count: the deadline bounds them.
    for i in range(5):
        conn = path.connection_opened()
        write(path, conn)
        assert path.connection_lost(conn, f"reset {i}", float(i)) == []
    assert t.resumes == 1 and t.stalled_since == 0.0
    for i in range(2):
        conn = path.connection_opened()
        write(path, conn)
        ack_all(path, conn, 10.0 + i)  # progress...
        write(path, conn)
        events = path.connection_lost(conn, f"flap {i}", 10.5 + i)  # ...interrupted
    (ev,) = events
    assert isinstance(ev, SendFailed) and ev.reason == "flap 1 (progress interrupted 3 times: giving up)"
    assert t.failed == ev.reason and path.stats.transfers_failed == 1
    (abort,) = FrameDecoder().feed(ev.abort)
    assert abort.header.type == FrameType.ABORT and abort.payload == ev.reason.encode()


def test_sweep_gives_up_on_silent_connections_and_on_transfers_that_do_not_resume() -> None:
    path = SendPath(chunk_bytes=10, ack_timeout=5.0, resume_timeout=20.0)
    c0 = path.connection_opened()
    t = path.start(1, 20, 1)
    path.send_layer(t, 0, 20)
    write(path, c0, 0.0)
    idle = path.connection_opened()  # nothing unacknowledged: never timed out
    assert path.sweep(5.0) == []
    assert path.sweep(5.5) == [CloseConnection(c0, "no acknowledgment for 5 s")]
    assert not path.alive(c0) and path.alive(idle) and t.stalled_since == 5.5
    # The writer cannot open a connection: the chunk waits at the front, the stall goes on.
    # Every transfer waits on the destination, so each is stalled from then (u from 10).
    u = path.start(2, 10, 1)
    path.send_layer(u, 0, 10)
    chunk = path.take()
    assert chunk is not None and path.unsent(chunk, "connect refused", 10.0) == []
    assert path.queued_chunks == 3 and t.stalled_since == 5.5 and t.last_error == "connect refused"
    assert u.stalled_since == 10.0
    assert path.sweep(25.5) == []
    (ev,) = path.sweep(25.6)
    assert isinstance(ev, SendFailed) and ev.reason == "connect refused (not resumed within 20 s)"
    (ev,) = path.sweep(30.1)
    assert isinstance(ev, SendFailed) and ev.transfer is u
    assert path.take() is None and path.stats.backlog_bytes == 0  # their chunks are dropped


def test_the_receivers_abort_fails_the_transfer_without_an_abort_back() -> None:
    path = SendPath(chunk_bytes=10)
    conn = path.connection_opened()
    t = path.start(5, 10, 1)
    path.send_layer(t, 0, 10)
    write(path, conn)
    (ev,) = path.data_received(conn, encode_abort(5, "connection from A carries 256 open transfers"), 1.0)
    assert isinstance(ev, SendFailed) and ev.abort == b""
    assert ev.reason == "receiver failed it: connection from A carries 256 open transfers"
    # Answers for transfers it does not know (done, or never sent) are ignored.
    assert path.data_received(conn, encode_end(5, 1, 10) + encode_abort(77, "x"), 2.0) == []


def test_a_receiver_that_acknowledges_everything_without_completing_fails_the_transfer() -> None:
    path = SendPath(chunk_bytes=10)
    c0, c1 = path.connection_opened(), path.connection_opened()
    t = path.start(1, 20, 1)
    path.send_layer(t, 0, 20)
    write(path, c0)
    write(path, c1)
    path.finish(t)
    send_end(path, t, c0)
    assert ack_all(path, c0) == []  # END consumed, a chunk still unacknowledged on c1
    (ev,) = ack_all(path, c1)
    assert isinstance(ev, SendFailed) and "did not complete" in ev.reason


def test_frames_a_receiver_never_sends_break_the_connection() -> None:
    path = SendPath(chunk_bytes=10)
    conn = path.connection_opened()
    head, view = encode_data(1, 0, 0, 4, b"abcd", False)
    events = path.data_received(conn, head + bytes(view), 0.0)
    assert events == [CloseConnection(conn, "unexpected DATA frame from the receiver")]
    other = path.connection_opened()
    (ev,) = path.data_received(other, b"\x00" * HEADER_SIZE, 0.0)
    assert isinstance(ev, CloseConnection) and "bad magic" in ev.reason


def test_loss_of_a_connection_with_nothing_unfinished_fails_nothing() -> None:
    path = SendPath(chunk_bytes=10)
    conn = path.connection_opened()
    t = path.start(1, 10, 1)
    path.send_layer(t, 0, 10)
    write(path, conn)
    path.finish(t)
    send_end(path, t, conn)
    path.data_received(conn, encode_end(1, 1, 10), 0.0)
    assert path.connection_lost(conn, "closed") == [] and t.phase is Phase.DELIVERED
    assert path.stats.bytes_resent == 0


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
    assert not path.begin_write(conn, taken, 0.0)  # failed while the writer was connecting
    assert path.send_layer(t, 1, 20) == 0 and t.queued == 50
    nxt = path.take()
    assert nxt is not None and nxt.transfer is other  # t's queued chunks are skipped
    assert path.stats.backlog_bytes == 10 and t.outstanding == 0
    assert path.finish(t) == [] and t.phase is Phase.FAILED  # the driver reports the failure
    assert path.stats.transfers_failed == 1


def test_unsent_chunk_of_a_settled_transfer_is_dropped() -> None:
    path = SendPath(chunk_bytes=10)
    t = path.start(1, 10, 1)
    path.send_layer(t, 0, 10)
    chunk = path.take()
    assert chunk is not None
    path.fail(t, "prefill died")
    assert path.unsent(chunk, "connect refused") == []
    assert path.stats.backlog_bytes == 0 and t.outstanding == 0 and path.queued_chunks == 0


def test_fail_during_end_and_after_delivery() -> None:
    path = SendPath(chunk_bytes=10)
    conn = path.connection_opened()
    t = path.start(1, 0, 1)
    path.finish(t)
    assert [type(e) for e in path.fail(t, "END write failed")] == [SendFailed]
    assert path.begin_end(t, conn, 0.0) is None
    u = path.start(1, 0, 1)  # the id is free again once the first one failed
    path.finish(u)
    send_end(path, u, conn)
    path.data_received(conn, encode_end(1, 1, 0), 0.0)
    assert path.fail(u, "late") == [] and u.phase is Phase.DELIVERED


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
    with pytest.raises(ValueError, match="resume_timeout"):
        SendPath(10, resume_timeout=0)


def test_transition_table() -> None:
    assert all(src not in TERMINAL for src, _ in TRANSITIONS)
    for phase in Phase:
        assert ((phase, Step.FAIL) in TRANSITIONS) == (phase not in TERMINAL)
    t = OutgoingTransfer(1, 0, 1)
    seen = [t.phase]
    for step in (
        Step.FINISH,
        Step.DRAINED,
        Step.END_WRITTEN,
        Step.RESUME,
        Step.DRAINED,
        Step.END_WRITTEN,
        Step.END_LOST,
        Step.END_WRITTEN,
        Step.CONFIRMED,
    ):
        t.phase = TRANSITIONS[(t.phase, step)]
        seen.append(t.phase)
    P = Phase
    assert seen == [P.OPEN, P.DRAINING, P.ENDING, P.SENT, P.DRAINING, P.ENDING, P.SENT, P.ENDING, P.SENT, P.DELIVERED]
    assert (P.OPEN, Step.CONFIRMED) not in TRANSITIONS  # no answer before an END went out


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
