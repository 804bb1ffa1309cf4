"""Topology -> ordered list of kernel operations (pure: builds data, touches nothing).

Each operation is a frozen dataclass naming its namespace; `describe()` renders it in
`ip`/`tc` syntax for logs and error messages. The executor applies them in order.

Shaping sits on the WAN router's egress interface `dc{j}` (traffic into DC j):

    dc{j}: htb 1: (unclassified traffic: unshaped)
             +-- class 1:{10+i}  rate = links[(DC i, DC j)]   <- u32 match on DC i's source subnet
                   +-- leaf: netem (delay/jitter/loss, "netem") or bfifo (queue, "fallback")

Every (src, dst) pair has its own class, so with more than two DCs the flows from different
sources into one DC are shaped independently, as separate WAN links would be.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

from testbed.core.schema.linkprofile import LinkParams
from testbed.net.topology import (
    BRIDGE_IF,
    HOST_IF,
    UPLINK_IF,
    DCNet,
    Method,
    Topology,
    port_ifname,
)

TUN_IF = "tun0"
DELAY_TABLE = 100  # routing table that sends inter-DC packets up to the delay line
RULE_PRIORITY_BASE = 100  # rule `iif dc{i} lookup 100` gets priority 100 + i
HTB_ROOT = 0x10000  # 1:
CLASS_MINOR_BASE = 0x10  # class of source DC i is 1:{0x10 + i}
GSO_MAX = 65536  # veth/bridge hand HTB GSO skbs up to 64 KiB whatever the MTU
MIN_QUEUE_PACKETS = 8
MIN_TUN_QLEN = 1000

Leaf = Literal["netem", "bfifo"]


def fmt_handle(h: int) -> str:
    """0x10010 -> '1:10' (tc notation, hex)."""
    return f"{h >> 16:x}:{h & 0xFFFF:x}" if h & 0xFFFF else f"{h >> 16:x}:"


def fmt_rate(bps: float) -> str:
    for unit, div in (("Gbit", 1e9), ("Mbit", 1e6), ("Kbit", 1e3)):
        if bps >= div:
            return f"{bps / div:g}{unit}"
    return f"{bps:g}bit"


@dataclass(frozen=True)
class Operation(ABC):
    ns: str  # the namespace the operation runs in

    @abstractmethod
    def describe(self) -> str:
        """The operation in `ip`/`tc` syntax, prefixed by its namespace."""


@dataclass(frozen=True)
class AddNetns(Operation):
    def describe(self) -> str:
        return f"ip netns add {self.ns}"


@dataclass(frozen=True)
class AddBridge(Operation):
    ifname: str

    def describe(self) -> str:
        return f"{self.ns}: ip link add {self.ifname} type bridge"


@dataclass(frozen=True)
class AddVeth(Operation):
    ifname: str
    peer_ns: str
    peer_ifname: str

    def describe(self) -> str:
        return f"{self.ns}: ip link add {self.ifname} type veth peer name {self.peer_ifname} netns {self.peer_ns}"


@dataclass(frozen=True)
class AddTun(Operation):
    """Persistent L3 TUN (IFF_TUN | IFF_NO_PI): survives without a reader, so the delay-line
    process can attach to it by name later."""

    ifname: str

    def describe(self) -> str:
        return f"{self.ns}: ip tuntap add {self.ifname} mode tun (no_pi)"


@dataclass(frozen=True)
class SetMaster(Operation):
    ifname: str
    master: str

    def describe(self) -> str:
        return f"{self.ns}: ip link set {self.ifname} master {self.master}"


@dataclass(frozen=True)
class SetMtu(Operation):
    ifname: str
    mtu: int

    def describe(self) -> str:
        return f"{self.ns}: ip link set {self.ifname} mtu {self.mtu}"


@dataclass(frozen=True)
class SetTxQueueLen(Operation):
    ifname: str
    qlen: int

    def describe(self) -> str:
        return f"{self.ns}: ip link set {self.ifname} txqueuelen {self.qlen}"


@dataclass(frozen=True)
class AddAddress(Operation):
    ifname: str
    cidr: str

    def describe(self) -> str:
        return f"{self.ns}: ip addr add {self.cidr} dev {self.ifname}"


@dataclass(frozen=True)
class LinkUp(Operation):
    ifname: str

    def describe(self) -> str:
        return f"{self.ns}: ip link set {self.ifname} up"


@dataclass(frozen=True)
class AddRoute(Operation):
    dst: str  # "default" or a CIDR
    gateway: str | None = None
    dev: str | None = None
    table: int | None = None

    def describe(self) -> str:
        via = f" via {self.gateway}" if self.gateway else ""
        dev = f" dev {self.dev}" if self.dev else ""
        table = f" table {self.table}" if self.table is not None else ""
        return f"{self.ns}: ip route add {self.dst}{via}{dev}{table}"


@dataclass(frozen=True)
class AddRule(Operation):
    iif: str
    table: int
    priority: int

    def describe(self) -> str:
        return f"{self.ns}: ip rule add iif {self.iif} lookup {self.table} priority {self.priority}"


@dataclass(frozen=True)
class Sysctl(Operation):
    key: str  # net.* only: the per-namespace part of /proc/sys
    value: str

    def describe(self) -> str:
        return f"{self.ns}: sysctl -w {self.key}={self.value}"


@dataclass(frozen=True)
class HtbRoot(Operation):
    ifname: str

    def describe(self) -> str:
        return f"{self.ns}: tc qdisc add dev {self.ifname} root handle {fmt_handle(HTB_ROOT)} htb default 0"


@dataclass(frozen=True)
class HtbClass(Operation):
    ifname: str
    classid: int
    rate_bps: int
    burst_bytes: int
    quantum: int

    verb = "add"

    def describe(self) -> str:
        return (
            f"{self.ns}: tc class {self.verb} dev {self.ifname} parent {fmt_handle(HTB_ROOT)} "
            f"classid {fmt_handle(self.classid)} htb rate {fmt_rate(self.rate_bps)} "
            f"burst {self.burst_bytes} cburst {self.burst_bytes} quantum {self.quantum}"
        )


@dataclass(frozen=True)
class ChangeHtbClass(HtbClass):
    verb = "change"


@dataclass(frozen=True)
class AddSrcFilter(Operation):
    """u32 filter at the HTB root: IPv4 source in `src_cidr` -> `classid`."""

    ifname: str
    prio: int
    src_cidr: str
    classid: int

    def describe(self) -> str:
        return (
            f"{self.ns}: tc filter add dev {self.ifname} parent {fmt_handle(HTB_ROOT)} protocol ip "
            f"prio {self.prio} u32 match ip src {self.src_cidr} flowid {fmt_handle(self.classid)}"
        )


@dataclass(frozen=True)
class BfifoLeaf(Operation):
    ifname: str
    parent: int
    limit_bytes: int

    @property
    def handle(self) -> int:
        return leaf_handle(self.parent)

    def describe(self) -> str:
        return (
            f"{self.ns}: tc qdisc add dev {self.ifname} parent {fmt_handle(self.parent)} "
            f"handle {fmt_handle(self.handle)} bfifo limit {self.limit_bytes}"
        )


@dataclass(frozen=True)
class NetemLeaf(Operation):
    ifname: str
    parent: int
    delay_s: float
    jitter_s: float
    loss: float  # fraction
    loss_correlation: float  # fraction
    limit_packets: int
    # netem's own rate: with one, netem releases packets in arrival order (each one no earlier than
    # the one before it plus its serialisation time), as the delay line and a real path do; without,
    # jitter larger than the packet spacing reorders them. HTB above still does the shaping.
    rate_bps: int | None = None

    verb = "add"

    @property
    def handle(self) -> int:
        return leaf_handle(self.parent)

    def describe(self) -> str:
        if self.loss and self.loss_correlation:
            # What the executor sends: the Gilbert chain of the profile's loss and correlation.
            p, c = self.loss, self.loss_correlation
            loss = f"loss gemodel {(1 - c) * p * 100:.4g}% {(1 - c) * (1 - p) * 100:.4g}% 100% 0%"
        else:
            loss = f"loss {self.loss * 100:g}%"
        rate = f" rate {fmt_rate(self.rate_bps)}" if self.rate_bps is not None else ""
        return (
            f"{self.ns}: tc qdisc {self.verb} dev {self.ifname} parent {fmt_handle(self.parent)} "
            f"handle {fmt_handle(self.handle)} netem delay {self.delay_s * 1e3:g}ms {self.jitter_s * 1e3:g}ms "
            f"{loss} limit {self.limit_packets}{rate}"
        )


@dataclass(frozen=True)
class ChangeNetem(NetemLeaf):
    verb = "change"


def leaf_handle(parent: int) -> int:
    """Leaf qdisc under class 1:X gets handle X: (never 1:, since X >= 0x10)."""
    return (parent & 0xFFFF) << 16


def class_id(src: DCNet) -> int:
    return HTB_ROOT | (CLASS_MINOR_BASE + src.index)


def tc_queue_packets(queue_bytes: int, mtu: int) -> int:
    """A byte budget as a packet limit for packet-counting queues (netem, TUN ring)."""
    return max(math.ceil(queue_bytes / mtu), MIN_QUEUE_PACKETS)


def netem_limit_packets(p: LinkParams, mtu: int) -> int:
    """netem holds every packet for its delay before HTB may dequeue it, so its limit must cover
    the one-way delay's worth of traffic at the link rate on top of the bottleneck queue."""
    in_flight = p.rate_bps / 8 * (p.delay_s + p.jitter_s)
    return tc_queue_packets(int(in_flight) + p.queue_bytes, mtu)


