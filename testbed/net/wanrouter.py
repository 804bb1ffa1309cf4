"""The WAN router's userspace side: launching the delay line for a topology and driving it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from testbed.net.procs import ProcessGroup
from testbed.net.delayline import DirectionSpec, write_config
from testbed.net.nsexec import nsexec_argv
from testbed.net.topology import Topology

READY_TIMEOUT_S = 10.0


def delayline_directions(topo: Topology) -> list[DirectionSpec]:
    """One direction per ordered DC pair, chosen by destination subnet (with more than two DCs,
    traffic into one DC shares its delay parameters; the kernel still rates each pair)."""
    return [DirectionSpec.from_link(f"{a}->{b}", topo.dc(b).subnet, p, seed=i + 1)
            for i, ((a, b), p) in enumerate(topo.links.items())]


def control_path(prefix: str) -> Path:
    # UNIX socket paths are limited to 108 bytes: keep it short, outside any run directory.
    return Path(f"/tmp/{prefix}-delayline.sock")


def start_delayline(procs: ProcessGroup, topo: Topology, workdir: Path, stats: Path | None) -> Path:
    """Start the delay line in the WAN namespace and wait until its control socket answers
    (it binds the socket last, once the TUN is attached). Returns the control socket path."""
    cfg = workdir / "delayline.json"
    write_config(cfg, delayline_directions(topo))
    ctl = control_path(topo.prefix)
    argv = [sys.executable, "-m", "testbed.net.delayline", "--tun", "tun0", "--config", str(cfg),
            "--control", str(ctl)]
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
