"""The WAN router inside a container: the same shaping plan as the netns backend, applied to the
container's own namespace (namespace name ""), then the delay line in the foreground.

Docker attaches one interface per datacenter network in no fixed order; each is found by the
address the compose file gave it (or, in a swarm, where addresses are not static, by the
network's fixed subnet) and renamed `dc{index}`, so the plan's interface names hold.
Sysctls (ip_forward, rp_filter) come from the compose file: /proc/sys is read-only in a container.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import json
import os
import signal
import stat
import sys
from pathlib import Path
from typing import TypedDict

from pyroute2 import IPRoute  # type: ignore[import-untyped]

from testbed.core.json_types import JSONObject
from testbed.core.schema.linkprofile import LinkParams, TcpSettings
from testbed.net.capabilities import choose_method, probe_shaping
from testbed.net.executor import Executor, NetError
from testbed.net.plan import HTB_ROOT, AddTun, HtbClass, HtbRoot, NetemLeaf, Sysctl, plan_delay_line, plan_shaping
from testbed.net.topology import DCNet, Topology, dc_ifname
from testbed.net.tun import TUN_DEVICE

HERE = ""  # the executor's name for the current namespace
TUN_DEV = os.makedev(10, 200)


class WanDC(TypedDict):
    name: str
    index: int
    subnet: str
    address: str  # blank until found by subnet (swarm)


class WanLink(TypedDict):
    """`LinkParams` as JSON."""

    rate_bps: float
    delay_s: float
    jitter_s: float
    loss: float
    loss_correlation: float
    queue_bytes: int
    mtu: int | None


class WanConfig(TypedDict):
    """The WAN router container's JSON (`wan_config`), as the container reads it."""

    prefix: str
    method: str
    mtu: int
    control: str
    stats: str | None
    ready: str
    dcs: list[WanDC]
    links: dict[str, WanLink]  # "a->b"


def wan_config(
    prefix: str,
    dcs: list[tuple[str, str, str]],
    links: dict[tuple[str, str], LinkParams],
    method: str,
    mtu: int,
    control: str,
    stats: str | None,
    ready: str,
) -> JSONObject:
    """JSON the compose backend writes for the WAN router container. dcs: (name, subnet, address)."""
    return {
        "prefix": prefix,
        "method": method,
        "mtu": mtu,
        "control": control,
        "stats": stats,
        "ready": ready,
        "dcs": [{"name": n, "index": i, "subnet": s, "address": a} for i, (n, s, a) in enumerate(dcs)],
        "links": {f"{a}->{b}": dataclasses.asdict(p) for (a, b), p in links.items()},
    }


def topology_from_config(cfg: WanConfig, method: str) -> Topology:
    dcs = tuple(DCNet(d["name"], int(d["index"]), d["subnet"], HERE, d["address"]) for d in cfg["dcs"])
    links = {}
    for key, p in cfg["links"].items():
        a, b = key.split("->")
        links[(a, b)] = LinkParams(**p)
    return Topology(cfg["prefix"], dcs, (), HERE, links, method, int(cfg["mtu"]), TcpSettings())  # type: ignore[arg-type]


def addresses_by_subnet(dcs: list[WanDC]) -> list[WanDC]:
    """`dcs` with each "address" set to this namespace's IPv4 address inside the DC's subnet."""
    subnets = {d["name"]: ipaddress.ip_network(d["subnet"]) for d in dcs}
    found: dict[str, str] = {}
    with IPRoute() as ipr:
        for a in ipr.get_addr(family=2):
            ip = ipaddress.ip_address(a.get_attr("IFA_ADDRESS"))
            found.update({n: str(ip) for n, net in subnets.items() if ip in net})
    missing = [n for n in subnets if n not in found]
    if missing:
        raise RuntimeError(
            f"no interface in the subnet of {', '.join(missing)} "
            f"({', '.join(str(subnets[n]) for n in missing)}): is the service attached to every DC network?"
        )
    return [{**d, "address": found[d["name"]]} for d in dcs]


