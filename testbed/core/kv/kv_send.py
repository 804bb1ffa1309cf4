"""Sender side of the KV transfer layer as an I/O-free state machine, one per destination.

A `SendPath` holds one destination's unfinished transfers, the chunk queue its connections
share, and what each connection carries. Layers are cut into chunks of `chunk_bytes` as they
are queued; whichever connection is free takes the next chunk (work stealing), so a transfer's
chunks stripe over all connections and a slow one holds back only the chunk it is writing. A
finished transfer sends END once every chunk of it is written, and is done when the receiver
answers END (complete) or ABORT (failed, with its reason).

Resume. The receiver ACKs, per connection, the bytes of whole frames it has consumed; each
connection keeps the chunks (plain descriptors: KV bytes are regenerated from the offset) and
the END written on it until an ACK covers them. When a connection is lost its unacknowledged
chunks go back to the front of the queue, to be written on the remaining connections or a new
one, and an unacknowledged END is sent again; the receiver takes a resent range it already has
as a no-op. Bounded: a transfer fails with the last error once it has been without progress
(no ACK for any of its frames) for `resume_timeout` after a loss or a failed connect, or once
losses have interrupted its progress more than `max_resumes` times (losses while it is stalled
anyway, reconnects into an outage, count against the deadline only). A connection whose oldest
unacknowledged frame has waited `ack_timeout` with no ACK is declared lost (a black-holed path keeps TCP
silent for minutes).

The driver owns the I/O: it opens connections and reports them (`connection_opened`,
`connection_lost`), loops `take` -> `begin_write` -> write the frame -> `chunk_written` on each
connection, writes END from `begin_end`, hands the receiver's bytes to `data_received`, calls
`sweep` now and then, and acts on the events the methods return (write an ABORT, send END,
close a connection, wake a waiter). Frames must be written in the order their `begin_*` calls
were made on a connection: ACKs count stream bytes. Connections are ids; times are passed in.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from itertools import count

from testbed.core.kv.frames import (
    HEADER_SIZE,
    FrameDecoder,
    FrameError,
    FrameType,
    ack_at,
    encode_abort,
    encode_data,
    encode_end,
    payload_pattern,
)

ConnId = int

RESUME_TIMEOUT_S = 30.0
ACK_TIMEOUT_S = 15.0
MAX_RESUMES = 8


class Phase(str, Enum):
    OPEN = "open"  # accepting layers
    DRAINING = "draining"  # finish() called; chunks still queued or being written
    ENDING = "ending"  # every chunk written: END may go out
    SENT = "sent"  # END written; waiting for the receiver's answer
    DELIVERED = "delivered"  # the receiver answered END: complete
    FAILED = "failed"


class Step(str, Enum):
    FINISH = "finish"
    DRAINED = "drained"
    END_WRITTEN = "end_written"
    RESUME = "resume"  # chunks requeued after a loss
    END_LOST = "end_lost"  # the connection that carried END is gone before the answer
    CONFIRMED = "confirmed"
    FAIL = "fail"


P, S = Phase, Step
TRANSITIONS: dict[tuple[Phase, Step], Phase] = {
    (P.OPEN, S.FINISH): P.DRAINING,
    (P.DRAINING, S.DRAINED): P.ENDING,
    (P.ENDING, S.END_WRITTEN): P.SENT,
    (P.OPEN, S.RESUME): P.OPEN,
    (P.DRAINING, S.RESUME): P.DRAINING,
    (P.ENDING, S.RESUME): P.DRAINING,
    (P.SENT, S.RESUME): P.DRAINING,
    (P.SENT, S.END_LOST): P.ENDING,
    (P.DRAINING, S.CONFIRMED): P.DELIVERED,
    (P.ENDING, S.CONFIRMED): P.DELIVERED,
    (P.SENT, S.CONFIRMED): P.DELIVERED,
    (P.OPEN, S.FAIL): P.FAILED,
    (P.DRAINING, S.FAIL): P.FAILED,
    (P.ENDING, S.FAIL): P.FAILED,
    (P.SENT, S.FAIL): P.FAILED,
}
TERMINAL = frozenset({P.DELIVERED, P.FAILED})


@dataclass(eq=False)
class OutgoingTransfer:
    """One transfer's bookkeeping: changed only by its SendPath, read by anyone."""

    transfer_id: int
    total: int
    layers: int
    phase: Phase = Phase.OPEN
    queued: int = 0  # bytes handed to send_layer so far (= next offset)
    written: int = 0  # bytes of its chunks written to a connection, resent ones included
    acked: int = 0  # bytes of its chunks the receiver acknowledged
    outstanding: int = 0  # chunks queued, taken, or being written
    inflight: int = 0  # its chunks and ENDs written and not yet acknowledged
    conns: set[ConnId] = field(default_factory=set)  # connections that carried its frames
    finish_requested: bool = False
    first_send: float | None = None
    end_conn: ConnId | None = None  # where its latest END went, until that connection is lost
    ends: int = 0  # END frames written
    end_at: float | None = None  # when the latest END was written
    resumes: int = 0  # losses that interrupted its progress (see SendPath.connection_lost)
    stalled_since: float | None = None  # without progress since a loss or failed connect
    last_error: str = ""
    failed: str | None = None  # the reason, once failed

    @property
    def done(self) -> bool:
        return self.phase in TERMINAL


