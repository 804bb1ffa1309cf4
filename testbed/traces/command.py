"""`testbed trace ...`: generate, summarise and validate trace files."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import numpy as np

from testbed.core.scenario import WorkloadSpec
from testbed.traces.loader import SUPPORTED_FORMATS, load_trace
from testbed.traces.mooncake import write_mooncake
from testbed.traces.synthetic import synth_with_prefixes, synthetic_trace
from testbed.traces.types import Trace, TraceError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("trace", help="generate, summarise and validate request traces")
    tsub = p.add_subparsers(dest="trace_command", required=True, metavar="{synth,info,validate}")

    s = tsub.add_parser("synth", help="write a generated trace")
    s.add_argument("--format", choices=SUPPORTED_FORMATS, default="mooncake")
    s.add_argument("--requests", type=int, required=True, metavar="N")
    s.add_argument("--rate", type=float, required=True, metavar="R", help="mean arrivals per second")
    s.add_argument("--seed", type=int, default=1, metavar="S")
    s.add_argument("--out", required=True, metavar="PATH")
    s.add_argument(
        "--prefix-reuse",
        action="store_true",
        help="multi-turn conversations sharing prefix blocks (default: the paper's workload, no reuse)",
    )
    s.set_defaults(func=cmd_synth)

    i = tsub.add_parser("info", help="summarise a trace")
    i.add_argument("path", metavar="PATH")
    i.add_argument("--format", default="auto", choices=("auto", *SUPPORTED_FORMATS))
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.set_defaults(func=cmd_info)

    v = tsub.add_parser("validate", help="check a trace file; exit 0 if valid, 2 if not")
    v.add_argument("path", metavar="PATH")
    v.add_argument("--format", default="auto", choices=("auto", *SUPPORTED_FORMATS))
    v.set_defaults(func=cmd_validate)


def cmd_synth(args: argparse.Namespace) -> int:
    if args.requests <= 0 or not (args.rate > 0 and math.isfinite(args.rate)):
        print("trace synth: --requests and --rate must be positive", file=sys.stderr)
        return 2
    if args.prefix_reuse:
        trace = synth_with_prefixes(args.requests, args.rate, args.seed)
    else:
        trace = synthetic_trace(WorkloadSpec(requests=args.requests, rate=args.rate, seed=args.seed))
    write_mooncake(args.out, trace)
    print(f"wrote {len(trace)} requests ({trace.duration:.1f} s, {trace.rate:.3f} req/s) to {args.out}")
    return 0


def prefix_reuse_share(trace: Trace) -> tuple[float, int]:
    """(share of blocks whose hash appeared earlier in the trace, total blocks)."""
    seen: set[int] = set()
    total = reused = 0
    for r in trace.requests:
        for h in r.hash_ids:
            if h in seen:
                reused += 1
            else:
                seen.add(h)
        total += len(r.hash_ids)
    return (reused / total if total else 0.0), total


def _dist(values: list[int]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "max": 0.0}
    a = np.asarray(values, dtype=np.float64)
    p50, p90 = np.percentile(a, [50, 90])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "max": float(a.max())}


def trace_summary(trace: Trace) -> dict[str, Any]:
    share, blocks = prefix_reuse_share(trace)
    rate = trace.rate
    return {
        "source": trace.source,
        "requests": len(trace),
        "duration_s": trace.duration,
        # JSON has no infinity; a zero-length burst has no finite mean rate.
        "rate_rps": rate if math.isfinite(rate) else None,
        "input_tokens": _dist([r.input_tokens for r in trace.requests]),
        "output_tokens": _dist([r.output_tokens for r in trace.requests]),
        "block_tokens": trace.block_tokens,
        "blocks": blocks,
        "prefix_reuse_share": share,
    }


def _fmt_dist(d: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:,.0f}" for k, v in d.items())


def cmd_info(args: argparse.Namespace) -> int:
    try:
        trace = load_trace(args.path, args.format)
    except TraceError as e:
        print(f"trace info: {e}", file=sys.stderr)
        return 2
    s = trace_summary(trace)
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    rate = "n/a" if s["rate_rps"] is None else f"{s['rate_rps']:.3f} req/s"
    print(f"trace         {s['source']}")
    print(f"requests      {s['requests']:,}")
    print(f"duration      {s['duration_s']:,.1f} s")
    print(f"rate          {rate}")
    print(f"input tokens  {_fmt_dist(s['input_tokens'])}")
    print(f"output tokens {_fmt_dist(s['output_tokens'])}")
    print(
        f"prefix reuse  {100 * s['prefix_reuse_share']:.1f}% of {s['blocks']:,} "
        f"{s['block_tokens']}-token blocks seen earlier"
    )
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    try:
        trace = load_trace(args.path, args.format)
    except TraceError as e:
        print(str(e), file=sys.stderr)
        return 2
    print(f"{args.path}: ok, {len(trace):,} requests over {trace.duration:,.1f} s")
    return 0
