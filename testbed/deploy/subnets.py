"""Which addresses a container run's datacenter networks take.

Each datacenter gets a /24 of one block `10.B.0.0/16` (`10.B.i.0/24` for the i-th). The block is
the first candidate none of whose /24s overlaps a network the Docker engine already has (another
run's, a leftover of an interrupted one, a CI runner's own) or a route of this host (a LAN or VPN
in 10.x): a fixed block made `docker-compose up` fail with "Pool overlaps with other one on this
address space" wherever it was taken. Two runs that pick the same free block at the same moment
are told apart by the engine; the backend then tries the next block (`tried`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from pathlib import Path

from testbed.deploy.base import BackendError

Net = ipaddress.IPv4Network

# Blocks of their own for each backend (netns uses 10.231) so a compose and a swarm run coexist.
COMPOSE_BASES: tuple[str, ...] = ("10.232", *(f"10.{b}" for b in range(240, 248)))
SWARM_BASES: tuple[str, ...] = ("10.234", *(f"10.{b}" for b in range(248, 256)))
POOL_OVERLAP = "Pool overlaps"  # the engine's words for a taken subnet


def dc_subnet(base: str, i: int) -> Net:
    return Net(f"{base}.{i}.0/24")


def pick_base(candidates: Sequence[str], n_dcs: int, taken: Iterable[Net], tried: Iterable[str] = ()) -> str:
    """The first candidate block whose n_dcs /24s overlap nothing taken and was not tried."""
    taken = list(taken)
    skip = set(tried)
    for base in candidates:
        if base in skip:
            continue
        if not any(dc_subnet(base, i).overlaps(t) for i in range(n_dcs) for t in taken):
            return base
    used = ", ".join(sorted({str(t) for t in taken if t.overlaps(Net("10.0.0.0/8"))})) or "none"
    raise BackendError(
        f"no free block for {n_dcs} datacenter networks among {', '.join(f'{b}.0.0/16' for b in candidates)}"
        f" (taken in 10/8: {used}); remove stale networks (`testbed down`) or free one of the blocks"
    )


def parse_proc_routes(text: str) -> list[Net]:
    """Destinations of /proc/net/route's routes (hex, little-endian), the default route left out:
    it overlaps everything and does not make an address ambiguous."""
    out: list[Net] = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 8:
            continue
        try:
            dest = ipaddress.IPv4Address(int(f[1], 16).to_bytes(4, "little"))
            mask = ipaddress.IPv4Address(int(f[7], 16).to_bytes(4, "little"))
        except ValueError:
            continue
        if int(mask) == 0:
            continue
        out.append(Net(f"{dest}/{mask}", strict=False))
    return out


def host_routes(path: Path = Path("/proc/net/route")) -> list[Net]:
    try:
        return parse_proc_routes(path.read_text())
    except OSError:
        return []


def subnets_of(ipam_configs: Iterable[dict[str, object]]) -> list[Net]:
    """IPv4 subnets of Docker networks' IPAM config entries (IPv6 ones cannot overlap ours)."""
    out: list[Net] = []
    for cfg in ipam_configs:
        sub = cfg.get("Subnet")
        if isinstance(sub, str):
            try:
                net = ipaddress.ip_network(sub, strict=False)
            except ValueError:
                continue
            if isinstance(net, Net):
                out.append(net)
    return out
