"""`testbed down`: remove what testbed runs left, of every kind (`testbed.deploy.cleanup`)."""

from __future__ import annotations

import argparse
import json
import re
import sys

from testbed.config.privilege import is_root, need_root
from testbed.core.errors import UserError

# A run's own name (netns prefix, Docker project, local journal): `ptb` and 4 hex digits.
RUN_NAME = re.compile(r"ptb[0-9a-f]{4}")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = sub.add_parser(
        "down",
        help="remove what testbed runs left: namespaces, processes, containers, networks",
        description="Idempotent: stops processes inside every namespace whose name starts with "
        "PREFIX, deletes the namespaces (and with them veths, TUNs, qdiscs), and removes "
        "the containers, networks and volumes of compose runs and the services, overlay "
        "networks and configs of swarm runs labelled with PREFIX. With the default PREFIX it also "
        "stops the services of local runs whose runner was killed; with a run's prefix, that "
        "run's (without root: only those and what Docker lets this user remove). What a "
        "live run owns is never removed, whatever the prefix: those runs are listed, and "
        "--force RUN removes one.",
    )
    d.add_argument(
        "--prefix",
        default=None,
        help="namespace name prefix (default: ptb = every run; with --force only, the forced runs)",
    )
    d.add_argument(
        "--force",
        action="append",
        default=[],
        metavar="RUN",
        help="also remove what the live run RUN owns (its full name, e.g. ptb70b0, as run.json's "
        "shaping.prefix or the listing of live runs says; repeatable): its processes are stopped",
    )
    d.add_argument("--json", action="store_true", help="print what was removed as JSON")
    d.set_defaults(func=cmd_down)


def cmd_down(args: argparse.Namespace) -> int:
    from testbed.deploy.cleanup import PREFIX, DownReport, down
    from testbed.deploy.registry import sweepers

    for name in args.force:
        if not RUN_NAME.fullmatch(name):
            raise UserError(
                f"--force {name!r}: name one run by its full name (ptb and 4 hex digits, e.g. ptb70b0, "
                "as run.json's shaping.prefix says)"
            )
    # --force alone: those runs; with --prefix, what the prefix selects and the forced runs in it.
    prefixes = [args.prefix] if args.prefix is not None else (list(dict.fromkeys(args.force)) or [PREFIX])
    root = is_root()
    if not root:
        # Namespaces need root; a local run's services and (for a member of the docker group) a
        # Docker run's objects do not. A prefix whose namespaces exist is refused, as nothing
        # else of it could be removed; otherwise what this user may remove is.
        from testbed.net.teardown import namespaces

        if any(p != PREFIX and namespaces(p) for p in prefixes):
            need_root("removing a run's network namespaces and what runs in them")
        if PREFIX in prefixes:
            print(
                "down: not root: network namespaces (netns, swarm runs) are not swept; run as root for those",
                file=sys.stderr,
            )
    reports = [down(sweepers(root), p, force=args.force) for p in prefixes]
    report = DownReport(tuple(part for r in reports for part in r.parts))
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.summary())
    return 1 if report.errors else 0