def htb_burst_bytes(rate_bps: float, mtu: int) -> int:
    """At least ~1 ms of rate and a few packets (GSO skbs of 64 KiB included); pyroute2's default
    (rate/HZ + mtu with HZ read as 1e9) is a few bytes and caps throughput well below the rate."""
    return max(int(rate_bps / 8 / 1000), 3 * mtu, 2 * GSO_MAX)


def htb_quantum(mtu: int) -> int:
    """Explicit DRR quantum of one largest skb (DESIGN: without one, a 5 Gbit/s class reached 4.09)."""
    return max(mtu, GSO_MAX)


def tun_qlen(topo: Topology) -> int:
    """The TUN ring (= txqueuelen) must hold a bandwidth-delay product of MTU-size packets or
    TCP sees drops the profile never asked for (DESIGN pitfall)."""
    bdp = max((p.bdp_bytes for p in topo.links.values()), default=0)
    return max(MIN_TUN_QLEN, tc_queue_packets(bdp, topo.mtu))


def _wan_sysctls(topo: Topology) -> list[Operation]:
    ops: list[Operation] = [Sysctl(topo.wan_ns, "net.ipv4.ip_forward", "1")]
    if topo.method == "fallback":
        # Packets re-enter from tun0 with DC source addresses whose reverse route is dc{i}:
        # strict reverse-path filtering would drop them. `default` first, so the interfaces
        # created afterwards inherit 0.
        ops += [Sysctl(topo.wan_ns, f"net.ipv4.conf.{k}.rp_filter", "0") for k in ("all", "default")]
    return ops


