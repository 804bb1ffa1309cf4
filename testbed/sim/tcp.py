"""What one TCP connection of the KV transport can carry, as a flow-level rate (paper units).

Per connection, the least of:
- the window: min(rmem, wmem) bytes per round trip (the profile's `tcp` limits, else the
  transfer's socket buffers, else Linux defaults 6 MiB / 4 MiB); slow start is not modelled
  (the transport's connections are persistent and rarely idle for a retransmission timeout);
- loss-based congestion control (cubic, reno, the default): Mathis et al.,
  MSS / RTT * sqrt(3/2) / sqrt(p), with p the loss-event rate: the profile's loss times
  (1 - loss_correlation), since correlated losses come in bursts that cost one window cut each;
  BBR does not back off on random loss, so it has no such limit.
The link itself carries payload at rate * MSS / MTU (TCP/IP headers), times (1 - loss) (lost
packets took their slot); loss >= 1 (an outage) carries nothing.

Window, MSS and MTU are kernel (wire) bytes: in paper units they are multiplied by byte_scale,
so the model predicts what the emulator measures at the scenario's scale (byte_scale 1 is the
real deployment).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from testbed.core.schema.linkprofile import LinkProfile
from testbed.core.schema.scenario import TransferSpec

LINUX_RMEM_MAX = 6 * 1024 * 1024  # net.ipv4.tcp_rmem default maximum
LINUX_WMEM_MAX = 4 * 1024 * 1024  # net.ipv4.tcp_wmem default maximum
DEFAULT_MTU = 1500
TCP_IP_HEADERS = 40
MATHIS_C = math.sqrt(1.5)
LOSS_FREE_CC = frozenset({"bbr", "bbr2", "bbr3"})


@dataclass(frozen=True)
class TcpModel:
    window_bytes: float  # paper bytes per connection per round trip
    mss_bytes: float  # paper bytes
    payload_share: float  # MSS / MTU: payload on the wire
    loss_based: bool
    send_buffer: float  # paper bytes a connection's socket accepts ahead of the wire

    @classmethod
    def of(cls, profile: LinkProfile, transfer: TransferSpec, byte_scale: float) -> TcpModel:
        tcp = profile.tcp
        rmem = transfer.rcvbuf_bytes or tcp.rmem_max or LINUX_RMEM_MAX
        wmem = transfer.sndbuf_bytes or tcp.wmem_max or LINUX_WMEM_MAX
        mtu = profile.mtu or DEFAULT_MTU
        cc = (transfer.congestion or tcp.congestion or "cubic").lower()
        return cls(
            min(rmem, wmem) * byte_scale,
            (mtu - TCP_IP_HEADERS) * byte_scale,
            (mtu - TCP_IP_HEADERS) / mtu,
            cc not in LOSS_FREE_CC,
            wmem * byte_scale,
        )

    def connection_rate(self, rtt: float, loss: float, loss_correlation: float) -> float:
        """Bytes/s one connection can carry on its own (before sharing the link)."""
        if loss >= 1.0:
            return 0.0
        rate = self.window_bytes / rtt if rtt > 0 else math.inf
        p = loss * (1.0 - loss_correlation)
        if self.loss_based and p > 0:
            rate = min(rate, self.mss_bytes / rtt * MATHIS_C / math.sqrt(p) if rtt > 0 else math.inf)
        return rate

    def link_payload(self, rate_bps: float, loss: float) -> float:
        """Payload bytes/s a link of `rate_bps` (bits/s on the wire) delivers."""
        return max(rate_bps / 8.0 * self.payload_share * (1.0 - loss), 0.0)
