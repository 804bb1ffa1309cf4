"""TCP reset injection at the WAN router: sniff the KV connections crossing it, inject RSTs with
valid sequence numbers (scapy for both; which RSTs, the probes that reveal the numbers, and
why: `testbed.net.tcp_reset`).

    python -m testbed.net.rst --iface dc0 --iface dc1 --port 9000 --start UNIX --end UNIX \
        [--count N|all] [--ends both|receiver|sender] [--netns NAME|PATH]

Runs inside the WAN router's namespace (or enters `--netns` first: a name under /run/netns or a
path such as /proc/PID/ns/net). It imports scapy and opens its sockets at once, says `armed`,
waits for `--start`, empties the sockets, then sniffs every `--iface` until `--end` and injects
as it goes. Progress is JSON lines on stdout: {"event": "armed"}, {"event": "open", "t"},
{"event": "done", "t", ...summary} ("t" of "done": when sniffing stopped, the window's end as it
took effect).

Sniffing: an AF_PACKET socket per interface with a classic BPF filter (IPv4, TCP, either port =
the KV port) that keeps only the first SNAPLEN bytes, so the kernel copies headers, not 64 KiB
segments, and Python dissects only KV packets. (Written out here: scapy compiles filter strings
with tcpdump or libpcap, neither of which this host has.)
Injection: at layer 2 on the interface toward the end being reset, with PACKET_QDISC_BYPASS so
the RST skips the link's own shaping (an outage's 100% loss would drop it otherwise): it
appears on the wire as a middlebox's reset would.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

from testbed.net.tcp_reset import Reset, ResetPlanner, Segment

if TYPE_CHECKING:
    from scapy.packet import Packet

log = logging.getLogger("testbed.rst")
SNAPLEN = 160  # Ethernet + the largest IPv4 and TCP headers
PACKET_QDISC_BYPASS = 20  # linux/if_packet.h
SOL_PACKET = 263
TICK_S = 0.05  # how often the planner may send probes
SO_ATTACH_FILTER = 26
ETH_P_IP = 0x0800


def kv_filter(port: int, snaplen: int = SNAPLEN) -> list[tuple[int, int, int, int]]:
    """Classic BPF (code, jt, jf, k) for `ip and tcp and (src port P or dst port P)` on Ethernet,
    unfragmented, accepting `snaplen` bytes (what `tcpdump -dd` prints for that expression)."""
    return [
        (0x28, 0, 0, 12),  # ldh [12]             ethertype
        (0x15, 0, 10, ETH_P_IP),  # jeq #0x800           else drop
        (0x30, 0, 0, 23),  # ldb [23]             IP protocol
        (0x15, 0, 8, 6),  # jeq #6 (TCP)         else drop
        (0x28, 0, 0, 20),  # ldh [20]             flags + fragment offset
        (0x45, 6, 0, 0x1FFF),  # jset #0x1fff         a fragment: drop
        (0xB1, 0, 0, 14),  # ldxb 4*([14]&0xf)    IP header length
        (0x48, 0, 0, 14),  # ldh [x + 14]         source port
        (0x15, 2, 0, port),  # jeq #port            accept
        (0x48, 0, 0, 16),  # ldh [x + 16]         destination port
        (0x15, 0, 1, port),  # jeq #port            else drop
        (0x06, 0, 0, snaplen),  # ret #snaplen         accept the headers
        (0x06, 0, 0, 0),  # ret #0               drop
    ]


def attach_filter(sock: socket.socket, program: list[tuple[int, int, int, int]]) -> None:
    insns = b"".join(struct.pack("HBBI", *ins) for ins in program)
    buf = ctypes.create_string_buffer(insns)
    # struct sock_fprog { unsigned short len; struct sock_filter *filter; } (native alignment)
    fprog = struct.pack("HL", len(program), ctypes.addressof(buf))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


def segment_of(pkt: Packet, router_mac: str) -> tuple[Segment, str] | None:
    """The TCP header of a frame sniffed on an interface whose MAC is `router_mac`, and the MAC of
    the host on the far side (truncated payloads are fine: lengths come from the IP header)."""
    from scapy.layers.inet import IP, TCP
    from scapy.layers.l2 import Ether

    if not (pkt.haslayer(Ether) and pkt.haslayer(IP) and pkt.haslayer(TCP)):
        return None
    eth, ip, tcp = pkt[Ether], pkt[IP], pkt[TCP]
    outgoing = str(eth.src).lower() == router_mac
    payload = int(ip.len) - int(ip.ihl) * 4 - int(tcp.dataofs) * 4
    seg = Segment(
        outgoing,
        (str(ip.src), int(tcp.sport)),
        (str(ip.dst), int(tcp.dport)),
        int(tcp.seq),
        int(tcp.ack),
        int(tcp.flags),
        max(payload, 0),
    )
    return seg, str(eth.dst if outgoing else eth.src).lower()


def craft(r: Reset, router_mac: str, host_mac: str) -> bytes:
    """The frame: Ethernet from the router to the end's host, IP and TCP as if from its peer; an
    RST, or a probe (one byte of data, out of the end's window)."""
    from scapy.layers.inet import IP, TCP
    from scapy.layers.l2 import Ether

    ip = IP(src=r.src[0], dst=r.dst[0], ttl=64)
    if r.probe:
        tcp = TCP(sport=r.src[1], dport=r.dst[1], seq=r.seq, ack=r.ack, flags="A", window=0) / b"\0"
    else:
        tcp = TCP(sport=r.src[1], dport=r.dst[1], seq=r.seq, ack=0, flags="R", window=0)
    return bytes(Ether(src=router_mac, dst=host_mac) / ip / tcp)


def kernel_path(ip: str) -> tuple[str, str] | None:
    """(interface, MAC) this namespace's kernel would send to `ip` by, from its route and
    neighbour tables (None without a neighbour entry: no frame can be addressed)."""
    from pyroute2 import IPRoute  # type: ignore[import-untyped]

    with IPRoute() as ipr:
        try:
            routes = ipr.route("get", dst=ip)
        except Exception:  # pyroute2's NetlinkError: no route
            return None
        oif = routes[0].get_attr("RTA_OIF") if routes else None
        if oif is None or routes[0].get_attr("RTA_GATEWAY") is not None:
            return None  # not on a directly attached network: not one of ours
        for n in ipr.get_neighbours(ifindex=oif):
            if n.get_attr("NDA_DST") == ip and n.get_attr("NDA_LLADDR"):
                name = ipr.link("get", index=oif)[0].get_attr("IFLA_IFNAME")
                return str(name), str(n.get_attr("NDA_LLADDR")).lower()
    return None


class _Stop(BaseException):
    """SIGTERM/SIGINT: not an Exception, so scapy's per-packet error handling cannot swallow it."""


class Injector:
    """Sniff `ifaces` for connections to `port` and inject the planner's RSTs."""

    def __init__(self, ifaces: Sequence[str], planner: ResetPlanner, trace: TextIO | None = None) -> None:
        from scapy.arch import get_if_hwaddr
        from scapy.config import conf

        self.planner = planner
        self.trace = trace
        self.macs = {i: str(get_if_hwaddr(i)).lower() for i in ifaces}
        self.listen: dict[Any, str] = {}
        self.out: dict[str, socket.socket] = {}
        # Where each end lives: (interface, its MAC), learned from the frames it sends or is sent;
        # for an end silent since sniffing began, the kernel's tables.
        self.paths: dict[str, tuple[str, str]] = {}
        self.bypass = True
        self.send_errors = 0
        self.unroutable = 0
        try:
            for i in ifaces:
                s = conf.L2listen(iface=i, promisc=False)
                attach_filter(s.ins, kv_filter(planner.port))
                self.listen[s] = i
                o = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)  # protocol 0: sends, never receives
                self.out[i] = o
                o.bind((i, 0))
                try:
                    o.setsockopt(SOL_PACKET, PACKET_QDISC_BYPASS, 1)
                except OSError:
                    self.bypass = False
        except BaseException:
            self.close()
            raise

    def on_packet(self, pkt: Packet) -> None:
        # Never raise: scapy closes the socket of a packet whose callback fails.
        try:
            iface = str(pkt.sniffed_on)
            got = segment_of(pkt, self.macs[iface])
            if got is None:
                return
            seg, host_mac = got
            self.paths[seg.dst[0] if seg.outgoing else seg.src[0]] = (iface, host_mac)
            out = self.planner.observe(seg, time.time())
            if self.trace is not None:
                self._trace("seen", iface=iface, **asdict(seg))
            for r in out:
                self._send(r)
        except Exception:
            log.exception("packet handling failed")

    def _trace(self, what: str, **kw: Any) -> None:
        assert self.trace is not None
        self.trace.write(json.dumps({"t": round(time.time(), 6), "what": what, **kw}) + "\n")

    def _send(self, r: Reset) -> None:
        if self.trace is not None:
            self._trace("probe" if r.probe else "rst", **asdict(r))
        path = self.paths.get(r.dst[0])
        if path is None and (path := kernel_path(r.dst[0])) is not None and path[0] in self.out:
            self.paths[r.dst[0]] = path
        if path is None or path[0] not in self.out:
            self.unroutable += 1
            return
        iface, host_mac = path
        try:
            self.out[iface].send(craft(r, self.macs[iface], host_mac))
        except OSError as e:
            self.send_errors += 1
            log.warning("RST to %s:%d failed: %s", r.dst[0], r.dst[1], e)

    def drain(self) -> None:
        """Discard what the sniffing sockets queued so far (before the window)."""
        for s in self.listen:
            sock: socket.socket = s.ins
            sock.setblocking(False)
            try:
                while True:
                    sock.recv(SNAPLEN)
            except BlockingIOError:
                pass
            finally:
                sock.setblocking(True)

    def run(self, until: float) -> None:
        from scapy.sendrecv import sniff

        while (left := until - time.time()) > 0:
            sniff(opened_socket=self.listen, prn=self.on_packet, store=False, timeout=min(left, TICK_S))
            for r in self.planner.tick(time.time()):
                self._send(r)

    def close(self) -> None:
        for s in self.listen:
            s.close()
        for o in self.out.values():
            o.close()
        self.listen, self.out = {}, {}


