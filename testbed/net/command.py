"""`testbed netcaps` (what shaping this kernel supports) and `testbed linkcheck` (one shaped link
measured against its profile). `testbed down` lives with the deploy backends (deploy/command.py):
it removes their Docker objects too, which this layer knows nothing of."""

from __future__ import annotations

import argparse
import json
import os
import sys


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
