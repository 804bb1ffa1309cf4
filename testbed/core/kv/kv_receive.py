"""Receiver side of the KV transfer layer as an I/O-free state machine.

A `Reassembler` takes the bytes (or decoded frames) of any number of connections, each just an
id, and reassembles transfers whose byte ranges arrive in any order, over any connection. A
transfer completes when every byte of its `total` has arrived and its END was seen. A range
that partly overlaps bytes already received, a total that disagrees, a payload that is not the
expected pattern (when verifying) or an ABORT fails it. A range wholly inside bytes already
received is a resent chunk (the sender resumes what it has no ACK for) and is accepted as a
no-op, checked against the pattern when verifying.

Talking back (`Send` events, written on the same connection): after every read that completed
frames, one ACK with the bytes of whole frames consumed from that connection so far; END when a
transfer completes; ABORT with the reason when the receiver fails a transfer the sender did not
abort. A sender keeps every chunk until an ACK covers it, so a lost connection costs only what
was in flight on it.

Connections come and go without failing anything: a connection closed or reset, even
mid-frame, drops its partial frame and leaves the transfers it carried to be resumed on another
one (or failed by `idle_timeout`). A malformed frame breaks its connection (`CloseConnection`)
and fails the transfers that connection carried, and only those: a bad header naming a transfer
carried elsewhere does not touch it.

Limits, all constructor arguments: `max_connections` (a connection beyond it is refused:
`connection_made` returns None); `frame_timeout` (a connection that began a frame must finish it
within that many seconds or `sweep` breaks it, freeing what it held); `max_transfers` open in
total, `max_transfers_per_peer` (a remote address) and `max_transfers_per_connection` (a new
transfer beyond one fails at once with the reason, answered with ABORT, unless a place can be
taken back fairly, below); `max_results` unclaimed results and `max_tombstones` finished ids
kept (oldest forgotten first), so ids nobody expects cost a bounded amount; `max_fragments`
separate byte ranges held by one transfer (see `fragment_cap`: a DATA frame past it is a protocol
error, which breaks its connection and fails the transfers it carried).

Fair share. Each open transfer belongs to a peer (the address of the connection whose frame opened
it, or last carried it after its own connection went away). When the table is full, a new
transfer takes the place of one held by the peer holding the most, if that peer holds more than
one place more than the newcomer's; within a peer (and when the peer's own limit is reached),
from a transfer whose connection is gone, else from the connection holding the most, if it holds
more than one more than the newcomer's. The one taken is that holder's longest silent, failed
with the reason and answered with ABORT. So a client that opens thousands of transfers and goes
silent, on any number of connections, cannot keep a sender that needs a few from its places:
every request it would have failed ("receiver has 4096 transfers open") goes through.

Results go to whoever `expect`ed the transfer (the event says `claimed`), else are kept for
`result_ttl`; late frames of a finished transfer are dropped for as long (a late END is answered
with the outcome again). `sweep(now)` fails transfers idle for `idle_timeout`. Times are whatever
clock the driver passes as `now`.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count

from testbed.core.kv.frames import (
    FLAG_CHECKSUM,
    MAX_LAYERS,
    Frame,
    FrameDecoder,
    FrameError,
    FrameType,
    encode_abort,
    encode_ack,
    encode_end,
    payload_pattern,
)
from testbed.core.kv.kv_receive_types import (
    CloseConnection,
    ConnectionLost,
    ConnId,
    ConnState,
    IncomingTransfer,
    ReceiveEvent,
    Send,
    TransferCompleted,
    TransferFailed,
    TransferResult,
    peer_host,
)

# Defaults: far above what a deployment needs (tens of senders x a few connections, a few
# transfers in flight per sender), low enough that a hostile peer's cost stays bounded.
MAX_CONNECTIONS = 1024
FRAME_TIMEOUT_S = 30.0  # a 256 KiB chunk at 70 kbit/s; a 16 MiB one needs >= 4.5 Mbit/s
MAX_TRANSFERS = 4096
MAX_TRANSFERS_PER_PEER = 1024
MAX_TRANSFERS_PER_CONNECTION = 256
MAX_RESULTS = 4096
MAX_TOMBSTONES = 16384
# Separate byte ranges one transfer may hold while it is reassembled (each costs ~80 bytes: 400k
# one-byte DATA frames with gaps between them held 30 MB). A sender's ranges are at most its
# chunks, and a scenario's chunks are >= MIN_FRAGMENT_BYTES but for each layer's last one: so a
# transfer of `total` bytes gets MAX_LAYERS + total / MIN_FRAGMENT_BYTES, and never more than
# MAX_FRAGMENTS (1.3 MB; at the default 256 KiB chunks that is 4 GiB arrived out of order).
MIN_FRAGMENT_BYTES = 1024
MAX_FRAGMENTS = 16384


def fragment_cap(total: int, ceiling: int = MAX_FRAGMENTS) -> int:
    """The separate byte ranges a transfer of `total` bytes may hold (see MAX_FRAGMENTS)."""
    return min(ceiling, MAX_LAYERS + -(-total // MIN_FRAGMENT_BYTES))


class Reassembler:
    def __init__(
        self,
        verify: bool = False,
        idle_timeout: float = 60.0,
        result_ttl: float = 120.0,
        *,
        frame_timeout: float = FRAME_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        max_transfers: int = MAX_TRANSFERS,
        max_transfers_per_connection: int = MAX_TRANSFERS_PER_CONNECTION,
        max_results: int = MAX_RESULTS,
        max_tombstones: int = MAX_TOMBSTONES,
        max_fragments: int = MAX_FRAGMENTS,
        max_transfers_per_peer: int = MAX_TRANSFERS_PER_PEER,
    ) -> None:
        for name, v in (
            ("max_connections", max_connections),
            ("max_transfers", max_transfers),
            ("max_transfers_per_peer", max_transfers_per_peer),
            ("max_transfers_per_connection", max_transfers_per_connection),
            ("max_results", max_results),
            ("max_tombstones", max_tombstones),
            ("max_fragments", max_fragments),
        ):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if frame_timeout <= 0:
            raise ValueError(f"frame_timeout must be > 0, got {frame_timeout}")
        self.verify = verify
        self.idle_timeout = idle_timeout
        self.result_ttl = result_ttl
        self.frame_timeout = frame_timeout
        self.max_connections = max_connections
        self.max_transfers = max_transfers
        self.max_transfers_per_connection = max_transfers_per_connection
        self.max_transfers_per_peer = max_transfers_per_peer
        self.max_results = max_results
        self.max_tombstones = max_tombstones
        self.max_fragments = max_fragments
        self.stream_bytes = 0  # every byte read from every connection
        self.bytes_received = 0  # DATA payload bytes, resent ones included
        self.duplicate_bytes = 0
        self.transfers_completed = 0
        self.transfers_failed = 0
        self.transfers_refused = 0  # failed at once by a limit (counted in transfers_failed too)
        self.connections_refused = 0
        self.transfers_evicted = 0  # places taken back for a fairer holder (counted in transfers_failed too)
        self._conns: dict[ConnId, ConnState] = {}
        # Per peer: open transfers counted against it, its connections, its transfers whose
        # connection is gone (least recently active first).
        self._peer_open: dict[str, int] = {}
        self._peer_conns: dict[str, set[ConnState]] = {}
        self._orphans: dict[str, OrderedDict[int, IncomingTransfer]] = {}
        self._ids = count()
        self._transfers: dict[int, IncomingTransfer] = {}
        self._expected: set[int] = set()
        # OrderedDicts: dropping the oldest entry is O(1) (a dict's first live entry is found by
        # scanning past deleted ones, quadratic when it is trimmed from the front).
        self._results: OrderedDict[int, tuple[TransferResult, float]] = OrderedDict()  # unclaimed
        # Tombstones: late frames of these are dropped; the reason (None when ok) answers a late END.
        self._finished: OrderedDict[int, tuple[float, str | None]] = OrderedDict()
        self._closing = False
        self._full = f"receiver has {max_transfers} transfers open (limit {max_transfers})"

    # -- connections

    def connection_made(self, peer: str = "?") -> ConnId | None:
        """A new connection's id, or None if the receiver already has max_connections (the
        driver closes it)."""
        if len(self._conns) >= self.max_connections:
            self.connections_refused += 1
            return None
        cid = next(self._ids)
        cap, host, pcap = self.max_transfers_per_connection, peer_host(peer), self.max_transfers_per_peer
        c = self._conns[cid] = ConnState(
            peer,
            FrameDecoder(keep_data=self.verify),
            f"connection from {peer} carries {cap} open transfers (limit {cap})",
            host,
            f"peer {host} has {pcap} transfers open (limit {pcap})",
        )
        self._peer_conns.setdefault(c.host, set()).add(c)
        return cid

    @property
    def connections(self) -> list[ConnId]:
        return list(self._conns)

    @property
    def held_bytes(self) -> int:
        """Bytes of partial frames held over all connections."""
        return sum(c.decoder.held for c in self._conns.values())

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
        dec = c.decoder
        n = len(data)
        self.stream_bytes += n
        try:
            frames = dec.feed(data)
        except FrameError as e:
            for f in e.frames:
                self._on_frame(conn, c, f, now, out)
            self._frame_error(conn, c, e, now, out)
            return out
        c.fed += n
        if frames:
            for f in frames:
                self._on_frame(conn, c, f, now, out)
            if c.broken:  # a frame only a sender may send
                return out
            c.frame_since = now if dec.buffered else None
            replies = c.replies
            replies.append(encode_ack(c.fed - dec.buffered))
            out.append(Send(conn, replies[0] if len(replies) == 1 else b"".join(replies)))
            replies.clear()
        elif c.frame_since is None and dec.buffered:
            c.frame_since = now
        return out

    def frame_received(self, conn: ConnId, frame: Frame, now: float) -> list[ReceiveEvent]:
        """One decoded frame (for drivers that model frames rather than bytes); replies come as
        a Send without an ACK."""
        c = self._conns[conn]
        out: list[ReceiveEvent] = []
        if not c.broken:
            self._on_frame(conn, c, frame, now, out)
            if c.replies:
                out.append(Send(conn, b"".join(c.replies)))
                c.replies.clear()
        return out

    def connection_lost(self, conn: ConnId, now: float, error: str | None = None) -> list[ReceiveEvent]:
        """The connection is gone; `error` describes why if it did not close cleanly. Nothing
        fails: its transfers may resume on another connection."""
        c = self._conns.pop(conn, None)
        out: list[ReceiveEvent] = []
        if c is not None:
            self._disown(c)
        if c is None or c.broken or self._closing:
            return out
        c.broken = True
        mid_frame = c.decoder.buffered > 0
        c.carried.clear()
        if error is not None or mid_frame:
            reason = f"connection from {c.peer} lost" + (f": {error}" if error is not None else " mid-frame")
            out.append(ConnectionLost(conn, reason))
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
        self._keep(result.transfer_id, result, now)

    def transfer(self, transfer_id: int) -> IncomingTransfer | None:
        return self._transfers.get(transfer_id)

    @property
    def active(self) -> int:
        return len(self._transfers)

    @property
    def kept(self) -> tuple[int, int]:
        """(unclaimed results, tombstones) held now."""
        return len(self._results), len(self._finished)

    def sweep(self, now: float) -> list[ReceiveEvent]:
        """Break connections stuck inside a frame for longer than frame_timeout; fail transfers
        idle for longer than idle_timeout; forget results and tombstones older than result_ttl."""
        out: list[ReceiveEvent] = []
        for cid, c in self._conns.items():
            if c.broken or c.frame_since is None or now - c.frame_since <= self.frame_timeout:
                continue
            c.broken = True
            out.append(
                CloseConnection(
                    cid,
                    c.peer,
                    f"frame not completed within {self.frame_timeout:g} s ({c.decoder.buffered} bytes of it received)",
                )
            )
            c.decoder = FrameDecoder(
                keep_data=False
            )  # what it held is freed now, not when the driver gets round to closing
            c.carried.clear()  # left to resume elsewhere, as after a reset
        for t in [t for t in self._transfers.values() if now - t.last_activity > self.idle_timeout]:
            self._finish(t, False, f"no frames for {self.idle_timeout:g} s", now, out)
        # Both maps are insertion-ordered by finish time: stop at the first young entry.
        while self._results:
            tid, (_, stamp) = next(iter(self._results.items()))
            if now - stamp <= self.result_ttl:
                break
            self._results.popitem(last=False)
        while self._finished:
            tid, (stamp, _) = next(iter(self._finished.items()))
            if now - stamp <= self.result_ttl:
                break
            self._finished.popitem(last=False)
        return out

    def close(self, now: float) -> list[ReceiveEvent]:
        """Fail every unfinished transfer and every expectation still waiting; later losses of
        connections are not failures."""
        self._closing = True
        out: list[ReceiveEvent] = []
        for t in list(self._transfers.values()):
            self._finish(t, False, "receiver closed", now, out, notify=False)
        for tid in sorted(self._expected):
            out.append(TransferFailed(TransferResult(tid, False, 0, 0.0, now, "receiver closed", 0, 0), True))
        self._expected.clear()
        return out

    # -- internals

    def _on_frame(self, conn: ConnId, c: ConnState, f: Frame, now: float, out: list[ReceiveEvent]) -> None:
        if c.broken:
            return
        h = f.header
        tid = h.transfer_id
        ftype = h.type
        if ftype == FrameType.ACK:
            self._frame_error(conn, c, FrameError("ACK from a sender"), now, out)
            return
        tomb = self._finished.get(tid)
        if tomb is not None:
            # A finished transfer's stragglers (or a resume after its outcome was lost with its
            # connection): a late END is answered with the outcome again.
            if ftype == FrameType.END:
                reason = tomb[1]
                c.replies.append(encode_end(tid, h.layer, h.total) if reason is None else encode_abort(tid, reason))
            return
        t = self._transfers.get(tid)
        if t is None:
            # An ABORT of a transfer never seen takes no place from anyone: it would be over at once.
            refusal = self._over_limit(c, now, out, evict=ftype != FrameType.ABORT)
            if refusal is not None:
                self._refuse(tid, c, ftype != FrameType.ABORT, refusal, now, out)
                return
            t = self._transfers[tid] = IncomingTransfer(tid, h.total, now, now)
            self._own(t, c)
        else:
            t.last_activity = now
            self._touch(t, c)
        if ftype == FrameType.DATA:
            n = h.length
            self.bytes_received += n
            t.conns.add(conn)
            c.carried.add(t)
            if h.total != t.total:
                self._finish(
                    t, False, f"DATA at offset {h.offset} says total {h.total}, expected {t.total}", now, out, c
                )
                return
            fresh = t.add_range(h.offset, n)
            if not fresh and not t.covered(h.offset, n):
                self._finish(
                    t,
                    False,
                    f"overlapping DATA at offset {h.offset} length {n} (part of it received already)",
                    now,
                    out,
                    c,
                )
                return
            if self.verify:
                if not h.flags & FLAG_CHECKSUM:
                    self._finish(t, False, f"DATA at offset {h.offset} has no checksum in verify mode", now, out, c)
                    return
                if f.payload != payload_pattern(tid, h.offset, n):
                    self._finish(
                        t, False, f"DATA at offset {h.offset} length {n} does not match the pattern", now, out, c
                    )
                    return
            if not fresh:
                t.duplicate_bytes += n
                self.duplicate_bytes += n
                return
            # Only past MAX_LAYERS ranges can a cap be passed: one comparison per frame until then.
            if len(t.starts) > MAX_LAYERS and len(t.starts) > (cap := fragment_cap(t.total, self.max_fragments)):
                self._frame_error(
                    conn,
                    c,
                    FrameError(
                        f"transfer {tid} arrived in more than {cap} separate byte ranges (limit {cap} for "
                        f"{t.total} bytes)",
                        tid,
                    ),
                    now,
                    out,
                )
                return
            t.received += n
            t.data_conns.add(conn)
            t.layers_seen.add(h.layer)
            if t.complete:
                self._finish(t, True, "", now, out, c)
        elif ftype == FrameType.END:
            t.conns.add(conn)
            c.carried.add(t)
            if h.total != t.total:
                self._finish(t, False, f"END says total {h.total}, data said {t.total}", now, out, c)
                return
            t.end_seen = True
            t.layers = h.layer
            if t.complete:
                self._finish(t, True, "", now, out, c)
        else:
            reason = f.payload.decode("utf-8", "replace")
            self._finish(t, False, f"aborted by sender: {reason}", now, out, notify=False)

    def _over_limit(self, c: ConnState, now: float, out: list[ReceiveEvent], evict: bool = True) -> str | None:
        # The counts never pass their limits, so each reason is one string, shared by every
        # refusal's result and tombstone rather than built anew for each.
        if len(c.carried) >= self.max_transfers_per_connection:
            return c.full
        if self._peer_open.get(c.host, 0) >= self.max_transfers_per_peer:
            victim = self._victim_in(c.host, c) if evict else None
            if victim is None:
                return c.peer_full
            self._evict(victim, f"peer {c.host} at its limit of {self.max_transfers_per_peer} open transfers", now, out)
        if len(self._transfers) >= self.max_transfers:
            victim = self._fair_victim(c) if evict else None
            if victim is None:
                return self._full
            self._evict(victim, f"receiver full ({self.max_transfers} transfers open)", now, out)
        return None

    # -- fair share

    def _own(self, t: IncomingTransfer, c: ConnState) -> None:
        t.owner, t.host = c, c.host
        c.owned[t.transfer_id] = t
        self._peer_open[c.host] = self._peer_open.get(c.host, 0) + 1

    def _unown(self, t: IncomingTransfer) -> None:
        if t.owner is not None:
            t.owner.owned.pop(t.transfer_id, None)
        else:
            orphans = self._orphans.get(t.host)
            if orphans is not None:
                orphans.pop(t.transfer_id, None)
                if not orphans:
                    del self._orphans[t.host]
        n = self._peer_open[t.host] - 1
        if n:
            self._peer_open[t.host] = n
        else:
            del self._peer_open[t.host]
        t.owner = None

    def _touch(self, t: IncomingTransfer, c: ConnState) -> None:
        """A frame of `t` came on `c`: it is the most recently active of its holder's; an orphan
        is adopted by the connection that resumed it."""
        if t.owner is None:
            self._unown(t)
            self._own(t, c)
        else:
            t.owner.owned.move_to_end(t.transfer_id)

    def _disown(self, c: ConnState) -> None:
        """`c` is gone: what it held stays open (it may resume elsewhere), held by its peer."""
        conns = self._peer_conns.get(c.host)
        if conns is not None:
            conns.discard(c)
            if not conns:
                del self._peer_conns[c.host]
        if c.owned:
            orphans = self._orphans.setdefault(c.host, OrderedDict())
            for tid, t in c.owned.items():
                t.owner = None
                orphans[tid] = t
            c.owned.clear()

    def _victim_in(self, host: str, newcomer: ConnState | None) -> IncomingTransfer | None:
        """The transfer of `host` to give up a place: its longest silent one whose connection is
        gone, else that of its connection holding the most (if more than one more than `newcomer`)."""
        orphans = self._orphans.get(host)
        if orphans:
            return next(iter(orphans.values()))
        conns = self._peer_conns.get(host)
        if not conns:
            return None
        big = max(conns, key=lambda k: len(k.owned))
        if not big.owned or (newcomer is not None and len(big.owned) <= len(newcomer.owned) + 1):
            return None
        return next(iter(big.owned.values()))

    def _fair_victim(self, c: ConnState) -> IncomingTransfer | None:
        mine = self._peer_open.get(c.host, 0)
        host, most = max(self._peer_open.items(), key=lambda kv: kv[1])
        if host == c.host:
            return self._victim_in(host, c)
        return self._victim_in(host, None) if most > mine + 1 else None

    def _evict(self, t: IncomingTransfer, why: str, now: float, out: list[ReceiveEvent]) -> None:
        self.transfers_evicted += 1
        self._finish(
            t,
            False,
            f"evicted for a fair share ({why}): the longest silent ({now - t.last_activity:.3g} s) "
            f"of the largest holder, at {t.host}",
            now,
            out,
        )

    def _refuse(self, tid: int, c: ConnState, answer: bool, reason: str, now: float, out: list[ReceiveEvent]) -> None:
        """Fail a transfer beyond a limit before it costs anything but its result."""
        self.transfers_refused += 1
        self.transfers_failed += 1
        self._record(TransferResult(tid, False, 0, now, now, reason, 0, 0), now, out)
        if answer:
            c.replies.append(encode_abort(tid, reason))

    def _finish(
        self,
        t: IncomingTransfer,
        ok: bool,
        reason: str,
        now: float,
        out: list[ReceiveEvent],
        via: ConnState | None = None,
        notify: bool = True,
    ) -> None:
        """Settle a transfer. The sender hears of it (unless `notify` is off): on `via`, the
        connection whose frame settled it, with that read's ACK; else on a live connection that
        carried it."""
        tid = t.transfer_id
        del self._transfers[tid]
        self._unown(t)
        live: ConnId | None = None
        for cid in t.conns:
            c = self._conns.get(cid)
            if c is not None:
                c.carried.discard(t)
                if live is None and not c.broken:
                    live = cid
        if ok:
            self.transfers_completed += 1
        else:
            self.transfers_failed += 1
        self._record(t.result(ok, reason, now), now, out)
        if notify:
            frame = encode_end(tid, t.layers, t.total) if ok else encode_abort(tid, reason)
            if via is not None:
                via.replies.append(frame)
            elif live is not None:
                out.append(Send(live, frame))

    def _record(self, result: TransferResult, now: float, out: list[ReceiveEvent]) -> None:
        tid = result.transfer_id
        self._finished[tid] = (now, None if result.ok else result.reason)
        if len(self._finished) > self.max_tombstones:
            self._finished.popitem(last=False)
        claimed = tid in self._expected
        if claimed:
            self._expected.discard(tid)
        else:
            self._keep(tid, result, now)
        out.append(TransferCompleted(result, claimed) if result.ok else TransferFailed(result, claimed))

    def _keep(self, tid: int, result: TransferResult, now: float) -> None:
        self._results[tid] = (result, now)
        if len(self._results) > self.max_results:
            self._results.popitem(last=False)

    def _frame_error(self, conn: ConnId, c: ConnState, e: FrameError, now: float, out: list[ReceiveEvent]) -> None:
        if c.broken:
            return
        c.broken = True
        c.decoder = FrameDecoder(keep_data=False)
        c.replies.clear()
        out.append(CloseConnection(conn, c.peer, e.reason))
        reason = f"bad frame from {c.peer}: {e.reason}"
        for t in list(c.carried):
            self._finish(t, False, reason, now, out)
        tid = e.transfer_id
        if tid is not None and tid not in self._transfers and tid not in self._finished:
            # A transfer never seen before, named by a header whose layout was trusted: its
            # waiter learns now rather than at its timeout. One carried elsewhere is left alone.
            self.transfers_failed += 1
            self._record(TransferResult(tid, False, 0, now, now, reason, 0, 0), now, out)
