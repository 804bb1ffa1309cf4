"""Measurement probes run inside namespaces: UDP echo for RTT and a UDP sink for loss."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import socket
import statistics
import struct
import sys
import termios
import time
from dataclasses import dataclass

_PROBE = struct.Struct("!4sQd")  # magic, sequence, send time
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
SO_RXQ_OVFL = getattr(socket, "SO_RXQ_OVFL", 40)
_TIMESPEC = struct.Struct("@qq")
_U32 = struct.Struct("@I")
ANCBUF = socket.CMSG_SPACE(_TIMESPEC.size) + socket.CMSG_SPACE(_U32.size)
_MAGIC = b"PTBP"


_RESIDENCE = struct.Struct("!d")  # after the probe header: how long the echo held it


def rx_stamp(anc: list[tuple[int, int, bytes]]) -> float | None:
    """The kernel's receive time (SO_TIMESTAMPNS, wall clock) among a datagram's ancillary data."""
    for lvl, typ, d in anc:
        if lvl == socket.SOL_SOCKET and typ == SO_TIMESTAMPNS and len(d) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack_from(d)
            return float(sec + nsec * 1e-9)
    return None


def _stamped_socket(host: str, port: int, *, bind: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        sock.setblocking(False)
        if bind:
            sock.bind((host, port))
        else:
            sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _echo(sock: socket.socket) -> None:
    while True:
        try:
            data, anc, _, addr = sock.recvmsg(2048, ANCBUF)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # an ICMP error for an earlier reply: nothing to read
            continue
        if len(data) >= _PROBE.size + _RESIDENCE.size and data[:4] == _MAGIC:
            at = rx_stamp(anc)
            held = time.time() - at if at is not None else 0.0
            data = data[: _PROBE.size] + _RESIDENCE.pack(held) + data[_PROBE.size + _RESIDENCE.size :]
        with contextlib.suppress(OSError):  # a full buffer drops the reply: the probe times out
            sock.sendto(data, addr)


async def udp_echo_server(host: str, port: int) -> None:
    """Echo datagrams until cancelled. A probe goes back with the time it spent in this host
    (from the kernel's receive stamp to the reply), so the prober can leave it out."""
    loop = asyncio.get_running_loop()
    sock = _stamped_socket(host, port, bind=True)
    loop.add_reader(sock.fileno(), _echo, sock)
    try:
        await asyncio.Event().wait()
    finally:
        loop.remove_reader(sock.fileno())
        sock.close()


@dataclass(frozen=True)
class RttResult:
    """Round trips as the kernels saw them: each probe's is from its send to the kernel's receive
    stamp of the reply, less the time the echo host held it. What the two hosts' scheduling added
    on top (a loaded machine wakes its readers late) is `host_median_s`, kept out of the figure."""

    sent: int
    received: int
    median_s: float
    p10_s: float
    p90_s: float
    sd_s: float = float("nan")
    host_median_s: float = float("nan")


async def measure_rtt(host: str, port: int, count: int = 200, gap: float = 0.01, timeout: float = 2.0) -> RttResult:
    """Sequential probes, one in flight at a time, so queueing never inflates the figure."""
    loop = asyncio.get_running_loop()
    replies: asyncio.Queue[tuple[bytes, float, float]] = asyncio.Queue()  # data, kernel stamp, read at
    sock = _stamped_socket(host, port, bind=False)

    def on_readable() -> None:
        while True:
            try:
                data, anc, _, _ = sock.recvmsg(2048, ANCBUF)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # ICMP port unreachable for an earlier probe: read on
                continue
            read_at = time.time()
            at = rx_stamp(anc)
            replies.put_nowait((data, read_at if at is None else at, read_at))

    loop.add_reader(sock.fileno(), on_readable)
    rtts: list[float] = []
    host_s: list[float] = []
    try:
        for seq in range(count):
            t = time.time()
            try:
                sock.send(_PROBE.pack(_MAGIC, seq, t) + bytes(36))
            except OSError:
                await asyncio.sleep(gap)
                continue
            try:
                while True:
                    data, at, read_at = await asyncio.wait_for(replies.get(), timeout)
                    if len(data) >= _PROBE.size + _RESIDENCE.size and _PROBE.unpack_from(data)[1] == seq:
                        held = _RESIDENCE.unpack_from(data, _PROBE.size)[0]
                        rtts.append(at - t - held)
                        host_s.append(read_at - at + held)
                        break
            except TimeoutError:
                pass
            await asyncio.sleep(gap)
    finally:
        loop.remove_reader(sock.fileno())
        sock.close()
    rtts.sort()
    if not rtts:
        nan = float("nan")
        return RttResult(count, 0, nan, nan, nan)
    q = statistics.quantiles(rtts, n=10) if len(rtts) > 1 else [rtts[0]] * 9
    return RttResult(
        count, len(rtts), statistics.median(rtts), q[0], q[-1], statistics.pstdev(rtts), statistics.median(host_s)
    )


class LossSink:
    """UDP sink recording each probe's sequence number and one-way delay in arrival order; start
    it in the receiving namespace. The delay is taken at the kernel's receive timestamp
    (SO_TIMESTAMPNS), so a receiver that reads late (a slow or loaded machine) does not add its
    own lag to the link's delay and jitter. SO_RXQ_OVFL hands each datagram the count of
    datagrams the socket dropped so far (its buffer full): the receiver's own loss, kept apart."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self._arrivals: list[tuple[int, float]] = []
        self._intervals: list[tuple[float, float]] = []
        self.overflow: int | None = None  # None: the kernel gave no SO_RXQ_OVFL count
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, host: str, port: int, rcvbuf: int = 32 << 20) -> None:
        # A receive buffer that holds a burst of probes: a receiver slower than the sender must
        # not count its own overflow as the link's loss. SO_RCVBUFFORCE passes net.core.rmem_max
        # (root only; else the capped SO_RCVBUF).
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, rcvbuf)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        sock.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)
        sock.setblocking(False)
        sock.bind((host, port))
        self._sock, self._loop = sock, asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._drain)

    def _drain(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data, anc, _, _ = self._sock.recvmsg(2048, ANCBUF)
            except (BlockingIOError, InterruptedError):
                return
            if len(data) < _PROBE.size or data[:4] != _MAGIC:
                continue
            _, seq, sent_at = _PROBE.unpack_from(data)
            for lvl, typ, d in anc:
                if lvl == socket.SOL_SOCKET and typ == SO_RXQ_OVFL and len(d) >= _U32.size:
                    self.overflow = max(self.overflow or 0, _U32.unpack_from(d)[0])
            at = rx_stamp(anc)
            now = at if at is not None else time.time()
            self.seen.add(seq)
            self._arrivals.append((seq, now - sent_at))
            self._intervals.append((sent_at, now))

    def received(self) -> int:
        return len(self.seen)

    def pending(self) -> bool:
        """Whether datagrams wait in the socket, unread (FIONREAD: the next one's size)."""
        if self._sock is None:
            return False
        buf = fcntl.ioctl(self._sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
        return int.from_bytes(buf, sys.byteorder) > 0

    def arrivals(self) -> list[tuple[int, float]]:
        """(sequence, one-way delay in s) of every probe in arrival order (see probe_stats)."""
        return list(self._arrivals)

    def intervals(self) -> list[tuple[float, float]]:
        """(sent, received) wall-clock times of every probe that arrived."""
        return list(self._intervals)

    def close(self) -> None:
        if self._sock is not None and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None


def wait_drained(sink: LossSink, quiet_s: float, limit_s: float = 120.0) -> None:
    """Until no probe has arrived for `quiet_s` (the link's delay plus a margin) and none waits
    unread: a slow receiver may still be reading what arrived long ago, and what it never reads
    would count as loss."""
    end = time.monotonic() + limit_s
    last, since = sink.received(), time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.1)
        n = sink.received()
        if n != last or sink.pending():
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return


# Behind its schedule by more than this (a stall of the sending CPU), the sender resumes the
# schedule from now instead of sending the backlog back to back: a burst of that backlog would
# fill the shaping queue, and its overflow is not the link's loss.
MAX_LAG_S = 0.002
MAX_RETRIES = 1000  # a millisecond apart: a buffer still full after a second is not a stall


@dataclass(frozen=True)
class SendResult:
    sent: int
    retries: int = 0  # sends the kernel refused (buffer full, EAGAIN/ENOBUFS) and took on a retry
    stalls: int = 0  # times the sender fell MAX_LAG_S behind and resumed from there
    stalled_s: float = 0.0


async def send_probes(host: str, port: int, count: int, rate_pps: float, size: int = 200) -> SendResult:
    """Paced UDP probes (paced so the bottleneck queue never drops them: only the emulated
    loss should). A probe the kernel refuses for want of buffer is sent again: it never left."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    pad = bytes(max(size - _PROBE.size, 0))
    start = time.perf_counter()
    retries = stalls = 0
    stalled = 0.0
    try:
        for seq in range(count):
            due = start + seq / rate_pps
            now = time.perf_counter()
            if now - due > MAX_LAG_S:
                stalls += 1
                stalled += now - due
                start += now - due
                due = now
            delay = due - now
            if delay > 0.001:
                await asyncio.sleep(delay)
            for attempt in range(MAX_RETRIES + 1):
                try:
                    sock.sendto(_PROBE.pack(_MAGIC, seq, time.time()) + pad, (host, port))
                    break
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError as e:
                    if e.errno != errno.ENOBUFS:
                        raise
                if attempt == MAX_RETRIES:
                    raise OSError(errno.ENOBUFS, f"probe {seq}: the kernel refused it {MAX_RETRIES + 1} times")
                retries += 1
                await asyncio.sleep(0.001)
    finally:
        sock.close()
    return SendResult(count, retries, stalls, stalled)
