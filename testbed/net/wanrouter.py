"""The WAN router's userspace side: launching the delay line for a topology and driving it."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from testbed.core.schema.linkprofile import LinkParams
from testbed.net.delayline import DirectionSpec, control, write_config
from testbed.net.executor import Executor
from testbed.net.nsexec import nsexec_argv
from testbed.net.plan import plan_change
from testbed.net.procs import ProcessGroup
from testbed.net.topology import Topology

# A process start: about a second on a host, tens of seconds in a slow guest (user-mode-linux).
READY_TIMEOUT_S = 60.0


def delayline_directions(topo: Topology) -> list[DirectionSpec]:
    """One direction per ordered DC pair, chosen by destination subnet (with more than two DCs,
    traffic into one DC shares its delay parameters; the kernel still rates each pair)."""
    return [
        DirectionSpec.from_link(f"{a}->{b}", topo.dc(b).subnet, p, seed=i + 1)
        for i, ((a, b), p) in enumerate(topo.links.items())
    ]


def control_path(prefix: str) -> Path:
    # UNIX socket paths are limited to 108 bytes: keep it short, outside any run directory.
    return Path(f"/tmp/{prefix}-delayline.sock")


def start_delayline(procs: ProcessGroup, topo: Topology, workdir: Path, stats: Path | None) -> Path:
    """Start the delay line in the WAN namespace and wait until its control socket answers
    (it binds the socket last, once the TUN is attached). Returns the control socket path."""
    cfg = workdir / "delayline.json"
    write_config(cfg, delayline_directions(topo))
    ctl = control_path(topo.prefix)
    argv = [sys.executable, "-m", "testbed.net.delayline", "--tun", "tun0", "--config", str(cfg), "--control", str(ctl)]
    if stats is not None:
        argv += ["--stats", str(stats)]
    procs.spawn("delayline", nsexec_argv(topo.wan_ns, argv))
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ctl.exists():
        if (dead := procs.dead()) is not None:
            raise RuntimeError(f"delay line exited with code {dead[1]}:\n{procs.log(dead[0])}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"delay line not ready after {READY_TIMEOUT_S:g} s:\n{procs.log('delayline')}")
        time.sleep(0.05)
    return ctl


class LinkChangeError(RuntimeError):
    pass


def change_links(
    topo: Topology,
    changes: Mapping[tuple[str, str], LinkParams],
    control_path: Path | str | None,
    netns: str | None = None,
) -> None:
    """Apply new parameters to some directions at runtime: delay, jitter and loss by the delay
    line when there is one (first: it acts at once, e.g. an outage), then the kernel's rate class
    (and netem) by netlink in the WAN router's namespace (`netns` overrides the topology's, e.g. a
    container's /proc/PID/ns/net), only where the kernel holds what changed. Updates `topo.links`
    to what is in force."""
    delay_line = topo.method == "fallback" and control_path is not None
    if delay_line:
        if set(changes) == set(topo.links) and len(set(changes.values())) == 1:
            sets = [("*", next(iter(changes.values())))]  # one message: every direction at once
        else:
            # The delay line picks a packet's direction by destination subnet, first match: with more
            # than two DCs one entry serves all traffic into `b`, so every entry into `b` is set.
            sets = [(f"{x}->{y}", p) for (a, b), p in changes.items() for (x, y) in topo.links if y == b]
        for name, p in sets:
            reply = control(
                str(control_path),
                {
                    "op": "set",
                    "direction": name,
                    "delay_s": p.delay_s,
                    "jitter_s": p.jitter_s,
                    "loss": p.loss,
                    "loss_correlation": p.loss_correlation,
                },
            )
            if not reply.get("ok"):
                raise LinkChangeError(f"delay line refused a change of {name}: {reply}")
    # With the delay line the kernel holds only the rate.
    kernel = {k: p for k, p in changes.items() if not delay_line or topo.links[k].rate_bps != p.rate_bps}
    if kernel:
        with Executor() as ex:
            for (a, b), params in kernel.items():
                ops = plan_change(topo, a, b, params)
                ex.apply([dataclasses.replace(op, ns=netns) for op in ops] if netns is not None else ops)
    topo.links.update(changes)