def ensure_tun_device(path: str = TUN_DEVICE) -> None:
    """Create /dev/net/tun when the runtime did not pass it in (`docker stack deploy` ignores
    `devices`). Needs CAP_MKNOD (in Docker's default set) and a device cgroup that allows c 10:200
    (runc's default list has it, except runc 1.2.0-1.2.3); both give EPERM, so the error names both."""
    if os.path.exists(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.mknod(path, 0o600 | stat.S_IFCHR, TUN_DEV)
        os.close(os.open(path, os.O_RDWR))
    except OSError as e:
        raise RuntimeError(
            f"cannot create {path} (c 10:200): {e.strerror}; the container needs CAP_MKNOD and a "
            "device cgroup that allows c 10:200 rwm"
        ) from e


def probe_netem() -> bool:
    """netem under an HTB class on a throwaway TUN in this namespace: what the kernel of the host
    this container landed on supports (in a swarm that need not be the manager's kernel)."""
    dev = "probe0"
    cls = HTB_ROOT | 0x10
    try:
        with Executor() as ex:
            ex.apply(
                [
                    AddTun(HERE, dev),
                    HtbRoot(HERE, dev),
                    HtbClass(HERE, dev, cls, 100_000_000, 200_000, 65536),
                    NetemLeaf(HERE, dev, cls, 0.001, 0.0, 0.0, 0.0, 1000),
                ]
            )
        return True
    except NetError as e:
        if e.errno == errno.ENOENT:  # "Specified qdisc kind is unknown"
            return False
        raise
    finally:
        with IPRoute() as ipr:
            for idx in ipr.link_lookup(ifname=dev):
                ipr.link("del", index=idx)


def rename_interfaces(dcs: list[WanDC], mtu: int) -> None:
    """Give the interface holding each DC address the plan's name, and the emulation's MTU."""
    with IPRoute() as ipr:
        for d in dcs:
            idx = None
            for a in ipr.get_addr(family=2):
                if a.get_attr("IFA_ADDRESS") == d["address"]:
                    idx = a["index"]
            if idx is None:
                raise RuntimeError(f"no interface holds {d['address']} (datacenter {d['name']})")
            want = dc_ifname(int(d["index"]))
            ipr.link("set", index=idx, state="down")
            ipr.link("set", index=idx, ifname=want, mtu=mtu)
            ipr.link("set", index=idx, state="up")


def healthy(ready: Path) -> bool:
    """Shaping applied and, with the delay line, its control socket bound (it binds it last)."""
    try:
        what = ready.read_text().strip()
    except OSError:
        return False
    return not what.startswith("/") or os.path.exists(what)


def apply_shaping(cfg: WanConfig, method: str) -> Topology:
    """Rename the DC interfaces and apply the shaping plan here (the delay line process is the caller's)."""
    topo = topology_from_config(cfg, method)
    rename_interfaces(cfg["dcs"], topo.mtu)
    ops = plan_shaping(topo, "netem" if method == "netem" else "bfifo")
    if method == "fallback":
        ops += plan_delay_line(topo)
    with Executor() as ex:
        ex.apply([op for op in ops if not isinstance(op, Sysctl)])
    print(f"wan router: method {method}, {len(topo.links)} shaped directions, MTU {topo.mtu}", flush=True)
    return topo


def delayline_argv(cfg: WanConfig, topo: Topology) -> list[str]:
    """Write the delay line's config next to the ready file; the command that runs it on tun0."""
    from testbed.net.delayline import write_config
    from testbed.net.wanrouter import delayline_directions

    dl_cfg = Path(cfg["ready"]).with_name("delayline.json")
    write_config(dl_cfg, delayline_directions(topo))
    argv = [
        sys.executable,
        "-m",
        "testbed.net.delayline",
        "--tun",
        "tun0",
        "--config",
        str(dl_cfg),
        "--control",
        cfg["control"],
    ]
    stats = cfg.get("stats")
    if stats:
        argv += ["--stats", stats]
    return argv


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) == 2 and args[0] == "--health":
        return 0 if healthy(Path(args[1])) else 1
    if len(args) != 1:
        print("usage: python -m testbed.net.container_wan CONFIG.json | --health READY_FILE", file=sys.stderr)
        return 2
    cfg = json.loads(Path(args[0]).read_text())
    # The host probed the kernel (containers share it, but cannot create a probe namespace).
    method = cfg.get("method", "auto")
    if method not in ("netem", "fallback"):
        method = choose_method(probe_shaping(), method)
    topo = apply_shaping(cfg, method)
    ready = Path(cfg["ready"])
    if method != "fallback":
        ready.write_text(method)
        signal.sigwait({signal.SIGTERM, signal.SIGINT})
        return 0
    argv2 = delayline_argv(cfg, topo)
    ready.write_text(cfg["control"])
    os.execv(sys.executable, argv2)


if __name__ == "__main__":
    sys.exit(main())
