"""Which TCP RSTs (and probes) to inject into observed connections, with which numbers (pure).

A middlebox (the WAN router) sees the segments of each KV connection on its interfaces, in both
directions. Linux accepts an RST only when its sequence number is exactly the receiver's
`rcv_nxt` (RFC 5961): one inside the window draws a "challenge ACK" instead, one outside it is
dropped in silence. What the observer learns per end X of a connection:

- `rcv_nxt` of X: the acknowledgment number of X's latest segment (X's rcv_nxt when it sent it);
- `delivered` to X: the highest sequence end of the peer's segments seen *leaving* the router
  toward X (past every shaper and the delay line, so they reach X);
- `hint` for X: the sequence number of the peer's segments seen *arriving* at the router
  (retransmissions during an outage start at the peer's snd_una, a lower bound).

The guess for X is the newest of `rcv_nxt` and `delivered`, else the hint. Each observed
segment of a targeted connection may trigger an RST to each targeted end whose guess changed,
or a repeat when that end is still talking after a while.

A guess can be stale (data arrived meanwhile; an RST can even overtake the data it follows),
and an end can fall silent (its peer was reset, so nothing more reaches it). So `tick` also
sends each targeted end, every `probe_s`, a *probe*: one byte of data far behind its window.
A live end answers it with a duplicate ACK that carries its exact `rcv_nxt` (Linux does not
rate-limit that answer for segments with data), which `observe` turns into an exact RST; an end
whose socket is gone answers with an RST of its own, and is left alone from then on. The probe's
acknowledgment number is far from anything valid too, so that RST cannot reset the other end.
Sequence arithmetic is modulo 2**32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FIN, SYN, RST, ACK = 0x01, 0x02, 0x04, 0x10
SEQ_MOD = 1 << 32
FAR = 1 << 30  # how far behind a window a probe sits (windows here are far smaller)
Ends = Literal["both", "receiver", "sender"]
EndName = Literal["receiver", "sender"]


def seq_after(a: int, b: int) -> bool:
    """a is later than b in sequence space."""
    return 0 < (a - b) % SEQ_MOD < SEQ_MOD // 2


def seq_newest(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return b if seq_after(b, a) else a


@dataclass(frozen=True)
class Segment:
    """The header of one TCP segment as seen on a router interface."""

    outgoing: bool  # leaving the router (past its shapers), else arriving at it
    src: tuple[str, int]
    dst: tuple[str, int]
    seq: int
    ack: int
    flags: int
    payload_len: int


@dataclass(frozen=True)
class Reset:
    """A segment to send to `dst` as if `src` sent it (the caller finds the way to `dst`): an
    RST at `seq`, or with `probe`, one byte of data at `seq` acknowledging `ack`."""

    src: tuple[str, int]
    dst: tuple[str, int]
    seq: int
    to: EndName
    exact: bool  # seq is the end's own acknowledged number, not a guess from the peer
    conn: str
    probe: bool = False
    ack: int = 0


@dataclass
class _End:
    addr: tuple[str, int]
    rcv_nxt: int | None = None
    delivered: int | None = None
    hint: int | None = None
    last_seq: int | None = None
    last_t: float = float("-inf")
    last_probe: float = float("-inf")
    sent: int = 0
    probes: int = 0
    answered: bool = False  # an RST came from this end after ours: its socket is gone

    def guess(self) -> tuple[int | None, bool]:
        best = seq_newest(self.rcv_nxt, self.delivered)
        if best is not None:
            return best, best == self.rcv_nxt
        return self.hint, False


@dataclass
class _Conn:
    receiver: _End  # the end listening on the KV port
    sender: _End
    established: bool = False
    targeted: bool = False

    def end(self, name: EndName) -> _End:
        return self.receiver if name == "receiver" else self.sender

    def other(self, e: _End) -> _End:
        return self.sender if e is self.receiver else self.receiver

    @property
    def name(self) -> str:
        s, r = self.sender.addr, self.receiver.addr
        return f"{s[0]}:{s[1]}->{r[0]}:{r[1]}"


@dataclass
class ResetPlanner:
    """Decides the RSTs for the connections to `port` seen in a window: the first `count` of them
    (None: all), to the `ends` chosen. Times are the caller's clock (seconds)."""

    port: int
    count: int | None = None
    ends: Ends = "both"
    min_gap_s: float = 0.002  # between two RSTs to one end, however the guess moves
    repeat_s: float = 0.05  # the same guess again after this long, if the end still talks
    probe_s: float = 0.05  # between two probes to one end
    max_per_end: int = 64  # RSTs; probes likewise
    conns: dict[tuple[tuple[str, int], tuple[str, int]], _Conn] = field(default_factory=dict)
    targeted: int = 0
    rsts_sent: int = 0
    rsts_exact: int = 0
    probes_sent: int = 0

    def _targets(self) -> tuple[EndName, ...]:
        return ("receiver", "sender") if self.ends == "both" else (self.ends,)

    def observe(self, seg: Segment, now: float) -> list[Reset]:
        if seg.dst[1] == self.port:
            key, from_end = (seg.src, seg.dst), "sender"
        elif seg.src[1] == self.port:
            key, from_end = (seg.dst, seg.src), "receiver"
        else:
            return []
        c = self.conns.get(key)
        if c is None:
            c = self.conns[key] = _Conn(receiver=_End(key[1]), sender=_End(key[0]))
        me: _End = c.end(from_end)  # type: ignore[arg-type]
        peer = c.other(me)
        if seg.flags & RST:
            # Arriving from the end itself (our own RSTs only ever leave the router).
            if not seg.outgoing and (me.sent or me.probes):
                me.answered = True
            return []
        if seg.flags & ACK:
            me.rcv_nxt = seq_newest(me.rcv_nxt, seg.ack)
        seq_end = (seg.seq + seg.payload_len + (1 if seg.flags & SYN else 0) + (1 if seg.flags & FIN else 0)) % SEQ_MOD
        if seg.outgoing:
            peer.delivered = seq_newest(peer.delivered, seq_end)
        else:
            peer.hint = seq_newest(peer.hint, seg.seq)
        if not c.established:
            if seg.flags & SYN or not seg.flags & ACK:
                return []
            c.established = True
        if not c.targeted:
            if self.count is not None and self.targeted >= self.count:
                return []
            c.targeted = True
            self.targeted += 1
        out = []
        for name in self._targets():
            e = c.end(name)
            seq, exact = e.guess()
            if seq is None or e.answered or e.sent >= self.max_per_end or now - e.last_t < self.min_gap_s:
                continue
            if seq == e.last_seq and not (e is me and now - e.last_t >= self.repeat_s):
                continue
            out.append(Reset(c.other(e).addr, e.addr, seq, name, exact, c.name))
            e.last_seq, e.last_t = seq, now
            e.sent += 1
            self.rsts_sent += 1
            self.rsts_exact += exact
        return out

    def tick(self, now: float) -> list[Reset]:
        """Probes for the targeted ends still standing (see the module's docstring)."""
        out = []
        for c in self.conns.values():
            if not c.targeted:
                continue
            for name in self._targets():
                e, other = c.end(name), c.other(c.end(name))
                base = e.guess()[0]
                if base is None or e.answered or e.probes >= self.max_per_end or now - e.last_probe < self.probe_s:
                    continue
                ack = ((other.rcv_nxt if other.rcv_nxt is not None else 0) - FAR) % SEQ_MOD
                out.append(Reset(other.addr, e.addr, (base - FAR) % SEQ_MOD, name, False, c.name, True, ack))
                e.last_probe = now
                e.probes += 1
                self.probes_sent += 1
        return out

    def summary(self) -> dict[str, object]:
        targeted = [c for c in self.conns.values() if c.targeted]
        return {
            "connections_seen": len(self.conns),
            "connections_targeted": len(targeted),
            "rsts_sent": self.rsts_sent,
            "rsts_exact": self.rsts_exact,
            "probes_sent": self.probes_sent,
            "ends_answered": sum(c.receiver.answered + c.sender.answered for c in targeted),
            "connections": [
                {
                    "conn": c.name,
                    "rsts_to_receiver": c.receiver.sent,
                    "rsts_to_sender": c.sender.sent,
                    "receiver_gone": c.receiver.answered,
                    "sender_gone": c.sender.answered,
                }
                for c in targeted[:64]
            ],
        }