def injector_argv(
    ifaces: Sequence[str],
    port: int,
    start: float,
    end: float,
    count: int | None,
    ends: str,
    netns: str | None = None,
    trace: Path | None = None,
) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "testbed.net.rst",
        "--port",
        str(port),
        "--start",
        f"{start:.6f}",
        "--end",
        f"{end:.6f}",
        "--count",
        "all" if count is None else str(count),
        "--ends",
        ends,
    ]
    for i in ifaces:
        argv += ["--iface", i]
    return argv + (["--netns", netns] if netns else []) + (["--trace", str(trace)] if trace else [])


def _say(event: str, **kw: Any) -> None:
    print(json.dumps({"event": event, "t": time.time(), **kw}), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.net.rst", description=__doc__.split("\n")[0])
    ap.add_argument("--iface", action="append", required=True, help="interface to sniff and inject on (repeat)")
    ap.add_argument("--port", type=int, required=True, help="the KV receivers' TCP port")
    ap.add_argument("--start", type=float, required=True, help="window start, unix seconds")
    ap.add_argument("--end", type=float, required=True, help="window end, unix seconds")
    ap.add_argument("--count", default="all", help="connections to reset (the first seen), or 'all'")
    ap.add_argument("--ends", choices=("both", "receiver", "sender"), default="both")
    ap.add_argument("--netns", help="network namespace to enter first (name or path)")
    ap.add_argument("--trace", type=Path, help="JSONL of every segment seen and every frame sent (diagnosis)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rst %(levelname)s %(message)s", stream=sys.stderr)
    count = None if args.count == "all" else int(args.count)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise _Stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    inj: Injector | None = None
    stopped: float | None = None  # when sniffing ended: the window's end as it took effect
    planner = ResetPlanner(args.port, count, args.ends)
    trace = args.trace.open("w") if args.trace else None
    try:
        if args.netns:
            from testbed.net.nsthread import enter_netns

            enter_netns(args.netns)
        # Namespace first: scapy reads the interface list when it is imported. The layers
        # register the link types its sockets dissect with (else frames come back as Raw).
        import scapy.layers.inet  # noqa: F401
        import scapy.layers.l2  # noqa: F401
        import scapy.sendrecv  # noqa: F401

        # Sockets opened ahead (tens of ms), emptied at the window's start: it opens on time.
        inj = Injector(args.iface, planner, trace)
        _say("armed", pid=os.getpid())
        time.sleep(max(args.start - time.time(), 0.0))
        inj.drain()
        _say("open", ifaces=args.iface, qdisc_bypass=inj.bypass)
        inj.run(args.end)
        stopped = time.time()
    except _Stop:
        pass
    except OSError as e:
        _say("done", error=str(e), **planner.summary())
        return 1
    finally:
        if inj is not None:
            inj.close()
        if trace is not None:
            trace.close()
    _say(
        "done",
        **({} if stopped is None else {"t": stopped}),
        send_errors=inj.send_errors if inj else 0,
        unroutable=inj.unroutable if inj else 0,
        **planner.summary(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
