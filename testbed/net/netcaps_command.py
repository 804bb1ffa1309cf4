"""`testbed netcaps` (what shaping this kernel supports) and `testbed linkcheck` (one shaped link
measured against its profile). `testbed down` lives with the deploy backends (deploy/down_command.py):
it removes their Docker objects too, which this layer knows nothing of."""

from __future__ import annotations

import argparse
import json

from testbed.config.privilege import need_root


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser("netcaps", help="probe which link shaping this kernel supports (netem, HTB, TUN)")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(func=cmd_netcaps)


def _need_root() -> bool:
    need_root("probing link shaping (a scratch network namespace)")
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
        print(
            f"netem: {yes[caps.netem]}\nhtb:   {yes[caps.htb]}\ntun:   {yes[caps.tun]}\n"
            f"method (auto): {method}\ndetail: {caps.detail}"
        )
    return 0
