"""Measurement probes run inside namespaces: UDP echo for RTT and a UDP sink for loss."""

from __future__ import annotations

import asyncio
import socket
import statistics
import struct
import time
from dataclasses import dataclass
from typing import cast


_PROBE = struct.Struct("!4sQd")     # magic, sequence, send time
_MAGIC = b"PTBP"


class _Echo(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.t: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.t is not None:
            self.t.sendto(data, addr)


class _Sink(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.seen: set[int] = set()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if len(data) >= _PROBE.size and data[:4] == _MAGIC:
            self.seen.add(_PROBE.unpack_from(data)[1])


async def udp_echo_server(host: str, port: int) -> None:
    """Echo datagrams until cancelled."""
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(_Echo, local_addr=(host, port))
    try:
        await asyncio.Event().wait()
    finally:
        transport.close()


@dataclass(frozen=True)
class RttResult:
    sent: int
    received: int
    median_s: float
    p10_s: float
    p90_s: float


async def measure_rtt(host: str, port: int, count: int = 200, gap: float = 0.01, timeout: float = 2.0) -> RttResult:
    """Sequential probes, one in flight at a time, so queueing never inflates the figure."""
    loop = asyncio.get_running_loop()
    replies: asyncio.Queue[bytes] = asyncio.Queue()

    class _Client(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            replies.put_nowait(data)

    transport, _ = await loop.create_datagram_endpoint(_Client, remote_addr=(host, port))
    rtts: list[float] = []
    try:
        for seq in range(count):
            t = time.perf_counter()
            transport.sendto(_PROBE.pack(_MAGIC, seq, t) + bytes(36))
            try:
                while True:
                    data = await asyncio.wait_for(replies.get(), timeout)
                    if _PROBE.unpack_from(data)[1] == seq:
                        rtts.append(time.perf_counter() - t)
                        break
            except asyncio.TimeoutError:
                pass
            await asyncio.sleep(gap)
    finally:
        transport.close()
    rtts.sort()
    if not rtts:
        nan = float("nan")
        return RttResult(count, 0, nan, nan, nan)
    q = statistics.quantiles(rtts, n=10) if len(rtts) > 1 else [rtts[0]] * 9
    return RttResult(count, len(rtts), statistics.median(rtts), q[0], q[-1])


class LossSink:
    """UDP sink counting distinct probe sequence numbers; start it in the receiving namespace."""

    def __init__(self) -> None:
        self.proto = _Sink()
        self._t: asyncio.DatagramTransport | None = None

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._t, _ = await loop.create_datagram_endpoint(lambda: self.proto, local_addr=(host, port))

    def received(self) -> int:
        return len(self.proto.seen)

    def close(self) -> None:
        if self._t is not None:
            self._t.close()


async def send_probes(host: str, port: int, count: int, rate_pps: float, size: int = 200) -> int:
    """Paced UDP probes (paced so the bottleneck queue never drops them: only the emulated
    loss should)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    pad = bytes(max(size - _PROBE.size, 0))
    start = time.perf_counter()
    try:
        for seq in range(count):
            due = start + seq / rate_pps
            delay = due - time.perf_counter()
            if delay > 0.001:
                await asyncio.sleep(delay)
            sock.sendto(_PROBE.pack(_MAGIC, seq, time.time()) + pad, (host, port))
    finally:
        sock.close()
    return count