def host_sysctls(topo: Topology) -> list[tuple[str, str]]:
    """TCP settings applied in every host namespace (also usable with nsexec --sysctl).

    Congestion control is not among them: outside the initial namespace the kernel lets the
    default be set only to algorithms in the host's tcp_allowed_congestion_control (EPERM
    otherwise), so the KV transport sets it per socket (TCP_CONGESTION) instead."""
    tcp = topo.tcp
    out: list[tuple[str, str]] = []
    if tcp.rmem_max is not None:
        out.append(("net.ipv4.tcp_rmem", f"4096 131072 {tcp.rmem_max}"))
    if tcp.wmem_max is not None:
        out.append(("net.ipv4.tcp_wmem", f"4096 16384 {tcp.wmem_max}"))
    return out


def plan_base(topo: Topology) -> list[Operation]:
    """Namespaces, wiring, addresses and routes: a routed network with no shaping."""
    ops: list[Operation] = [AddNetns(ns) for ns in topo.namespaces()]
    ops += _wan_sysctls(topo)
    mtu = topo.mtu
    for d in topo.dcs:
        ops += [
            AddBridge(d.switch_ns, BRIDGE_IF),
            AddVeth(topo.wan_ns, d.wan_ifname, d.switch_ns, UPLINK_IF),
            SetMaster(d.switch_ns, UPLINK_IF, BRIDGE_IF),
            SetMtu(topo.wan_ns, d.wan_ifname, mtu),
            SetMtu(d.switch_ns, UPLINK_IF, mtu),
        ]
        for h in topo.hosts_in(d.name):
            port = port_ifname(h.index)
            ops += [
                AddVeth(h.netns, HOST_IF, d.switch_ns, port),
                SetMaster(d.switch_ns, port, BRIDGE_IF),
                SetMtu(h.netns, HOST_IF, mtu),
                SetMtu(d.switch_ns, port, mtu),
            ]
        # After the ports: a bridge's MTU is capped by its ports'.
        ops.append(SetMtu(d.switch_ns, BRIDGE_IF, mtu))
    for d in topo.dcs:
        ops.append(AddAddress(topo.wan_ns, d.wan_ifname, f"{d.gateway}/{d.prefixlen}"))
    for h in topo.hosts:
        ops.append(AddAddress(h.netns, HOST_IF, f"{h.ip}/{topo.dc(h.dc).prefixlen}"))
    ops += [LinkUp(ns, "lo") for ns in topo.namespaces()]
    for d in topo.dcs:
        ops += [LinkUp(topo.wan_ns, d.wan_ifname), LinkUp(d.switch_ns, UPLINK_IF), LinkUp(d.switch_ns, BRIDGE_IF)]
        for h in topo.hosts_in(d.name):
            ops += [LinkUp(d.switch_ns, port_ifname(h.index)), LinkUp(h.netns, HOST_IF)]
    for h in topo.hosts:
        ops.append(AddRoute(h.netns, "default", gateway=h.gateway))
    sysctls = host_sysctls(topo)
    for h in topo.hosts:
        ops += [Sysctl(h.netns, k, v) for k, v in sysctls]
    return ops


