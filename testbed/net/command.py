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

    lc = sub.add_parser("linkcheck", help="build one shaped link and measure RTT, goodput and loss against the profile")
    lc.add_argument("profile", help="link profile name (netem_profiles/NAME.yaml) or path")
    lc.add_argument("--speedup", type=float, default=1.0, help="time scale s (default 1)")
    g = lc.add_mutually_exclusive_group()
    g.add_argument("--byte-scale", type=float, help="byte scale b: wire rate = rate / b * s")
    g.add_argument("--wire-rate", default="1gbit", help="choose b so the wire rate is this (default 1gbit)")
    lc.add_argument("--connections", type=int, default=4, help="connections for the multi-connection goodput")
    lc.add_argument("--duration", type=float, default=4.0, help="wire seconds per goodput measurement")
    lc.add_argument("--method", choices=["auto", "netem", "fallback"], default="auto")
    lc.add_argument("--json", action="store_true", help="print JSON")
    lc.set_defaults(func=cmd_linkcheck)


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


def cmd_linkcheck(args: argparse.Namespace) -> int:
    from testbed.core.linkprofile import parse_rate
    from testbed.linkprofiles import ProfileError, load_profile
    from testbed.net.linkcheck import main_linkcheck, scale_for

    if not _need_root():
        return 1
    try:
        profile = load_profile(args.profile)
    except ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    wire = None if args.byte_scale is not None else parse_rate(args.wire_rate)
    scale = scale_for(profile, args.speedup, args.byte_scale, wire)
    return main_linkcheck(profile, scale, args.connections, args.duration, args.method, args.json)
