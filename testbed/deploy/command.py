"""`testbed down`: remove what testbed runs left, of every kind (`testbed.deploy.cleanup`)."""

from __future__ import annotations

import argparse
import json
import os
import sys


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = sub.add_parser("down", help="remove what testbed runs left: namespaces, processes, containers, networks",
                       description="Idempotent: stops processes inside every namespace whose name starts with "
                                   "PREFIX, deletes the namespaces (and with them veths, TUNs, qdiscs), and removes "
                                   "the containers, networks and volumes of compose runs and the services, overlay "
                                   "networks and configs of swarm runs labelled with PREFIX.")
    d.add_argument("--prefix", default="ptb", help="namespace name prefix (default: ptb = every run)")
    d.add_argument("--json", action="store_true", help="print what was removed as JSON")
    d.set_defaults(func=cmd_down)


def cmd_down(args: argparse.Namespace) -> int:
    from testbed.deploy.cleanup import down

    if os.geteuid() != 0:
        print("error: network namespaces need root", file=sys.stderr)
        return 1
    try:
        report = down(args.prefix)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.summary())
    return 1 if report.errors else 0
