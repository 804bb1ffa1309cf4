"""`testbed down`: remove what testbed runs left, of every kind (`testbed.deploy.cleanup`)."""

from __future__ import annotations

import argparse
import json
import sys

from testbed.config.privilege import is_root, need_root


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = sub.add_parser("down", help="remove what testbed runs left: namespaces, processes, containers, networks",
                       description="Idempotent: stops processes inside every namespace whose name starts with "
                                   "PREFIX, deletes the namespaces (and with them veths, TUNs, qdiscs), and removes "
                                   "the containers, networks and volumes of compose runs and the services, overlay "
                                   "networks and configs of swarm runs labelled with PREFIX. With the default PREFIX it also "
                                   "stops the services of local runs whose runner was killed; with a run's prefix, that "
                                   "run's (without root: only those and what Docker lets this user remove).")
    d.add_argument("--prefix", default="ptb", help="namespace name prefix (default: ptb = every run)")
    d.add_argument("--json", action="store_true", help="print what was removed as JSON")
    d.set_defaults(func=cmd_down)


def cmd_down(args: argparse.Namespace) -> int:
    from testbed.deploy.cleanup import PREFIX, down
    from testbed.deploy.registry import sweepers

    root = is_root()
    if not root:
        # Namespaces need root; a local run's services and (for a member of the docker group) a
        # Docker run's objects do not. A prefix whose namespaces exist is refused, as nothing
        # else of it could be removed; otherwise what this user may remove is.
        from testbed.net.teardown import namespaces
        if args.prefix != PREFIX and namespaces(args.prefix):
            need_root("removing a run's network namespaces and what runs in them")
        if args.prefix == PREFIX:
            print("down: not root: network namespaces (netns, swarm runs) are not swept; run as root for those",
                  file=sys.stderr)
    report = down(sweepers(root), args.prefix)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.summary())
    return 1 if report.errors else 0
