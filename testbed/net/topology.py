"""Emulated network as data: DCs, hosts, the WAN router, link parameters (pure, no I/O).

Layout (one network namespace per box)::

    host ns (eth0 10.231.i.{10+k}/24) --veth-- DC switch ns (br0) --veth(up)-- WAN ns (dc{i} 10.231.i.1/24)

The WAN router namespace forwards between DCs; shaping sits on its egress interface `dc{j}`
toward the destination DC. Every namespace is `{prefix}-{short}` so teardown can find them all.
"""

from __future__ import annotations

import ipaddress
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from testbed.core.schema.linkprofile import LinkParams, TcpSettings

Method = Literal["netem", "fallback", "none"]
METHODS: tuple[Method, ...] = ("netem", "fallback", "none")

PREFIX_RE = re.compile(r"^ptb[0-9a-z]{1,12}$")
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]*$", re.I)
# Linux IFNAMSIZ is 16 including the NUL.
IFNAME_MAX = 15
# The userspace delay line's per-packet cost caps throughput near 1 Gbit/s at MTU 1500 (DESIGN).
FALLBACK_MTU = 65000
DEFAULT_MTU = 1500
MAX_MTU = 65535
HOST_FIRST = 10
HOST_IF = "eth0"
BRIDGE_IF = "br0"
UPLINK_IF = "up"


def dc_ifname(index: int) -> str:
    """WAN router interface toward DC `index` (egress into that DC)."""
    return f"dc{index}"


def port_ifname(k: int) -> str:
    """DC switch port toward the DC's k-th host."""
    return f"h{k}"


@dataclass(frozen=True)
class Host:
    name: str
    dc: str
    netns: str
    ip: str  # bare address; the prefix length is the DC subnet's
    gateway: str
    index: int = 0  # position inside its DC: switch port h{index}

    @property
    def ifname(self) -> str:
        return HOST_IF


@dataclass(frozen=True)
class DCNet:
    name: str
    index: int
    subnet: str  # e.g. 10.231.0.0/24
    switch_ns: str
    gateway: str  # the WAN router's address on dc{index}

    @property
    def prefixlen(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen

    @property
    def wan_ifname(self) -> str:
        return dc_ifname(self.index)


@dataclass(frozen=True)
class Topology:
    prefix: str
    dcs: tuple[DCNet, ...]
    hosts: tuple[Host, ...]
    wan_ns: str
    links: dict[tuple[str, str], LinkParams]  # directional: (src_dc, dst_dc) -> traffic from src to dst
    method: Method
    mtu: int
    tcp: TcpSettings = field(default_factory=TcpSettings)

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host {name!r} in topology {self.prefix} (hosts: {', '.join(h.name for h in self.hosts)})")

    def dc(self, name: str) -> DCNet:
        for d in self.dcs:
            if d.name == name:
                return d
        raise KeyError(f"no datacenter {name!r} in topology {self.prefix} (DCs: {', '.join(d.name for d in self.dcs)})")

    def hosts_in(self, dc: str) -> tuple[Host, ...]:
        return tuple(h for h in self.hosts if h.dc == dc)

    def namespaces(self) -> list[str]:
        """All namespaces, WAN router first, then DC switches, then hosts (creation order)."""
        return [self.wan_ns, *(d.switch_ns for d in self.dcs), *(h.netns for h in self.hosts)]


def new_prefix() -> str:
    """A fresh run prefix: `ptb` + 4 hex chars."""
    return "ptb" + secrets.token_hex(2)


def default_mtu(method: Method) -> int:
    return FALLBACK_MTU if method == "fallback" else DEFAULT_MTU


def _check_name(kind: str, name: str) -> None:
    if not _NAME_RE.match(name):
        raise ValueError(f"{kind} name {name!r}: use letters, digits, '-', '_' and '.'")


def build_topology(
    prefix: str,
    hosts: list[tuple[str, str]],
    links: Mapping[tuple[str, str], LinkParams],
    method: Method,
    mtu: int | None = None,
    tcp: TcpSettings | None = None,
    base: str = "10.231",
) -> Topology:
    """Hosts are (name, dc) pairs; DCs are numbered in order of first appearance and get
    `{base}.{index}.0/24`. MTU: the explicit argument, else the smallest profile MTU among the
    links, else 65000 for "fallback" and 1500 otherwise."""
    if not PREFIX_RE.match(prefix):
        raise ValueError(f"prefix {prefix!r}: must be 'ptb' followed by up to 12 lowercase letters/digits")
    if method not in METHODS:
        raise ValueError(f"method {method!r}: one of {', '.join(METHODS)}")
    if not hosts:
        raise ValueError("a topology needs at least one host")
    octets = base.split(".")
    if len(octets) != 2 or not all(o.isdigit() and 0 <= int(o) <= 255 for o in octets):
        raise ValueError(f"base {base!r}: two octets like '10.231'")

    dc_names: list[str] = []
    for _, dc in hosts:
        _check_name("datacenter", dc)
        if dc not in dc_names:
            dc_names.append(dc)
    if len(dc_names) > 256:
        raise ValueError(f"{len(dc_names)} datacenters: at most 256 fit in {base}.0.0/16")
    dcs = tuple(
        DCNet(name=n, index=i, subnet=f"{base}.{i}.0/24", switch_ns=f"{prefix}-sw-{n}", gateway=f"{base}.{i}.1")
        for i, n in enumerate(dc_names)
    )
    by_name = {d.name: d for d in dcs}

    per_dc: dict[str, int] = {}
    out_hosts: list[Host] = []
    for name, dc in hosts:
        _check_name("host", name)
        k = per_dc.get(dc, 0)
        per_dc[dc] = k + 1
        if HOST_FIRST + k > 254:
            raise ValueError(f"datacenter {dc!r}: more than {255 - HOST_FIRST} hosts do not fit in a /24")
        d = by_name[dc]
        out_hosts.append(
            Host(
                name=name,
                dc=dc,
                netns=f"{prefix}-{name}",
                ip=f"{base}.{d.index}.{HOST_FIRST + k}",
                gateway=d.gateway,
                index=k,
            )
        )

    wan_ns = f"{prefix}-wan"
    names = [wan_ns, *(d.switch_ns for d in dcs), *(h.netns for h in out_hosts)]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(
            f"namespace names collide: {', '.join(dup)} (host names must be unique and not 'wan' or 'sw-<dc>')"
        )

    for src, dst in links:
        for end in (src, dst):
            if end not in by_name:
                raise ValueError(f"link ({src}, {dst}): unknown datacenter {end!r} (DCs: {', '.join(dc_names)})")
        if src == dst:
            raise ValueError(
                f"link ({src}, {dst}): intra-DC traffic never crosses the WAN router, so it cannot be shaped here"
            )

    if mtu is None:
        profile_mtus = [p.mtu for p in links.values() if p.mtu is not None]
        mtu = min(profile_mtus) if profile_mtus else default_mtu(method)
    if not 576 <= mtu <= MAX_MTU:
        raise ValueError(f"mtu {mtu}: must be within 576..{MAX_MTU}")

    return Topology(
        prefix=prefix,
        dcs=dcs,
        hosts=tuple(out_hosts),
        wan_ns=wan_ns,
        links=dict(links),
        method=method,
        mtu=mtu,
        tcp=tcp if tcp is not None else TcpSettings(),
    )
