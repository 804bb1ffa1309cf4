"""`testbed linkcheck` under netem on every shipped profile, in one process (a guest pays its
slow start-up once): each profile's report as `testbed linkcheck` prints it, then one line per
profile with its bars, and the exit status.

    python tests/netem/linkcheck_all.py [--strict] [--wire-rate R] [--duration S] [--rtt-probes N]

Gates: every profile measured with method netem, its loss within 0.3 points (the kernel's
doing, whatever the machine's speed). A loss figure linkcheck marks INVALID (the guest itself
dropped probes in a way that cannot be told from the link's loss, even after measuring the
stream once more) is reported as not measured, never failed and never passed. RTT, goodput
and rate-change bars are timing bars: a one-CPU guest's timers fire late on a loaded host, so
they are shown, and gate with --strict.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from testbed.config.profiles import PROFILE_DIR, load_profile
from testbed.core.schema.linkprofile import parse_rate
from testbed.studies.linkcheck.linkcheck import LinkCheckConfig, multi_goodput_bps, run_linkcheck, scale_for
from testbed.studies.linkcheck.linkcheck_report import (
    loss_cell,
    print_report,
    rtt_invalid_cell,
    rtt_valid,
    shaped_rtt,
    verdicts,
)

GATES = ("loss",)


def summary_line(r: dict[str, object]) -> str:
    c = r["configured"]
    v = r["verdicts"]
    assert isinstance(c, dict) and isinstance(v, dict)
    mark = {True: "PASS", False: "FAIL", None: "-"}
    rtt = shaped_rtt(r)
    multi = r["goodput"][0]  # type: ignore[index]
    lo = r["loss"]
    assert isinstance(lo, dict)
    loss = (
        f"loss {mark[v['loss']]} ({lo['link']:.2%} of {c['loss']:.2%})"
        if lo["valid"]
        else f"loss not measured ({loss_cell(lo)})"
    )
    parts = [
        (
            f"RTT {mark[v['rtt']]} ({rtt * 1e3:.2f} of {c['rtt_s_wire'] * 1e3:.2f} ms over the unshaped path)"
            if rtt_valid(r)
            else f"RTT not measured ({rtt_invalid_cell(r)})"
        ),
        f"goodput {mark[v['goodput_multi']]} ({(multi_goodput_bps(multi) or 0) / c['rate_bps_wire']:.0%} of the "
        f"rate past TCP's ramp, {(multi['bps'] or 0) / c['rate_bps_wire']:.0%} over the whole transfer)",
        loss,
    ]
    if "rate_change" in v:
        f = r["rate_change"]["follow_s"]  # type: ignore[index]
        parts.append(
            f"rate change {mark[v['rate_change']]} ("
            + (f"{f * 1e3:.0f} ms" if f is not None else "did not follow")
            + ")"
        )
    return f"{r['profile']} [{r['method']}]: " + ", ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strict", action="store_true", help="every bar gates, timing bars too")
    ap.add_argument("--wire-rate", default="50mbit")
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--rtt-probes", type=int, default=50)
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--only", action="append", default=[], metavar="PROFILE", help="these profiles only (repeatable)")
    args = ap.parse_args()
    profiles = sorted(PROFILE_DIR.glob("*.yaml"))
    unknown = sorted(set(args.only) - {p.stem for p in profiles})
    if unknown:
        ap.error(f"--only: no profile {', '.join(unknown)} in {PROFILE_DIR}")
    results = []
    for path in profiles:
        if args.only and path.stem not in args.only:
            continue
        t0 = time.monotonic()
        p = load_profile(path)
        # The tier's bars are RTT, loss and goodput on 4 connections: the transfers on one
        # connection (to an ordinary receiver, and to one whose small buffer is the limit) are
        # left to `linkcheck --compare-methods`, which puts them beside the delay line's.
        cfg = LinkCheckConfig(
            p,
            scale_for(p, 1.0, None, parse_rate(args.wire_rate)),
            4,
            args.duration,
            loss_probes=None,
            rtt_probes=args.rtt_probes,
            method="netem",
            one_connection=False,
            window_limited=False,
        )
        # No second run of a failing profile: the host's own drops no longer reach the loss
        # figure (linkcheck counts them, and measures a stream they disturbed once more itself),
        # so a valid figure outside the bar is the link's, and measuring until one passes would
        # only hide it.
        r = run_linkcheck(cfg)
        r["verdicts"] = verdicts(r)
        print_report(r)
        steps = ", ".join(f"{k} {v:.1f}" for k, v in r["took_s"].items())
        print(f"linkcheck {p.name}: {time.monotonic() - t0:.0f} s ({steps})", flush=True)
        results.append(r)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(results, indent=1) + "\n")
    gates = None if args.strict else GATES
    bad = []
    print(
        "\nlinkcheck under netem, bars: RTT 1 ms or 3%, goodput on 4 connections past TCP's ramp >= 90% of the rate, "
        "loss within 0.3 points, rate change followed within 200 ms"
        + ("" if args.strict else f" (gating: method netem, {', '.join(GATES)})")
    )
    for r in results:
        print("  " + summary_line(r))
        failed = [k for k, ok in r["verdicts"].items() if ok is False and (gates is None or k in gates)]
        if r["method"] != "netem" or failed:
            bad.append(f"{r['profile']} ({', '.join(failed) or 'method ' + str(r['method'])})")
    unmeasured = [str(r["profile"]) for r in results if not r["loss"]["valid"]]  # type: ignore[index]
    print(
        f"linkcheck: {len(results) - len(bad)} of {len(results)} profiles pass"
        + (f"; failing: {'; '.join(bad)}" if bad else "")
        + (f"; loss not measured (INVALID, not gated): {', '.join(unmeasured)}" if unmeasured else "")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