def plan_link(topo: Topology, src: str, dst: str, params: LinkParams, leaf: Leaf) -> list[Operation]:
    """Class, source filter and leaf for one direction (the HTB root on dc{dst} must exist)."""
    s, d = topo.dc(src), topo.dc(dst)
    cid = class_id(s)
    ops: list[Operation] = [
        HtbClass(
            topo.wan_ns,
            d.wan_ifname,
            cid,
            round(params.rate_bps),
            htb_burst_bytes(params.rate_bps, topo.mtu),
            htb_quantum(topo.mtu),
        ),
        AddSrcFilter(topo.wan_ns, d.wan_ifname, 1 + s.index, s.subnet, cid),
    ]
    if leaf == "netem":
        ops.append(
            NetemLeaf(
                topo.wan_ns,
                d.wan_ifname,
                cid,
                params.delay_s,
                params.jitter_s,
                params.loss,
                params.loss_correlation,
                netem_limit_packets(params, topo.mtu),
                round(params.rate_bps),
            )
        )
    else:
        ops.append(BfifoLeaf(topo.wan_ns, d.wan_ifname, cid, params.queue_bytes))
    return ops


def plan_shaping(topo: Topology, leaf: Leaf) -> list[Operation]:
    """Kernel shaping of every link in `topo.links`: HTB rate plus a netem or bfifo leaf.
    (With "bfifo" and no delay line this is a rate-only shaper, usable on any topology.)"""
    ops: list[Operation] = []
    for d in topo.dcs:
        incoming = [(src, p) for (src, dst), p in topo.links.items() if dst == d.name]
        if not incoming:
            continue
        ops.append(HtbRoot(topo.wan_ns, d.wan_ifname))
        for src, p in sorted(incoming, key=lambda sp: topo.dc(sp[0]).index):
            ops += plan_link(topo, src, d.name, p, leaf)
    return ops


def plan_delay_line(topo: Topology) -> list[Operation]:
    """TUN, policy routing and rp_filter so every inter-DC packet visits the userspace delay line:
    in from dc{i} -> table 100 -> tun0 -> delay line -> back into tun0 -> main table -> dc{j}."""
    w = topo.wan_ns
    ops: list[Operation] = [
        AddTun(w, TUN_IF),
        SetMtu(w, TUN_IF, topo.mtu),
        SetTxQueueLen(w, TUN_IF, tun_qlen(topo)),
        Sysctl(w, f"net.ipv4.conf.{TUN_IF}.rp_filter", "0"),
        LinkUp(w, TUN_IF),
        AddRoute(w, "default", dev=TUN_IF, table=DELAY_TABLE),
    ]
    ops += [AddRule(w, d.wan_ifname, DELAY_TABLE, RULE_PRIORITY_BASE + d.index) for d in topo.dcs]
    return ops


def plan_up(topo: Topology) -> list[Operation]:
    ops = plan_base(topo)
    if topo.method == "netem":
        ops += plan_shaping(topo, "netem")
    elif topo.method == "fallback":
        ops += plan_shaping(topo, "bfifo") + plan_delay_line(topo)
    return ops


def plan_change(
    topo: Topology, src: str, dst: str, params: LinkParams, method: Method | None = None
) -> list[Operation]:
    """Runtime change of one direction: rate always (HTB class), delay/jitter/loss for netem.
    With "fallback" the delay line owns delay/jitter/loss; with "none" nothing is shaped."""
    method = method or topo.method
    if method == "none":
        return []
    if (src, dst) not in topo.links:
        raise ValueError(f"link ({src}, {dst}) is not shaped in topology {topo.prefix} (links: {sorted(topo.links)})")
    s, d = topo.dc(src), topo.dc(dst)
    cid = class_id(s)
    ops: list[Operation] = [
        ChangeHtbClass(
            topo.wan_ns,
            d.wan_ifname,
            cid,
            round(params.rate_bps),
            htb_burst_bytes(params.rate_bps, topo.mtu),
            htb_quantum(topo.mtu),
        ),
    ]
    if method == "netem":
        ops.append(
            ChangeNetem(
                topo.wan_ns,
                d.wan_ifname,
                cid,
                params.delay_s,
                params.jitter_s,
                params.loss,
                params.loss_correlation,
                netem_limit_packets(params, topo.mtu),
                round(params.rate_bps),
            )
        )
    return ops
