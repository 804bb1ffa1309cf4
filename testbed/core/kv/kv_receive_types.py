"""What the KV receiver's state machine (`testbed.core.kv.kv_receive`) returns and keeps: transfer
results and the events it hands its driver, each transfer's received byte ranges, and each
connection's record (its peer, its decoder, the transfers it holds)."""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field

from testbed.core.kv.frames import FrameDecoder

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
    claimed: bool  # an expect() waits for it; else the result is kept for a later expect()


@dataclass(frozen=True, slots=True)
class TransferFailed:
    result: TransferResult
    claimed: bool


@dataclass(frozen=True, slots=True)
class CloseConnection:
    """The connection is unusable (a bad frame, or a frame not finished in time): close it."""

    conn: ConnId
    peer: str
    reason: str


@dataclass(frozen=True, slots=True)
class ConnectionLost:
    """The connection went away mid-frame or with an error (for the log: nothing failed)."""

    conn: ConnId
    reason: str


@dataclass(frozen=True, slots=True)
class Send:
    """Frames for the sender at the other end of `conn` (ACK, END, ABORT), to write as they are."""

    conn: ConnId
    data: bytes


ReceiveEvent = TransferCompleted | TransferFailed | CloseConnection | ConnectionLost | Send


@dataclass(eq=False, slots=True)
class IncomingTransfer:
    """One transfer being reassembled: changed only by its Reassembler, read by anyone."""

    transfer_id: int
    total: int
    first_byte: float
    last_activity: float
    received: int = 0  # distinct bytes
    duplicate_bytes: int = 0  # resent bytes that had already arrived
    end_seen: bool = False
    layers: int = 0  # announced by END
    # Received byte ranges, merged and sorted: duplicates and overlaps are caught exactly.
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    conns: set[ConnId] = field(default_factory=set)  # carried any frame
    data_conns: set[ConnId] = field(default_factory=set)  # carried accepted DATA
    layers_seen: set[int] = field(default_factory=set)
    owner: ConnState | None = None  # the connection it counts against; None: gone (an orphan of `host`)
    host: str = ""  # the peer it counts against

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

    def covered(self, off: int, n: int) -> bool:
        """Every byte of [off, off+n) has been received already."""
        i = bisect_right(self.starts, off)
        return i > 0 and self.ends[i - 1] >= off + n

    def result(self, ok: bool, reason: str, now: float) -> TransferResult:
        return TransferResult(
            self.transfer_id,
            ok,
            self.received,
            self.first_byte,
            now,
            reason,
            self.layers if ok else len(self.layers_seen),
            len(self.data_conns),
        )


def peer_host(peer: str) -> str:
    """The address of a peer label `host:port` (the label itself without a port)."""
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


@dataclass(eq=False, slots=True)
class ConnState:
    peer: str
    decoder: FrameDecoder
    full: str  # the reason a transfer beyond its cap fails
    host: str = ""
    peer_full: str = ""  # the reason a transfer beyond its peer's cap fails
    # Open transfers that count against this connection, least recently active first.
    owned: OrderedDict[int, IncomingTransfer] = field(default_factory=OrderedDict)
    carried: set[IncomingTransfer] = field(default_factory=set)  # unfinished, with a frame from here
    broken: bool = False
    fed: int = 0  # bytes of the stream so far
    frame_since: float | None = None  # when the partial frame being received began
    replies: list[bytes] = field(default_factory=list)  # to go out with this read's ACK
