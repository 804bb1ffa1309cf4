"""`testbed down` (remove a run's namespaces and processes) and `testbed netcaps` (what shaping
this kernel supports)."""

from __future__ import annotations

import argparse
import json
import os
import sys


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = sub.add_parser("down", help="remove what testbed runs left: namespaces, processes, containers, networks",
                       description="Idempotent: stops processes inside every namespace whose name starts with "
                                   "PREFIX, deletes the namespaces (and with them veths, TUNs, qdiscs), and removes "
                                   "the containers, networks and volumes of compose runs labelled with PREFIX.")
    d.add_argument("--prefix", default="ptb", help="namespace name prefix (default: ptb = every run)")
    d.add_argument("--json", action="store_true", help="print what was removed as JSON")
    d.set_defaults(func=cmd_down)

    c = sub.add_parser("netcaps", help="probe which link shaping this kernel supports (netem, HTB, TUN)")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(func=cmd_netcaps)


def _need_root() -> bool:
    if os.geteuid() != 0:
        print("error: network namespaces need root", file=sys.stderr)
        return False
    return True


def cmd_down(args: argparse.Namespace) -> int:
    from testbed.net.teardown import teardown

    if not _need_root():
        return 1
    try:
        report = teardown(args.prefix)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from testbed.deploy.compose import remove_project

    docker = remove_project(args.prefix)   # containers, networks, volumes of compose runs
    if args.json:
        print(json.dumps({**report.to_dict(), "docker": docker}, indent=2))
    else:
        print(report.summary())
        if any(docker.values()):
            print("docker: removed " + ", ".join(f"{len(v)} {k}" for k, v in docker.items()))
    return 1 if report.errors else 0


def cmd_netcaps(args: argparse.Namespace) -> int:
    from testbed.net.capabilities import ShapingUnavailable, choose_method, probe_shaping

    if not _need_root():
        return 1
    caps = probe_shaping()
    try:
        method: str = choose_method(caps)
    except ShapingUnavailable:
        method = "none"
    if args.json:
        print(json.dumps({**caps.to_dict(), "method": method}, indent=2))
    else:
        yes = {True: "yes", False: "no"}
        print(f"netem: {yes[caps.netem]}\nhtb:   {yes[caps.htb]}\ntun:   {yes[caps.tun]}\n"
              f"method (auto): {method}\ndetail: {caps.detail}")
    return 0
