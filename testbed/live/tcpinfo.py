"""Linux TCP_INFO of a connected socket: the congestion signals the scheduler samples."""

from __future__ import annotations

import logging
import socket
import struct
from dataclasses import dataclass, fields
from typing import Protocol

log = logging.getLogger("testbed.kv")

# Bytes requested; kernels older than the newest fields return fewer, which we tolerate.
TCP_INFO_LEN = 232


class SockOptSource(Protocol):
    """What we need of a socket: `socket.socket` and asyncio's `TransportSocket` both fit."""

    @property
    def family(self) -> int: ...

    @property
    def type(self) -> int: ...

    def getsockopt(self, level: int, optname: int, buflen: int, /) -> bytes: ...


@dataclass(frozen=True, slots=True)
class TcpInfo:
    """Fields of linux/tcp.h `struct tcp_info`; times in microseconds, rates in bytes/s,
    cwnd/ssthresh in segments. Fields the kernel did not return are 0."""

    state: int = 0
    ca_state: int = 0
    rto: int = 0
    snd_mss: int = 0
    unacked: int = 0
    lost: int = 0
    retrans: int = 0
    pmtu: int = 0
    rtt: int = 0
    rttvar: int = 0
    snd_ssthresh: int = 0
    snd_cwnd: int = 0
    total_retrans: int = 0
    pacing_rate: int = 0
    bytes_acked: int = 0
    bytes_received: int = 0
    notsent_bytes: int = 0
    min_rtt: int = 0
    delivery_rate: int = 0
    busy_time: int = 0
    rwnd_limited: int = 0
    sndbuf_limited: int = 0
    bytes_sent: int = 0
    bytes_retrans: int = 0
    snd_wnd: int = 0


# (field, byte offset, native struct code) per linux/include/uapi/linux/tcp.h.
_LAYOUT: tuple[tuple[str, int, str], ...] = (
    ("state", 0, "B"),
    ("ca_state", 1, "B"),
    ("rto", 8, "I"),
    ("snd_mss", 16, "I"),
    ("unacked", 24, "I"),
    ("lost", 32, "I"),
    ("retrans", 36, "I"),
    ("pmtu", 60, "I"),
    ("rtt", 68, "I"),
    ("rttvar", 72, "I"),
    ("snd_ssthresh", 76, "I"),
    ("snd_cwnd", 80, "I"),
    ("total_retrans", 100, "I"),
    ("pacing_rate", 104, "Q"),
    ("bytes_acked", 120, "Q"),
    ("bytes_received", 128, "Q"),
    ("notsent_bytes", 144, "I"),
    ("min_rtt", 148, "I"),
    ("delivery_rate", 160, "Q"),
    ("busy_time", 168, "Q"),
    ("rwnd_limited", 176, "Q"),
    ("sndbuf_limited", 184, "Q"),
    ("bytes_sent", 200, "Q"),
    ("bytes_retrans", 208, "Q"),
    ("snd_wnd", 228, "I"),
)
_FIELDS = tuple((name, off, struct.Struct("=" + code)) for name, off, code in _LAYOUT)
assert {f.name for f in fields(TcpInfo)} == {name for name, _, _ in _LAYOUT}


def parse_tcp_info(buf: bytes) -> TcpInfo:
    """Decode a TCP_INFO buffer of any length; fields past its end stay 0."""
    values: dict[str, int] = {}
    n = len(buf)
    for name, off, st in _FIELDS:
        if off + st.size <= n:
            values[name] = st.unpack_from(buf, off)[0]
    return TcpInfo(**values)


def read_tcp_info(sock: SockOptSource) -> TcpInfo | None:
    """TCP_INFO of `sock`, or None when it is not a TCP socket or the kernel refuses."""
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        buf = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN)
    except OSError as e:
        log.debug("TCP_INFO unavailable: %s", e)
        return None
    return parse_tcp_info(buf)
