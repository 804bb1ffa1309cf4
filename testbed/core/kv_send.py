"""Sender side of the KV transfer layer as an I/O-free state machine, one per destination.

A `SendPath` holds one destination's unfinished transfers, the chunk queue its connections
share, and what each connection carries. Layers are cut into chunks of `chunk_bytes` as they
are queued; whichever connection is free takes the next chunk (work stealing), so a transfer's
chunks stripe over all connections and a slow one holds back only the chunk it is writing. A
finished transfer may send END once every chunk of it is written. A lost connection fails the
unfinished transfers it carried (their bytes may have gone with it) and nothing else.

The driver owns the I/O: it opens connections and reports them (`connection_opened`,
`connection_lost`), loops `take` -> `begin_write` -> write the frame -> `chunk_written` on each
connection, and acts on the events the methods return (write an ABORT, send END, wake a
waiter). Connections are ids; times are passed in.

Later extensions have a place to go: a connection limit in `connection_opened`, requeueing
unacknowledged chunks instead of failing in `connection_lost` (resume from an acknowledged
chunk), since chunks are plain descriptors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from itertools import count

from testbed.core.frames import encode_abort, encode_data, encode_end, payload_pattern

ConnId = int


class Phase(str, Enum):
    OPEN = "open"            # accepting layers
    DRAINING = "draining"    # finish() called; chunks still queued or being written
    ENDING = "ending"        # every chunk written: END may go out
    SENT = "sent"            # END written
    FAILED = "failed"


class Step(str, Enum):
    FINISH = "finish"
    DRAINED = "drained"
    END_WRITTEN = "end_written"
    FAIL = "fail"


P, S = Phase, Step
TRANSITIONS: dict[tuple[Phase, Step], Phase] = {
    (P.OPEN, S.FINISH): P.DRAINING,
    (P.DRAINING, S.DRAINED): P.ENDING,
    (P.ENDING, S.END_WRITTEN): P.SENT,
    (P.OPEN, S.FAIL): P.FAILED,
    (P.DRAINING, S.FAIL): P.FAILED,
    (P.ENDING, S.FAIL): P.FAILED,
}
TERMINAL = frozenset({P.SENT, P.FAILED})


@dataclass(eq=False)
class OutgoingTransfer:
    """One transfer's bookkeeping: changed only by its SendPath, read by anyone."""

    transfer_id: int
    total: int
    layers: int
    phase: Phase = Phase.OPEN
    queued: int = 0              # bytes handed to send_layer so far (= next offset)
    written: int = 0             # bytes of its chunks written to a connection
    outstanding: int = 0         # chunks queued, taken, or being written
    conns: set[ConnId] = field(default_factory=set)  # connections that carried its chunks
    finish_requested: bool = False
    first_send: float | None = None
    failed: str | None = None    # the reason, once failed

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
    """Finished and every chunk written: the driver may send END (see `begin_end`)."""

    transfer: OutgoingTransfer


@dataclass(frozen=True, slots=True)
class SendFailed:
    """The transfer failed; `abort` is the ABORT frame to write on any live connection."""

    transfer: OutgoingTransfer
    reason: str
    abort: bytes


@dataclass(frozen=True, slots=True)
class TransferSent:
    transfer: OutgoingTransfer


SendEvent = ReadyForEnd | SendFailed | TransferSent


@dataclass
class SendStats:
    """Counters of a sender, shared by all of its paths."""

    bytes_sent: int = 0          # payload bytes of chunks written
    backlog_bytes: int = 0       # queued or taken, not yet handed to a connection
    transfers_sent: int = 0
    transfers_failed: int = 0


@dataclass(eq=False)
class _Conn:
    carried: set[OutgoingTransfer] = field(default_factory=set)  # unfinished, with chunks written here
    writing: Chunk | None = None


