"""Receiver side of the KV transfer layer as an I/O-free state machine.

A `Reassembler` takes the bytes (or decoded frames) of any number of connections, each just an
id, and reassembles transfers whose byte ranges arrive once each, in any order, over any
connection. A transfer completes when every byte of its `total` has arrived and its END was
seen. A duplicate or overlapping range, a total that disagrees, a payload that is not the
expected pattern (when verifying) or an ABORT fails it. A malformed frame breaks only its
connection and fails only the transfers that connection carried; a connection closed at a frame
boundary fails nothing, since every frame sent on it arrived.

Results go to whoever `expect`ed the transfer (the event says `claimed`), else are kept for
`result_ttl`; late frames of a finished transfer are dropped for as long. `sweep(now)` fails
transfers idle for `idle_timeout`. Times are whatever clock the driver passes as `now`.

Per-connection limits (a deadline on a partial frame checked by `sweep`, a cap on connections)
would break a connection with `CloseConnection`, as a bad frame does.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import count

from testbed.core.frames import FLAG_CHECKSUM, Frame, FrameDecoder, FrameError, FrameType, payload_pattern

ConnId = int


@dataclass(frozen=True, slots=True)
class TransferResult:
    """Outcome of one received transfer, times in the driver's clock. `layers_done` is the
    layer count announced by END when ok, else the number of distinct layers that delivered
    data; `connections` counts the distinct connections that carried its DATA frames."""

    transfer_id: int
    ok: bool
    bytes: int
    first_byte: float
    complete: float
    reason: str
    layers_done: int
    connections: int


# -- events


@dataclass(frozen=True, slots=True)
class TransferCompleted:
    result: TransferResult
    claimed: bool   # an expect() waits for it; else the result is kept for a later expect()


@dataclass(frozen=True, slots=True)
class TransferFailed:
    result: TransferResult
    claimed: bool


@dataclass(frozen=True, slots=True)
class CloseConnection:
    """The connection is unusable (the transfers it carried have been failed): close it."""

    conn: ConnId
    peer: str
    reason: str


@dataclass(frozen=True, slots=True)
class ConnectionLost:
    """The connection went away mid-frame or with an error; the transfers it carried failed."""

    conn: ConnId
    reason: str


ReceiveEvent = TransferCompleted | TransferFailed | CloseConnection | ConnectionLost


@dataclass(eq=False)
class IncomingTransfer:
    """One transfer being reassembled: changed only by its Reassembler, read by anyone."""

    transfer_id: int
    total: int
    first_byte: float
    last_activity: float
    received: int = 0
    end_seen: bool = False
    layers: int = 0                  # announced by END
    # Received byte ranges, merged and sorted: duplicates and overlaps are caught exactly.
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    conns: set[ConnId] = field(default_factory=set)       # carried any frame: their failure fails us
    data_conns: set[ConnId] = field(default_factory=set)  # carried accepted DATA
    layers_seen: set[int] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return self.end_seen and self.received == self.total

    def add_range(self, off: int, n: int) -> bool:
        """Record [off, off+n); False if it overlaps bytes already received."""
        if n == 0:
            return True
        starts, ends = self.starts, self.ends
        end = off + n
        i = bisect_right(starts, off)
        if i > 0 and ends[i - 1] > off:
            return False
        if i < len(starts) and starts[i] < end:
            return False
        join_prev = i > 0 and ends[i - 1] == off
        join_next = i < len(starts) and starts[i] == end
        if join_prev and join_next:
            ends[i - 1] = ends[i]
            del starts[i], ends[i]
        elif join_prev:
            ends[i - 1] = end
        elif join_next:
            starts[i] = off
        else:
            starts.insert(i, off)
            ends.insert(i, end)
        return True

    def result(self, ok: bool, reason: str, now: float) -> TransferResult:
        return TransferResult(
            self.transfer_id, ok, self.received, self.first_byte, now, reason,
            self.layers if ok else len(self.layers_seen), len(self.data_conns),
        )


@dataclass(eq=False)
class _Conn:
    peer: str
    decoder: FrameDecoder = field(default_factory=FrameDecoder)
    carried: set[IncomingTransfer] = field(default_factory=set)  # unfinished, with a frame from here
    broken: bool = False


class Reassembler:
    def __init__(self, verify: bool = False, idle_timeout: float = 60.0, result_ttl: float = 120.0) -> None:
        self.verify = verify
        self.idle_timeout = idle_timeout
        self.result_ttl = result_ttl
        self.bytes_received = 0
        self.transfers_completed = 0
        self.transfers_failed = 0
        self._conns: dict[ConnId, _Conn] = {}
        self._ids = count()
        self._transfers: dict[int, IncomingTransfer] = {}
        self._expected: set[int] = set()
        self._results: dict[int, tuple[TransferResult, float]] = {}  # unclaimed, insertion-ordered
        self._finished: dict[int, float] = {}  # tombstones: late frames of these are dropped
        self._closing = False

    # -- connections

    def connection_made(self, peer: str = "?") -> ConnId:
        cid = next(self._ids)
        self._conns[cid] = _Conn(peer)
        return cid

    @property
    def connections(self) -> list[ConnId]:
        return list(self._conns)

    def carried(self, conn: ConnId) -> list[int]:
        """Ids of the unfinished transfers that had a frame on `conn`."""
        c = self._conns.get(conn)
        return sorted(t.transfer_id for t in c.carried) if c is not None else []

    def data_received(self, conn: ConnId, data: bytes | bytearray | memoryview, now: float) -> list[ReceiveEvent]:
        """Bytes of the connection's stream, split anyhow."""
        c = self._conns[conn]
        out: list[ReceiveEvent] = []
        if c.broken:
            return out
        try:
            frames = c.decoder.feed(data)
        except FrameError as e:
            for f in e.frames:
                self._on_frame(conn, c, f, now, out)
            self._frame_error(conn, c, e, now, out)
            return out
        for f in frames:
            self._on_frame(conn, c, f, now, out)
        return out

    def frame_received(self, conn: ConnId, frame: Frame, now: float) -> list[ReceiveEvent]:
        """One decoded frame (for drivers that model frames rather than bytes)."""
        c = self._conns[conn]
        out: list[ReceiveEvent] = []
        if not c.broken:
            self._on_frame(conn, c, frame, now, out)
        return out

    def connection_lost(self, conn: ConnId, now: float, error: str | None = None) -> list[ReceiveEvent]:
        """The connection is gone; `error` describes why if it did not close cleanly."""
        c = self._conns.pop(conn, None)
        out: list[ReceiveEvent] = []
        if c is None or c.broken or self._closing:
            return out
        c.broken = True
        if error is None and c.decoder.buffered == 0:
            # Closed at a frame boundary: its transfers can still complete over other connections.
            c.carried.clear()
            return out
        reason = f"connection from {c.peer} lost" + (f": {error}" if error is not None else " mid-frame")
        out.append(ConnectionLost(conn, reason))
        pending = c.decoder.pending_header
        if pending is not None:
            self._fail_id(pending.transfer_id, reason, now, out)
        for t in list(c.carried):
            self._finish(t, False, reason, now, out)
        return out

    # -- results

    def expect(self, transfer_id: int) -> TransferResult | None:
        """The transfer's result if it is already kept (handed out once); else None, and its
        result will come as a claimed event."""
        stored = self._results.pop(transfer_id, None)
        if stored is not None:
            return stored[0]
        self._expected.add(transfer_id)
        return None

    def keep(self, result: TransferResult, now: float) -> None:
        """Keep a claimed result after all (its claimer went away) for a later expect()."""
        self._results[result.transfer_id] = (result, now)

    def transfer(self, transfer_id: int) -> IncomingTransfer | None:
        return self._transfers.get(transfer_id)

    @property
    def active(self) -> int:
        return len(self._transfers)

    def sweep(self, now: float) -> list[ReceiveEvent]:
        """Fail transfers idle for longer than idle_timeout; forget results and tombstones older
        than result_ttl."""
        out: list[ReceiveEvent] = []
        for t in [t for t in self._transfers.values() if now - t.last_activity > self.idle_timeout]:
            self._finish(t, False, f"no frames for {self.idle_timeout:g} s", now, out)
        # Both maps are insertion-ordered by finish time: stop at the first young entry.
        while self._results:
            tid, (_, stamp) = next(iter(self._results.items()))
            if now - stamp <= self.result_ttl:
                break
            del self._results[tid]
        while self._finished:
            tid, stamp = next(iter(self._finished.items()))
            if now - stamp <= self.result_ttl:
                break
            del self._finished[tid]
        return out

    def close(self, now: float) -> list[ReceiveEvent]:
        """Fail every unfinished transfer and every expectation still waiting; later losses of
        connections are not failures."""
        self._closing = True
        out: list[ReceiveEvent] = []
        for t in list(self._transfers.values()):
            self._finish(t, False, "receiver closed", now, out)
        for tid in sorted(self._expected):
            out.append(TransferFailed(TransferResult(tid, False, 0, 0.0, now, "receiver closed", 0, 0), True))
        self._expected.clear()
        return out

    # -- internals

    def _on_frame(self, conn: ConnId, c: _Conn, f: Frame, now: float, out: list[ReceiveEvent]) -> None:
        h = f.header
        tid = h.transfer_id
        if tid in self._finished:
            return  # a finished transfer's stragglers
        t = self._transfers.get(tid)
        if t is None:
            t = self._transfers[tid] = IncomingTransfer(tid, h.total, now, now)
        else:
            t.last_activity = now
        if h.type == FrameType.DATA:
            self.bytes_received += h.length
            t.conns.add(conn)
            c.carried.add(t)
            if h.total != t.total:
                self._finish(t, False, f"DATA at offset {h.offset} says total {h.total}, expected {t.total}", now, out)
                return
            if not t.add_range(h.offset, h.length):
                self._finish(t, False, f"duplicate or overlapping DATA at offset {h.offset} length {h.length}", now, out)
                return
            if self.verify:
                if not h.flags & FLAG_CHECKSUM:
                    self._finish(t, False, f"DATA at offset {h.offset} has no checksum in verify mode", now, out)
                    return
                if f.payload != payload_pattern(tid, h.offset, h.length):
                    self._finish(
                        t, False, f"DATA at offset {h.offset} length {h.length} does not match the pattern", now, out
                    )
                    return
            t.received += h.length
            t.data_conns.add(conn)
            t.layers_seen.add(h.layer)
            if t.complete:
                self._finish(t, True, "", now, out)
        elif h.type == FrameType.END:
            t.conns.add(conn)
            c.carried.add(t)
            if h.total != t.total:
                self._finish(t, False, f"END says total {h.total}, data said {t.total}", now, out)
                return
            t.end_seen = True
            t.layers = h.layer
            if t.complete:
                self._finish(t, True, "", now, out)
        else:
            reason = f.payload.decode("utf-8", "replace")
            self._finish(t, False, f"aborted by sender: {reason}", now, out)

    def _finish(self, t: IncomingTransfer, ok: bool, reason: str, now: float, out: list[ReceiveEvent]) -> None:
        tid = t.transfer_id
        del self._transfers[tid]
        for cid in t.conns:
            c = self._conns.get(cid)
            if c is not None:
                c.carried.discard(t)
        if ok:
            self.transfers_completed += 1
        else:
            self.transfers_failed += 1
        result = t.result(ok, reason, now)
        self._finished[tid] = now
        claimed = tid in self._expected
        if claimed:
            self._expected.discard(tid)
        else:
            self._results[tid] = (result, now)
        out.append(TransferCompleted(result, claimed) if ok else TransferFailed(result, claimed))

    def _fail_id(self, tid: int, reason: str, now: float, out: list[ReceiveEvent]) -> None:
        """Fail a transfer by id, even one we never saw a good frame of."""
        if tid in self._finished:
            return
        t = self._transfers.get(tid)
        if t is None:
            t = self._transfers[tid] = IncomingTransfer(tid, 0, now, now)
        self._finish(t, False, reason, now, out)

    def _frame_error(self, conn: ConnId, c: _Conn, e: FrameError, now: float, out: list[ReceiveEvent]) -> None:
        c.broken = True
        out.append(CloseConnection(conn, c.peer, e.reason))
        reason = f"bad frame from {c.peer}: {e.reason}"
        if e.transfer_id is not None:
            self._fail_id(e.transfer_id, reason, now, out)
        for t in list(c.carried):
            self._finish(t, False, reason, now, out)