@dataclass(frozen=True, slots=True, eq=False)
class Chunk:
    transfer: OutgoingTransfer
    layer: int
    offset: int
    length: int


# -- events


@dataclass(frozen=True, slots=True)
class ReadyForEnd:
    """Every chunk written (again, after a resume): the driver sends END (see `begin_end`)."""

    transfer: OutgoingTransfer


@dataclass(frozen=True, slots=True)
class SendFailed:
    """The transfer failed; `abort` is the ABORT frame to write on any live connection (empty
    when the receiver failed it: it knows)."""

    transfer: OutgoingTransfer
    reason: str
    abort: bytes


@dataclass(frozen=True, slots=True)
class TransferDelivered:
    """The receiver has every byte and the END: complete."""

    transfer: OutgoingTransfer


@dataclass(frozen=True, slots=True)
class CloseConnection:
    """The path gave up on the connection (no ACK in time, or a bad frame from the receiver)
    and has already counted it lost: close it."""

    conn: ConnId
    reason: str


SendEvent = ReadyForEnd | SendFailed | TransferDelivered | CloseConnection


@dataclass
class SendStats:
    """Counters of a sender, shared by all of its paths."""

    bytes_sent: int = 0  # payload bytes of chunks written, resent ones included
    backlog_bytes: int = 0  # queued or taken, not yet handed to a connection
    transfers_sent: int = 0  # confirmed complete by the receiver
    transfers_failed: int = 0
    bytes_resent: int = 0  # payload bytes requeued after a loss
    resumes: int = 0  # connection losses that requeued something


@dataclass(eq=False)
class _Conn:
    carried: set[OutgoingTransfer] = field(default_factory=set)  # unfinished, with frames written here
    writing: Chunk | None = None
    sent: int = 0  # stream bytes written
    acked: int = 0  # stream bytes the receiver acknowledged
    # Frames written and not yet acknowledged, by the stream offset just past them.
    unacked: deque[tuple[int, Chunk | OutgoingTransfer]] = field(default_factory=deque)
    ack_at: float = 0.0  # last ACK progress, or when unacked last became non-empty
    decoder: FrameDecoder = field(default_factory=FrameDecoder)  # the receiver's frames


