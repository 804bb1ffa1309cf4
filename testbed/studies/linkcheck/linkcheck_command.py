"""`testbed linkcheck`'s flags: one shaped link checked per profile, or netem and the delay line
compared (`--compare-methods`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from testbed.config.cli_args import add_overwrite
from testbed.config.privilege import need_root
from testbed.studies.linkcheck.linkcheck import scale_for
from testbed.studies.linkcheck.linkcheck_compare import main_compare
from testbed.studies.linkcheck.linkcheck_report import main_linkcheck


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    lc = sub.add_parser("linkcheck", help="build one shaped link and measure RTT, goodput and loss against the profile")
    lc.add_argument(
        "profile",
        nargs="*",
        help="link profile names (netem_profiles/NAME.yaml) or paths, checked in turn "
        "(with --compare-methods, default: every shipped profile)",
    )
    lc.add_argument("--speedup", type=float, default=1.0, help="time scale s (default 1)")
    g = lc.add_mutually_exclusive_group()
    g.add_argument("--byte-scale", type=float, help="byte scale b: wire rate = rate / b * s")
    g.add_argument("--wire-rate", default="1gbit", help="choose b so the wire rate is this (default 1gbit)")
    lc.add_argument("--connections", type=int, default=4, help="connections for the multi-connection goodput")
    lc.add_argument("--duration", type=float, default=4.0, help="wire seconds per goodput measurement")
    lc.add_argument("--rtt-probes", type=int, default=200, help="sequential RTT probes (default 200)")
    lc.add_argument(
        "--loss-probes",
        type=_probe_count,
        default=20000,
        help="paced UDP probes for loss (default 20000); auto: enough for the 0.3-point bar at "
        "the profile's loss and correlation (at least 2000)",
    )
    lc.add_argument(
        "--method",
        choices=["auto", "netem", "fallback"],
        default="auto",
        help="how to shape: netem (the kernel's sch_netem), fallback (HTB rate in the kernel, delay/jitter/loss "
        "by the userspace delay line, for kernels without netem), auto (netem where the kernel has it)",
    )
    lc.add_argument(
        "--compare-methods",
        action="store_true",
        help="measure each profile by netem and by the delay line side by side (needs a kernel "
        "with netem; exit 2 without)",
    )
    lc.add_argument("--out", type=Path, help="with --compare-methods: write compare-methods.md and .json here")
    add_overwrite(lc, "--out")
    lc.add_argument("--json", action="store_true", help="print JSON")
    lc.set_defaults(func=cmd_linkcheck)


def _probe_count(text: str) -> int | None:
    if text == "auto":
        return None
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError("a positive count or auto")
    return n


def cmd_linkcheck(args: argparse.Namespace) -> int:
    from testbed.config.profiles import PROFILE_DIR, load_profile
    from testbed.core.schema.linkprofile import parse_rate

    names: list[str] = list(args.profile)
    if not names:
        if not args.compare_methods:
            print("error: linkcheck needs a profile (netem_profiles/NAME.yaml or a path)", file=sys.stderr)
            return 2
        names = sorted(f.stem for f in PROFILE_DIR.glob("*.yaml"))
    if args.out is not None and not args.compare_methods:
        print("error: --out goes with --compare-methods", file=sys.stderr)
        return 2
    need_root("linkcheck (two network namespaces and a shaped link between them)")
    profiles = [load_profile(n) for n in names]  # a ProfileError is a UserError: the CLI prints it
    wire = None if args.byte_scale is not None else parse_rate(args.wire_rate)
    scales = [scale_for(p, args.speedup, args.byte_scale, wire) for p in profiles]
    if args.compare_methods:
        if args.out is not None:
            from testbed.config import run_lock

            run_lock.acquire(args.out, args.overwrite)  # this command's until it returns
        return main_compare(
            profiles, scales, args.connections, args.duration, args.json, args.out, args.rtt_probes, args.loss_probes
        )
    return main_linkcheck(
        profiles, scales, args.connections, args.duration, args.method, args.json, args.rtt_probes, args.loss_probes
    )
