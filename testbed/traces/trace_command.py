"""`testbed trace ...`: generate, summarise and validate trace files; the `--window` syntax."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from array import array
from collections.abc import Callable, Iterable
from typing import NotRequired, TypedDict

import numpy as np

from testbed.config.cli_args import StoreOnce, out_file
from testbed.core.schema.scenario import WorkloadSpec
from testbed.traces.burstgpt import MODELS
from testbed.traces.csvutil import LoadStats, Window
from testbed.traces.distinct import DistinctCounter
from testbed.traces.formats import FORMATS, SUPPORTED_FORMATS, WriteOptions
from testbed.traces.loader import block_tokens_of, detect_format, iter_trace, load_trace, notes_for
from testbed.traces.mooncake import write_mooncake_requests
from testbed.traces.sessions import SessionStats, session_stats
from testbed.traces.synthetic import (
    DEFAULT_BURST_PEAK,
    REUSE_PROFILES,
    SyntheticStream,
    synth_profile,
    synthetic_trace,
)
from testbed.traces.types import Trace, TraceError, TraceRequest

_SPAN = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd]?)\s*", re.ASCII)
_UNIT = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
WINDOW_HELP = (
    "START:END in trace seconds (0 = the file's first row), each with an optional unit s/m/h/d; "
    "either may be empty: 3600:7200, 1h:2h, 2d:, :10m"
)


def parse_window(text: str) -> Window:
    """`START:END` -> (start_s, end_s); an empty START is 0, an empty END the end of the trace."""
    head, sep, tail = text.partition(":")
    if not sep:
        raise ValueError(f"expected START:END, got {text!r} ({WINDOW_HELP})")
    ends: list[float] = []
    for part, empty in ((head, 0.0), (tail, math.inf)):
        if not part.strip():
            ends.append(empty)
            continue
        m = _SPAN.fullmatch(part)
        if m is None:
            raise ValueError(f"bad time {part.strip()!r} in {text!r} ({WINDOW_HELP})")
        ends.append(float(m[1]) * _UNIT[m[2]])
    start, end = ends
    if not end > start:
        raise ValueError(f"END must be after START in {text!r}")
    return start, end


def window_arg(text: str) -> Window:
    """argparse `type=` for --window."""
    try:
        return parse_window(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _models_arg(p: argparse.ArgumentParser, flag: str) -> None:
    p.add_argument(
        flag,
        dest="models",
        action="append",
        metavar="NAME",
        help=f"BurstGPT: keep only this model ({', '.join(MODELS)}; repeatable)",
    )


AUTO_HELP = (
    "trace format (default auto: a .jsonl is aiperf multi-turn or Bailian by its keys, else Mooncake; "
    "a .csv is told by its header)"
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("trace", help="generate, summarise and validate request traces")
    tsub = p.add_subparsers(dest="trace_command", required=True, metavar="{synth,info,validate,convert}")

    s = tsub.add_parser("synth", help="write a generated trace")
    s.add_argument(
        "--format", choices=SUPPORTED_FORMATS, default="mooncake", help="file format to write (default mooncake)"
    )
    s.add_argument(
        "--variant",
        metavar="V",
        help="; ".join(
            f"{f.name}: {' or '.join(f.variants)} {f.variant_noun} (default {f.default_variant})"
            for f in FORMATS.values()
            if f.variants
        ),
    )
    s.add_argument("--requests", type=int, required=True, metavar="N", help="how many requests to write")
    s.add_argument("--rate", type=float, required=True, metavar="R", help="mean arrivals per second")
    s.add_argument(
        "--seed", type=int, default=1, metavar="S", help="random seed (default 1): the same seed writes the same file"
    )
    s.add_argument(
        "--arrival-cv",
        type=float,
        default=1.0,
        metavar="C",
        help="coefficient of variation of the inter-arrival gaps: 1 Poisson (default), "
        "below 1 smoother (gamma), above 1 bursts (interrupted Poisson)",
    )
    s.add_argument(
        "--burst-peak",
        type=float,
        default=DEFAULT_BURST_PEAK,
        metavar="P",
        help=f"with --arrival-cv above 1: the rate during a burst over the mean (default {DEFAULT_BURST_PEAK:g})",
    )
    s.add_argument(
        "--out", action=StoreOnce, type=out_file, required=True, metavar="FILE", help="the trace file to write"
    )
    s.add_argument(
        "--prefix-reuse",
        nargs="?",
        const="chat",
        choices=tuple(REUSE_PROFILES),
        metavar="PROFILE",
        help="multi-turn sessions sharing prefix blocks, shaped as PROFILE: chat (default) or agent "
        "(long-context agent sessions); mooncake only; without it: the paper's workload",
    )
    s.add_argument(
        "--failed-share",
        type=float,
        default=0.0,
        metavar="F",
        help="burstgpt: share of rows written as failed (0 response tokens)",
    )
    s.set_defaults(func=cmd_synth)

    i = tsub.add_parser("info", help="summarise a trace")
    i.add_argument("path", metavar="PATH", help="the trace file")
    i.add_argument(
        "--format",
        default="auto",
        choices=("auto", *SUPPORTED_FORMATS),
        help=AUTO_HELP,
    )
    i.add_argument("--window", type=window_arg, metavar="START:END", help=WINDOW_HELP)
    i.add_argument("--keep-failed", action="store_true", help="BurstGPT: count failed requests in (1 output token)")
    _models_arg(i, "--model")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.add_argument(
        "--sessions",
        action="store_true",
        help=f"summarise the sessions of a trace of more than {SESSION_REQUESTS:,} requests too (which holds the "
        "whole trace: about a kilobyte a request, more where sessions are inferred from hash_ids)",
    )
    i.set_defaults(func=cmd_info)

    v = tsub.add_parser("validate", help="check a whole trace file; exit 0 if valid, 2 if not")
    v.add_argument("path", metavar="PATH", help="the trace file")
    v.add_argument(
        "--format",
        default="auto",
        choices=("auto", *SUPPORTED_FORMATS),
        help=AUTO_HELP,
    )
    v.set_defaults(func=cmd_validate)

    c = tsub.add_parser(
        "convert",
        help="write a trace in another format (e.g. a session trace as aiperf multi-turn JSONL, "
        "which aiperf replays closed loop: --custom-dataset-type multi_turn)",
    )
    c.add_argument("path", metavar="PATH", help="the trace file")
    c.add_argument("--format", default="auto", choices=("auto", *SUPPORTED_FORMATS), help=AUTO_HELP)
    c.add_argument("--to", required=True, choices=SUPPORTED_FORMATS, help="the format to write")
    c.add_argument("--window", type=window_arg, metavar="START:END", help=WINDOW_HELP)
    c.add_argument(
        "--out", action=StoreOnce, type=out_file, required=True, metavar="FILE", help="the trace file to write"
    )
    c.set_defaults(func=cmd_convert)


def cmd_synth(args: argparse.Namespace) -> int:
    if args.requests <= 0 or not (args.rate > 0 and math.isfinite(args.rate)):
        print("trace synth: --requests and --rate must be positive", file=sys.stderr)
        return 2
    fmt = FORMATS[args.format]
    variants = fmt.variants
    if args.variant is not None and args.variant not in variants:
        allowed = ", ".join(variants) if variants else "none"
        print(f"trace synth: --variant for {args.format}: one of {allowed}", file=sys.stderr)
        return 2
    if args.prefix_reuse and not fmt.carries_hashes:
        print(f"trace synth: --prefix-reuse: the {args.format} format carries no prefix hashes", file=sys.stderr)
        return 2
    if not 0.0 <= args.failed_share <= 1.0 or (args.failed_share and not fmt.writes_failed):
        writers = ", ".join(f.name for f in FORMATS.values() if f.writes_failed)
        print(f"trace synth: --failed-share is a share in [0, 1], for {writers} only", file=sys.stderr)
        return 2
    if not (args.arrival_cv > 0 and math.isfinite(args.arrival_cv)):
        print("trace synth: --arrival-cv must be a positive number", file=sys.stderr)
        return 2
    if not (args.burst_peak > 1 and math.isfinite(args.burst_peak)):
        print("trace synth: --burst-peak must be a rate ratio above 1", file=sys.stderr)
        return 2
    arrivals = {"arrival_cv": args.arrival_cv, "burst_peak": args.burst_peak}
    if not args.prefix_reuse and fmt.name == "mooncake":
        # Written as drawn: a week of traffic (tens of millions of requests) is never held.
        stream = SyntheticStream(WorkloadSpec(requests=args.requests, rate=args.rate, seed=args.seed), **arrivals)
        write_mooncake_requests(args.out, stream)
        n, dur = len(stream), stream.duration
        rate = 0.0 if n < 2 else (n - 1) / dur if dur > 0 else math.inf  # as Trace.rate
        print(f"wrote {n} requests ({dur:.1f} s, {rate:.3f} req/s) to {args.out}")
        return 0
    if args.prefix_reuse:
        trace = synth_profile(args.prefix_reuse, args.requests, args.rate, args.seed, **arrivals)
    else:
        trace = synthetic_trace(WorkloadSpec(requests=args.requests, rate=args.rate, seed=args.seed), **arrivals)
    fmt.write(args.out, trace, WriteOptions(variant=args.variant, seed=args.seed, failed_share=args.failed_share))
    print(f"wrote {len(trace)} requests ({trace.duration:.1f} s, {trace.rate:.3f} req/s) to {args.out}")
    return 0


def prefix_reuse_share(trace: Trace) -> tuple[float, int]:
    """(share of blocks whose hash appeared earlier in the trace, total blocks)."""
    acc = _Summary()
    acc.add(trace.requests)
    return acc.reuse()


# Hashes are counted in batches of this many (8 MB as int64).
_HASH_BATCH = 1 << 20
ESTIMATE_NOTE = "prefix reuse estimated (to about 1%): too many distinct sparse hash ids to count exactly"


class TraceSummary(TypedDict):
    """What `trace info` prints (and `trace check` counts) of a trace file."""

    sessions: NotRequired[dict[str, object]]  # the sessions found (`trace info` only)

    source: str
    requests: int
    duration_s: float
    rate_rps: float | None  # None: no finite mean rate (one request, or a zero-length burst)
    input_tokens: dict[str, float]  # mean, p50, p90, max
    output_tokens: dict[str, float]
    block_tokens: int
    blocks: int
    prefix_reuse_share: float
    notes: list[str]


class _Summary:
    """Summary figures accumulated one request at a time, so a file need not be held: token
    counts as int64 arrays (8 bytes a request, for exact percentiles) and the hashes as a
    distinct count (see `distinct`)."""

    def __init__(self) -> None:
        self.n = 0
        self.first = self.last = 0.0
        self.inputs = array("q")
        self.outputs = array("q")
        self.blocks = 0
        self._hashes = array("q")
        self._distinct = DistinctCounter()

    def _flush(self) -> None:
        if self._hashes:
            self.blocks += len(self._hashes)
            self._distinct.add(np.frombuffer(self._hashes, dtype=np.int64))
            self._hashes = array("q")

    def add(self, requests: Iterable[TraceRequest]) -> None:
        hashes = self._hashes
        for r in requests:
            if self.n == 0:
                self.first = r.timestamp
            self.last = r.timestamp
            self.n += 1
            self.inputs.append(r.input_tokens)
            self.outputs.append(r.output_tokens)
            if r.hash_ids:
                hashes.extend(r.hash_ids)
                if len(hashes) >= _HASH_BATCH:
                    self._flush()
                    hashes = self._hashes

    def reuse(self) -> tuple[float, int]:
        self._flush()
        blocks = self.blocks
        reused = blocks - min(self._distinct.count, blocks)
        return (reused / blocks if blocks else 0.0), blocks

    def result(self, source: str, block_tokens: int, notes: Iterable[str]) -> TraceSummary:
        duration = self.last - self.first
        rate = 0.0 if self.n < 2 else ((self.n - 1) / duration if duration > 0 else math.inf)
        share, blocks = self.reuse()
        return {
            "source": source,
            "requests": self.n,
            "duration_s": duration,
            # JSON has no infinity; a zero-length burst has no finite mean rate.
            "rate_rps": rate if math.isfinite(rate) else None,
            "input_tokens": _dist(self.inputs),
            "output_tokens": _dist(self.outputs),
            "block_tokens": block_tokens,
            "blocks": blocks,
            "prefix_reuse_share": share,
            "notes": [*notes, *(() if self._distinct.exact else (ESTIMATE_NOTE,))],
        }


def _dist(values: array[int]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "max": 0.0}
    a = np.frombuffer(values, dtype=np.int64).astype(np.float64)
    p50, p90 = np.percentile(a, [50, 90])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "max": float(a.max())}


def _fmt_dist(d: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:,.0f}" for k, v in d.items())


def _stream_summary(
    args: argparse.Namespace,
    window: Window | None,
    acc: _Summary | None = None,
    on_error: Callable[[TraceError], None] | None = None,
) -> TraceSummary:
    """Summarise a file without holding its requests (the 2024 Azure files have millions)."""
    fmt = detect_format(args.path) if args.format == "auto" else args.format
    stats = LoadStats()
    acc = acc if acc is not None else _Summary()
    acc.add(
        iter_trace(
            args.path,
            fmt,
            window=window,
            keep_failed=getattr(args, "keep_failed", False),
            models=getattr(args, "models", None),
            stats=stats,
            on_error=on_error,
        )
    )
    source = str(args.path) + (f" | window({window[0]:g}, {window[1]:g})" if window is not None else "")
    return acc.result(source, block_tokens_of(fmt), notes_for(fmt, stats))


# `trace info` summarises the sessions of a trace of at most this many requests, unless asked to:
# that holds the whole trace, and inferring them from hash_ids a trie of its every block (some
# 300 bytes a distinct block), where the rest of the summary streams in bounded memory.
SESSION_REQUESTS = 20_000


def _session_summary(args: argparse.Namespace, requests: int) -> SessionStats | str | None:
    """The sessions of a format that can hold them (stated or inferable from hash_ids); a note
    where the trace is too long to summarise them unasked."""
    fmt = detect_format(args.path) if args.format == "auto" else args.format
    if not FORMATS[fmt].carries_hashes:  # neither stated sessions nor hashes to infer them from
        return None
    if requests > SESSION_REQUESTS and not args.sessions:
        return (
            f"sessions not summarised: {requests:,} requests, more than {SESSION_REQUESTS:,}; "
            "`--sessions` summarises them (holding the whole trace)"
        )
    return session_stats(load_trace(args.path, fmt, window=args.window))


def _print_sessions(ss: SessionStats) -> None:
    if ss.source == "none":
        print("sessions      none (no request follows another)")
        return
    mean, p50, p90, most = ss.turns_per_session
    print(
        f"sessions      {ss.sessions:,} ({ss.source}), {ss.multi_turn_sessions:,} of two or more turns "
        f"holding {ss.turns:,} requests"
    )
    print(f"turns/session mean {mean:,.2f}  p50 {p50:,.0f}  p90 {p90:,.0f}  max {most:,}")
    if ss.think_s is not None:
        print("think time    mean {:,.3f}  p50 {:,.3f}  p90 {:,.3f} s (stated)".format(*ss.think_s))
    if ss.gap_s is not None:
        print(
            "turn gap      mean {:,.2f}  p50 {:,.2f}  p90 {:,.2f} s (trace: parent's arrival to the turn's)".format(
                *ss.gap_s
            )
        )


def cmd_info(args: argparse.Namespace) -> int:
    try:
        s = _stream_summary(args, args.window)
        ss = _session_summary(args, int(s["requests"]))
    except TraceError as e:
        print(f"trace info: {e}", file=sys.stderr)
        return 2
    if isinstance(ss, str):
        s["notes"] = [*s["notes"], ss]
        ss = None
    if ss is not None:
        s["sessions"] = dataclasses.asdict(ss)
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
    if s["blocks"]:
        print(
            f"prefix reuse  {100 * s['prefix_reuse_share']:.1f}% of {s['blocks']:,} "
            f"{s['block_tokens']}-token blocks seen earlier"
        )
    else:
        print("prefix reuse  none (no prefix block hashes)")
    if ss is not None:
        _print_sessions(ss)
    for note in s["notes"]:
        print(f"note          {note}")
    return 0


# `trace validate` shows this many bad lines and counts the rest.
VALIDATE_SHOWN = 20


class _BadLines:
    """An `on_error` that keeps the first `shown` errors and counts them all."""

    def __init__(self, shown: int) -> None:
        self.shown = shown
        self.first: list[TraceError] = []
        self.count = 0

    def __call__(self, error: TraceError) -> None:
        self.count += 1
        if len(self.first) < self.shown:
            self.first.append(error)


def cmd_validate(args: argparse.Namespace) -> int:
    bad = _BadLines(VALIDATE_SHOWN)
    acc = _Summary()
    try:
        s = _stream_summary(args, None, acc, on_error=bad)
    except TraceError as e:  # ends the reading: no such file, a bad header
        for err in bad.first:
            print(err, file=sys.stderr)
        print(str(e), file=sys.stderr)
        return 2
    if bad.count:
        for err in bad.first:
            print(err, file=sys.stderr)
        shown = f" (the first {len(bad.first)} shown)" if bad.count > len(bad.first) else ""
        print(
            f"{args.path}: {bad.count:,} bad line{'' if bad.count == 1 else 's'}{shown}; {acc.n:,} good requests",
            file=sys.stderr,
        )
        return 2
    if not s["requests"]:
        # Nothing to replay: a replay of it would end at once with an empty report.
        print(f"{args.path}: no requests: an empty trace has nothing to replay", file=sys.stderr)
        return 2
    print(f"{args.path}: ok, {s['requests']:,} requests over {s['duration_s']:,.1f} s")
    for note in s["notes"]:
        print(f"  {note}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    try:
        trace = load_trace(args.path, args.format, window=args.window)
        FORMATS[args.to].write(args.out, trace, WriteOptions())
    except (TraceError, ValueError) as e:
        print(f"trace convert: {e}", file=sys.stderr)
        return 2
    ss = session_stats(trace) if trace.requests else None
    sessions = "" if ss is None or ss.source == "none" else f", {ss.sessions:,} sessions ({ss.source})"
    print(f"wrote {len(trace):,} requests{sessions} as {args.to} to {args.out}")
    return 0