class SendPath:
    def __init__(
        self,
        chunk_bytes: int,
        stats: SendStats | None = None,
        *,
        resume_timeout: float = RESUME_TIMEOUT_S,
        ack_timeout: float = ACK_TIMEOUT_S,
        max_resumes: int = MAX_RESUMES,
    ) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        if resume_timeout <= 0 or ack_timeout <= 0 or max_resumes < 0:
            raise ValueError(
                f"resume_timeout and ack_timeout must be > 0 and max_resumes >= 0, got "
                f"{resume_timeout}, {ack_timeout}, {max_resumes}"
            )
        self.chunk_bytes = chunk_bytes
        self.stats = stats if stats is not None else SendStats()
        self.resume_timeout = resume_timeout
        self.ack_timeout = ack_timeout
        self.max_resumes = max_resumes
        self._queue: deque[Chunk] = deque()
        self._transfers: dict[int, OutgoingTransfer] = {}  # unfinished, by id
        self._conns: dict[ConnId, _Conn] = {}
        self._stalled: set[OutgoingTransfer] = set()
        self._ids = count()

    # -- connections

    def connection_opened(self) -> ConnId:
        cid = next(self._ids)
        self._conns[cid] = _Conn()
        return cid

    def alive(self, conn: ConnId) -> bool:
        return conn in self._conns

    @property
    def connections(self) -> list[ConnId]:
        return list(self._conns)

    def carried(self, conn: ConnId) -> list[int]:
        """Ids of the unfinished transfers with frames written on `conn`."""
        c = self._conns.get(conn)
        return sorted(t.transfer_id for t in c.carried) if c is not None else []

    def written_bytes(self, conn: ConnId) -> int:
        """Stream bytes written on `conn` so far (what a full ACK says)."""
        c = self._conns.get(conn)
        return c.sent if c is not None else 0

    def acked_bytes(self, conn: ConnId) -> int:
        """Stream bytes of `conn` the receiver has acknowledged (0 for a connection that never
        got through to it)."""
        c = self._conns.get(conn)
        return c.acked if c is not None else 0

    def unacked(self, conn: ConnId) -> int:
        """Frames written on `conn` that no ACK covers yet."""
        c = self._conns.get(conn)
        return len(c.unacked) if c is not None else 0

    def connection_lost(self, conn: ConnId, reason: str, now: float = 0.0) -> list[SendEvent]:
        """Requeue what the connection held unacknowledged (the chunk it was writing included)
        and mark its END lost; the transfers it hit are stalled from now, and one whose progress
        losses have interrupted more than max_resumes times fails. A no-op for a connection
        already lost."""
        c = self._conns.pop(conn, None)
        if c is None:
            return []
        out: list[SendEvent] = []
        hit: dict[OutgoingTransfer, None] = {}  # ordered: events come in a stable order
        requeue: list[Chunk] = []
        writing = c.writing
        for _, item in c.unacked:
            if isinstance(item, Chunk):
                t = item.transfer
                t.inflight -= 1
                if t.done:
                    continue
                requeue.append(item)
                if item is not writing:
                    t.outstanding += 1  # settled when written; owed again
                hit[t] = None
            else:
                item.inflight -= 1
                if not item.done and item.end_conn == conn:
                    item.end_conn = None
                    hit[item] = None
        if writing is not None and writing not in requeue:
            self._settle(writing, out)  # acknowledged before it finished draining, or moot
        if requeue:
            self._queue.extendleft(reversed(requeue))
            n = sum(ch.length for ch in requeue)
            self.stats.backlog_bytes += n
            self.stats.bytes_resent += n
        if hit:
            self.stats.resumes += 1
        for t in hit:
            t.last_error = reason
            if t.stalled_since is None:
                # A loss that interrupted progress counts against max_resumes; losses while it
                # is stalled anyway (reconnects into an outage) are bounded by resume_timeout.
                t.resumes += 1
                if t.resumes > self.max_resumes:
                    self._fail(t, f"{reason} (progress interrupted {t.resumes} times: giving up)", out)
                    continue
                self._stall(t, now)
            self._resume(t, out)
        return out

    def data_received(self, conn: ConnId, data: bytes | bytearray | memoryview, now: float) -> list[SendEvent]:
        """The receiver's frames on `conn`: ACKs, END (complete), ABORT (failed there). Anything
        else breaks the connection (CloseConnection, then counted lost)."""
        c = self._conns.get(conn)
        if c is None:
            return []
        out: list[SendEvent] = []
        bad: str | None = None
        pos = 0
        if not c.decoder.buffered and not c.decoder.dead:
            # Fast path: whole ACKs at a frame boundary (nearly every read a sender makes).
            while (upto := ack_at(data, pos)) is not None:
                pos += HEADER_SIZE
                bad = self._ack(c, upto, now, out)
                if bad is not None:
                    break
            if pos == len(data) or bad is not None:
                if bad is not None:
                    out.append(CloseConnection(conn, bad))
                    out += self.connection_lost(conn, bad, now)
                return out
            if pos:
                data = memoryview(data)[pos:]
        try:
            frames = c.decoder.feed(data)
        except FrameError as e:
            frames, bad = e.frames, f"bad frame from the receiver: {e.reason}"
        for f in frames:
            h = f.header
            if h.type == FrameType.ACK:
                bad = self._ack(c, h.offset, now, out)
            elif h.type == FrameType.END:
                t = self._transfers.get(h.transfer_id)
                if t is not None and t.ends:
                    self._confirm(t, out)
            elif h.type == FrameType.ABORT:
                t = self._transfers.get(h.transfer_id)
                if t is not None:
                    self._fail(t, f"receiver failed it: {f.payload.decode('utf-8', 'replace')}", out, tell=False)
            else:
                bad = f"unexpected {FrameType(h.type).name} frame from the receiver"
            if bad is not None:
                break
        if bad is not None:
            out.append(CloseConnection(conn, bad))
            out += self.connection_lost(conn, bad, now)
        return out

    def sweep(self, now: float) -> list[SendEvent]:
        """Give up on connections with no ACK for ack_timeout and on transfers stalled for
        resume_timeout."""
        out: list[SendEvent] = []
        for cid, c in list(self._conns.items()):
            if c.unacked and now - c.ack_at > self.ack_timeout:
                reason = f"no acknowledgment for {self.ack_timeout:g} s"
                out.append(CloseConnection(cid, reason))
                out += self.connection_lost(cid, reason, now)
        for t in list(self._stalled):
            since = t.stalled_since
            if t.done or since is None:
                self._stalled.discard(t)
            elif now - since > self.resume_timeout:
                self._fail(t, f"{t.last_error} (not resumed within {self.resume_timeout:g} s)", out)
        return out

    # -- transfers

    def start(self, transfer_id: int, total: int, layers: int) -> OutgoingTransfer:
        if transfer_id in self._transfers:
            raise ValueError(f"transfer {transfer_id} is already in flight to this destination")
        t = OutgoingTransfer(transfer_id, total, layers)
        self._transfers[transfer_id] = t
        return t

    def transfer(self, transfer_id: int) -> OutgoingTransfer | None:
        """The unfinished transfer of that id, if any."""
        return self._transfers.get(transfer_id)

    def send_layer(self, t: OutgoingTransfer, layer: int, nbytes: int) -> int:
        """Queue one layer's bytes as chunks; returns how many were queued (0 once failed)."""
        tid = t.transfer_id
        if t.finish_requested:
            raise RuntimeError(f"transfer {tid}: send_layer after finish()")
        if not 0 <= layer < t.layers:
            raise ValueError(f"transfer {tid}: layer {layer} outside 0..{t.layers - 1}")
        if nbytes < 0 or t.queued + nbytes > t.total:
            raise ValueError(
                f"transfer {tid}: layer {layer} of {nbytes} bytes overruns total {t.total} ({t.queued} already queued)"
            )
        start, end = t.queued, t.queued + nbytes
        t.queued = end
        if t.failed is not None or nbytes == 0:
            return 0  # finish() reports the failure
        step = self.chunk_bytes
        put = self._queue.append
        n = 0
        for off in range(start, end, step):
            put(Chunk(t, layer, off, min(step, end - off)))
            n += 1
        t.outstanding += n
        self.stats.backlog_bytes += nbytes
        return n

    def finish(self, t: OutgoingTransfer) -> list[SendEvent]:
        """No more layers. ReadyForEnd comes now or from the last `chunk_written`; a failed
        transfer stays failed (the driver reports it)."""
        if t.finish_requested and t.phase is not Phase.FAILED:
            raise RuntimeError(f"transfer {t.transfer_id}: finish() called twice")
        if t.queued != t.total:
            raise ValueError(f"transfer {t.transfer_id}: finish() after {t.queued} of {t.total} bytes")
        t.finish_requested = True
        if t.phase is Phase.FAILED:
            return []
        _advance(t, Step.FINISH)
        out: list[SendEvent] = []
        if t.outstanding == 0:
            _advance(t, Step.DRAINED)
            out.append(ReadyForEnd(t))
        return out

    def fail(self, t: OutgoingTransfer, reason: str) -> list[SendEvent]:
        out: list[SendEvent] = []
        self._fail(t, reason, out)
        return out

    def fail_all(self, reason: str) -> list[SendEvent]:
        out: list[SendEvent] = []
        for t in list(self._transfers.values()):
            self._fail(t, reason, out)
        return out

    def stalled(self, t: OutgoingTransfer, reason: str, now: float) -> None:
        """The driver could not get the transfer's END out (no connection would open): it
        retries, and the unfinished transfers fail if that lasts resume_timeout."""
        if not t.done:
            self._unreachable(reason, now)

    # -- writing

    @property
    def queued_chunks(self) -> int:
        """Chunks waiting to be taken (some may belong to transfers settled since)."""
        return len(self._queue)

    def take(self) -> Chunk | None:
        """The next chunk for whichever connection is free; chunks of settled transfers are
        dropped on the way. The caller either writes it (`begin_write`) or gives it back
        (`unsent`)."""
        q = self._queue
        while q:
            chunk = q.popleft()
            t = chunk.transfer
            if t.phase not in TERMINAL:
                return chunk
            self.stats.backlog_bytes -= chunk.length
            t.outstanding -= 1
        return None

    def unsent(self, chunk: Chunk, reason: str, now: float = 0.0) -> list[SendEvent]:
        """A taken chunk cannot be written now (the connection would not open): it goes back to
        the front of the queue, and every unfinished transfer is stalled until something of it
        is acknowledged."""
        t = chunk.transfer
        if t.done:
            self.stats.backlog_bytes -= chunk.length
            t.outstanding -= 1
            return []
        self._queue.appendleft(chunk)
        self._unreachable(reason, now)
        return []

    def begin_write(self, conn: ConnId, chunk: Chunk, now: float) -> bool:
        """The taken chunk goes out on `conn` now; False (chunk dropped) if its transfer was
        settled since it was taken. One chunk per connection at a time."""
        c = self._conns.get(conn)
        if c is None:
            raise ValueError(f"connection {conn} is not open")
        if c.writing is not None:
            raise RuntimeError(f"connection {conn} is already writing a chunk")
        self.stats.backlog_bytes -= chunk.length
        t = chunk.transfer
        if t.phase in TERMINAL:
            t.outstanding -= 1
            return False
        c.writing = chunk
        c.carried.add(t)
        t.conns.add(conn)
        if not c.unacked:
            c.ack_at = now
        c.sent += HEADER_SIZE + chunk.length
        c.unacked.append((c.sent, chunk))
        t.inflight += 1
        if t.first_send is None:
            t.first_send = now
        return True

    def chunk_written(self, conn: ConnId) -> list[SendEvent]:
        """The chunk being written on `conn` is fully handed over (a no-op once the connection
        was lost: the loss settled it)."""
        c = self._conns.get(conn)
        if c is None or c.writing is None:
            return []
        chunk, c.writing = c.writing, None
        self.stats.bytes_sent += chunk.length
        chunk.transfer.written += chunk.length
        out: list[SendEvent] = []
        self._settle(chunk, out)
        return out

    def begin_end(self, t: OutgoingTransfer, conn: ConnId, now: float) -> bytes | None:
        """The END frame to write on `conn` now (the transfer is SENT from here), or None if the
        transfer is settled."""
        if t.done:
            return None
        if t.phase is not Phase.ENDING:
            raise RuntimeError(f"transfer {t.transfer_id}: END before every chunk was written ({t.phase.value})")
        c = self._conns.get(conn)
        if c is None:
            raise ValueError(f"connection {conn} is not open")
        frame = encode_end(t.transfer_id, t.layers, t.total)
        if not c.unacked:
            c.ack_at = now
        c.sent += len(frame)
        c.unacked.append((c.sent, t))
        c.carried.add(t)
        t.conns.add(conn)
        t.inflight += 1
        t.end_conn = conn
        t.ends += 1
        t.end_at = now
        if t.first_send is None:
            t.first_send = now
        _advance(t, Step.END_WRITTEN)
        return frame

    def frame_written(self, conn: ConnId, nbytes: int) -> None:
        """The driver wrote another frame (an ABORT) of nbytes on `conn`: ACKs count it."""
        c = self._conns.get(conn)
        if c is not None:
            c.sent += nbytes

    # -- internals

    def _ack(self, c: _Conn, upto: int, now: float, out: list[SendEvent]) -> str | None:
        if not c.acked <= upto <= c.sent:
            return f"receiver acknowledged {upto} bytes; {c.acked} acknowledged before, {c.sent} written"
        c.acked = upto
        q = c.unacked
        if not q or q[0][0] > upto:
            return None
        c.ack_at = now
        while q and q[0][0] <= upto:
            item = q.popleft()[1]
            if isinstance(item, Chunk):
                t = item.transfer
                t.acked += item.length
            else:
                t = item
            t.inflight -= 1
            if t.phase in TERMINAL:
                continue
            if t.stalled_since is not None:
                t.stalled_since = None
                self._stalled.discard(t)
            if t.inflight == 0 and t.phase is Phase.SENT:
                # The receiver answers END before the ACK that covers the last of its frames, so
                # it has consumed every frame without completing it (it lost state: restarted).
                self._fail(t, "receiver acknowledged every frame but did not complete the transfer", out)
        return None

    def _confirm(self, t: OutgoingTransfer, out: list[SendEvent]) -> None:
        if t.done:
            return
        _advance(t, Step.CONFIRMED)
        self._forget(t)
        self.stats.transfers_sent += 1
        out.append(TransferDelivered(t))

    def _unreachable(self, reason: str, now: float) -> None:
        """No connection to the destination would open: every unfinished transfer waits on it,
        not only the one whose chunk was next, so they all fail together if it lasts."""
        for t in self._transfers.values():
            t.last_error = reason
            self._stall(t, now)

    def _stall(self, t: OutgoingTransfer, now: float) -> None:
        if t.stalled_since is None:
            t.stalled_since = now
            self._stalled.add(t)

    def _resume(self, t: OutgoingTransfer, out: list[SendEvent]) -> None:
        """After a loss: chunks owed again take the transfer back to DRAINING; a lost END with
        nothing owed means END again."""
        if not t.finish_requested or t.done:
            return
        if t.outstanding:
            if t.phase is not Phase.DRAINING:
                _advance(t, Step.RESUME)
        elif t.end_conn is None and t.phase is Phase.SENT:
            _advance(t, Step.END_LOST)
            out.append(ReadyForEnd(t))

    def _settle(self, chunk: Chunk, out: list[SendEvent]) -> None:
        t = chunk.transfer
        t.outstanding -= 1
        if t.outstanding == 0 and t.phase is Phase.DRAINING:
            _advance(t, Step.DRAINED)
            out.append(ReadyForEnd(t))

    def _fail(self, t: OutgoingTransfer, reason: str, out: list[SendEvent], tell: bool = True) -> None:
        if t.done:
            return
        _advance(t, Step.FAIL)
        t.failed = reason
        self._forget(t)
        self.stats.transfers_failed += 1
        out.append(SendFailed(t, reason, encode_abort(t.transfer_id, reason) if tell else b""))

    def _forget(self, t: OutgoingTransfer) -> None:
        for cid in t.conns:
            c = self._conns.get(cid)
            if c is not None:
                c.carried.discard(t)
        self._stalled.discard(t)
        if self._transfers.get(t.transfer_id) is t:
            del self._transfers[t.transfer_id]


def _advance(t: OutgoingTransfer, step: Step) -> None:
    nxt = TRANSITIONS.get((t.phase, step))
    if nxt is None:
        raise RuntimeError(f"transfer {t.transfer_id}: {step.value} not allowed when {t.phase.value}")
    t.phase = nxt


class DataEncoder:
    """DATA frames of chunks. KV bytes are dummies: zeros, or `payload_pattern` with CRC-32
    when checksumming."""

    def __init__(self, chunk_bytes: int, checksum: bool) -> None:
        self.checksum = checksum
        self._zeros = memoryview(bytes(chunk_bytes))

    def encode(self, chunk: Chunk) -> tuple[bytes, memoryview]:
        t, n = chunk.transfer, chunk.length
        if self.checksum:
            payload: bytes | memoryview = payload_pattern(t.transfer_id, chunk.offset, n)
        else:
            payload = self._zeros[:n]
        return encode_data(t.transfer_id, chunk.layer, chunk.offset, t.total, payload, self.checksum)
