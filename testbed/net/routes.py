"""Routes a service adds in its own namespace before serving (in a container: the other
datacenters' subnets via the WAN router container)."""

from __future__ import annotations

from pyroute2 import IPRoute  # type: ignore[import-untyped]
from pyroute2.netlink.exceptions import NetlinkError  # type: ignore[import-untyped]


def parse_route(spec: str) -> tuple[str, str]:
    if "=" not in spec:
        raise ValueError(f"route {spec!r}: expected CIDR=GATEWAY")
    dst, gw = spec.split("=", 1)
    return dst.strip(), gw.strip()


def add_routes(specs: list[str]) -> None:
    with IPRoute() as ipr:
        for spec in specs:
            dst, gw = parse_route(spec)
            try:
                ipr.route("add", dst=dst, gateway=gw)
            except NetlinkError as e:
                if e.code != 17:  # EEXIST: already there (a restarted container)
                    raise RuntimeError(f"route {dst} via {gw}: {e}") from e
