"""The drop counters along one shaped direction, read as one snapshot for the loss account
(testbed.net.loss_account): every interface's dropped counts in the namespaces the probes
cross, the leaf qdiscs of the shaped interface (netem's drops are the loss model's; a bfifo's
are the bottleneck queue's), the UDP counters of the sending and receiving namespaces
(/proc/net/snmp: SndbufErrors, InErrors), and with the delay line its own counts.

The reading goes through a `CounterReader` (netlink handles, /proc, the delay line's control
socket); tests hand `read_path` a fake one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from testbed.net.loss_account import Counter, Snapshot, Stage
from testbed.net.nsthread import run_in_netns
from testbed.net.plan import TUN_IF, fmt_handle
from testbed.net.topology import Method, Topology


@dataclass(frozen=True)
class IfDrops:
    ifname: str
    rx_dropped: int
    tx_dropped: int


@dataclass(frozen=True)
class QdiscDrops:
    ifname: str
    kind: str
    handle: int
    drops: int


class CounterReader(Protocol):
    def interfaces(self, ns: str) -> list[IfDrops]: ...
    def qdiscs(self, ns: str, ifname: str) -> list[QdiscDrops]: ...
    def udp(self, ns: str) -> Mapping[str, int]: ...
    def delay_line(self) -> Mapping[str, Any] | None:
        """The delay line's `stats` reply (None: no delay line on this path)."""


@dataclass(frozen=True)
class PathLayout:
    """Where one direction's probes go, in the order they go there."""

    src_ns: str
    src_switch_ns: str
    wan_ns: str
    wan_in: str  # the WAN router's interface towards the source DC
    wan_out: str  # the shaped interface, towards the destination DC
    dst_switch_ns: str
    dst_ns: str
    method: Method
    direction: str  # the delay line's name of the direction, "SRC->DST"


def layout_for(topo: Topology, src_host: str, dst_host: str) -> PathLayout:
    a, b = topo.host(src_host), topo.host(dst_host)
    da, db = topo.dc(a.dc), topo.dc(b.dc)
    return PathLayout(
        a.netns,
        da.switch_ns,
        topo.wan_ns,
        da.wan_ifname,
        db.wan_ifname,
        db.switch_ns,
        b.netns,
        topo.method,
        f"{a.dc}->{b.dc}",
    )


def read_path(r: CounterReader, p: PathLayout) -> Snapshot:
    """One snapshot of the direction's drop counters, each with the stage it sits at."""
    out: dict[str, Counter] = {}

    def put(stage: Stage, place: str, value: int) -> None:
        out[place] = Counter(stage, place, int(value))

    sides: tuple[tuple[str, Stage], ...] = (
        (p.src_ns, "before"),
        (p.src_switch_ns, "before"),
        (p.dst_switch_ns, "after"),
        (p.dst_ns, "after"),
    )
    for ns, stage in sides:
        for i in r.interfaces(ns):
            put(stage, f"{ns} {i.ifname} rx_dropped", i.rx_dropped)
            put(stage, f"{ns} {i.ifname} tx_dropped", i.tx_dropped)
    for i in r.interfaces(p.wan_ns):
        if i.ifname == p.wan_in:
            put("before", f"{p.wan_ns} {i.ifname} rx_dropped", i.rx_dropped)
        elif i.ifname == p.wan_out:
            put("after", f"{p.wan_ns} {i.ifname} tx_dropped", i.tx_dropped)
        elif i.ifname == TUN_IF:
            # Into the delay line (its ring full: before the model) and back out of it.
            put("before", f"{p.wan_ns} {i.ifname} tx_dropped", i.tx_dropped)
            put("after", f"{p.wan_ns} {i.ifname} rx_dropped", i.rx_dropped)
    for q in r.qdiscs(p.wan_ns, p.wan_out):
        if q.kind == "netem":
            put("model", f"netem {fmt_handle(q.handle)} on {q.ifname} drops", q.drops)
        elif q.kind != "htb":  # HTB counts its leaves' drops again
            put("after", f"{q.kind} {fmt_handle(q.handle)} on {q.ifname} drops", q.drops)
    put("before", f"{p.src_ns} Udp SndbufErrors", r.udp(p.src_ns).get("SndbufErrors", 0))
    put("after", f"{p.dst_ns} Udp InErrors", r.udp(p.dst_ns).get("InErrors", 0))
    if p.method == "fallback":
        stats = r.delay_line()
        d = (stats or {}).get("directions", {}).get(p.direction)
        if d is None:
            raise OSError(f"the delay line reports no direction {p.direction}")
        put("model", f"delay line {p.direction} packets_dropped", d["packets_dropped"])
        put("after", f"delay line {p.direction} write_errors", d["write_errors"])
    return out


def parse_snmp(text: str, proto: str = "Udp") -> dict[str, int]:
    """/proc/net/snmp: a header line and a value line per protocol."""
    rows = [line.split() for line in text.splitlines() if line.startswith(proto + ":")]
    if len(rows) < 2:
        return {}
    return {k: int(v) for k, v in zip(rows[0][1:], rows[1][1:])}


def _read_snmp() -> str:
    # thread-self: /proc/net follows the process's namespace, this thread is in another.
    return Path("/proc/thread-self/net/snmp").read_text()


class NetlinkReader:
    """The kernel's counters through netlink handles (`handle(ns)`, e.g. Executor.handle) and
    /proc read from a thread inside each namespace; the delay line through `delay_line_stats`."""

    def __init__(
        self, handle: Callable[[str], Any], delay_line_stats: Callable[[], Mapping[str, Any]] | None = None
    ) -> None:
        self._handle = handle
        self._delay_line = delay_line_stats

    def interfaces(self, ns: str) -> list[IfDrops]:
        out = []
        for msg in self._handle(ns).get_links():
            st = msg.get_attr("IFLA_STATS64") or msg.get_attr("IFLA_STATS")
            if st is not None:
                out.append(IfDrops(msg.get_attr("IFLA_IFNAME"), int(st["rx_dropped"]), int(st["tx_dropped"])))
        return out

    def qdiscs(self, ns: str, ifname: str) -> list[QdiscDrops]:
        h = self._handle(ns)
        idx = h.link_lookup(ifname=ifname)
        if not idx:
            raise OSError(f"{ns}: no interface {ifname}")
        out = []
        for q in h.get_qdiscs(index=idx[0]):
            drops = None
            s2 = q.get_attr("TCA_STATS2")
            if s2 is not None and s2.get_attr("TCA_STATS_QUEUE") is not None:
                drops = s2.get_attr("TCA_STATS_QUEUE")["drops"]
            elif q.get_attr("TCA_STATS") is not None:
                drops = q.get_attr("TCA_STATS")["drops"]
            if drops is None:
                raise OSError(f"{ns}: qdisc {fmt_handle(q['handle'])} on {ifname} reports no drop count")
            out.append(QdiscDrops(ifname, str(q.get_attr("TCA_KIND")), int(q["handle"]), int(drops)))
        return out

    def udp(self, ns: str) -> Mapping[str, int]:
        return parse_snmp(run_in_netns(ns, _read_snmp))

    def delay_line(self) -> Mapping[str, Any] | None:
        return self._delay_line() if self._delay_line is not None else None