class SendPath:
    def __init__(self, chunk_bytes: int, stats: SendStats | None = None) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.stats = stats if stats is not None else SendStats()
        self._queue: deque[Chunk] = deque()
        self._transfers: dict[int, OutgoingTransfer] = {}  # unfinished, by id
        self._conns: dict[ConnId, _Conn] = {}
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
        """Ids of the unfinished transfers with chunks written on `conn`."""
        c = self._conns.get(conn)
        return sorted(t.transfer_id for t in c.carried) if c is not None else []

    def connection_lost(self, conn: ConnId, reason: str) -> list[SendEvent]:
        """Fail every unfinished transfer the connection carried, the chunk it was writing
        included; a no-op for a connection already lost."""
        c = self._conns.pop(conn, None)
        if c is None:
            return []
        out: list[SendEvent] = []
        for t in list(c.carried):
            self._fail(t, reason, out)
        if c.writing is not None:
            self._settle(c.writing, out)
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
                f"transfer {tid}: layer {layer} of {nbytes} bytes overruns total {t.total}"
                f" ({t.queued} already queued)"
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

    # -- writing

    @property
    def queued_chunks(self) -> int:
        """Chunks waiting to be taken (some may belong to transfers failed since)."""
        return len(self._queue)

    def take(self) -> Chunk | None:
        """The next chunk for whichever connection is free; chunks of failed transfers are
        dropped on the way. The caller either writes it (`begin_write`) or gives it up
        (`unsent`)."""
        q = self._queue
        while q:
            chunk = q.popleft()
            t = chunk.transfer
            if t.failed is None:
                return chunk
            self.stats.backlog_bytes -= chunk.length
            t.outstanding -= 1
        return None

    def unsent(self, chunk: Chunk, reason: str) -> list[SendEvent]:
        """A taken chunk cannot be written (e.g. the connection would not open): its transfer fails."""
        self.stats.backlog_bytes -= chunk.length
        out: list[SendEvent] = []
        self._fail(chunk.transfer, reason, out)
        self._settle(chunk, out)
        return out

    def begin_write(self, conn: ConnId, chunk: Chunk, now: float) -> bool:
        """The taken chunk goes out on `conn` now; False (chunk dropped) if its transfer failed
        since it was taken. One chunk per connection at a time."""
        c = self._conns.get(conn)
        if c is None:
            raise ValueError(f"connection {conn} is not open")
        if c.writing is not None:
            raise RuntimeError(f"connection {conn} is already writing a chunk")
        self.stats.backlog_bytes -= chunk.length
        t = chunk.transfer
        if t.failed is not None:
            t.outstanding -= 1
            return False
        c.writing = chunk
        c.carried.add(t)
        t.conns.add(conn)
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

    def begin_end(self, t: OutgoingTransfer, now: float) -> bytes | None:
        """The END frame to write now, or None if the transfer has failed."""
        if t.failed is not None:
            return None
        if t.phase is not Phase.ENDING:
            raise RuntimeError(f"transfer {t.transfer_id}: END before every chunk was written ({t.phase.value})")
        if t.first_send is None:
            t.first_send = now
        return encode_end(t.transfer_id, t.layers, t.total)

    def end_written(self, t: OutgoingTransfer) -> list[SendEvent]:
        if t.phase is Phase.FAILED:
            return []
        _advance(t, Step.END_WRITTEN)
        self._forget(t)
        self.stats.transfers_sent += 1
        return [TransferSent(t)]

    # -- internals

    def _settle(self, chunk: Chunk, out: list[SendEvent]) -> None:
        t = chunk.transfer
        t.outstanding -= 1
        if t.outstanding == 0 and t.phase is Phase.DRAINING:
            _advance(t, Step.DRAINED)
            out.append(ReadyForEnd(t))

    def _fail(self, t: OutgoingTransfer, reason: str, out: list[SendEvent]) -> None:
        if t.done:
            return
        _advance(t, Step.FAIL)
        t.failed = reason
        self._forget(t)
        self.stats.transfers_failed += 1
        out.append(SendFailed(t, reason, encode_abort(t.transfer_id, reason)))

    def _forget(self, t: OutgoingTransfer) -> None:
        for cid in t.conns:
            c = self._conns.get(cid)
            if c is not None:
                c.carried.discard(t)
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
