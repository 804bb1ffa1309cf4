"""`testbed calibrate`: a hardware profile (prefill curve, decode step model) fitted to
measurements of a real server, written as a scenario that extends a base one, or as the block.

The readers are `testbed.hardware.measurements`, the fits `testbed.hardware.calibrate`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypedDict

import yaml

from testbed.config.cli_args import StoreOnce, out_file
from testbed.config.scenarios import ScenarioError, load_scenario, resolve_path
from testbed.core.schema.hardware import DecodeSpec
from testbed.core.schema.scenario import Scenario, size_bytes
from testbed.hardware.calibrate import (
    CalibrationError,
    DecodeFit,
    DecodePoint,
    ErrorSummary,
    FirstStep,
    PointError,
    PrefillFit,
    PrefillPoint,
    RequestRecord,
    analyse_requests,
    fit_decode,
    fit_prefill_polynomial,
    fit_prefill_table,
    prefill_points,
)
from testbed.hardware.measurements import (
    DECODE_COLUMNS,
    PREFILL_COLUMNS,
    ReadStats,
    aiperf_path,
    read_aiperf,
    read_decode_csv,
    read_prefill_csv,
    read_vllm,
)

# Point rows printed when --all-points is not given: the ones with the largest errors.
SHOWN_POINTS = 40
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "calibrate",
        help="fit a hardware profile (prefill curve, decode step model) to measurements of a real server",
        description="Fit a scenario's hardware profile to measurements: CSV files of prefill and decode-step "
        "times, aiperf per-request exports, or `vllm bench serve --save-result --save-detailed` "
        "results. Prints the fit error per point and on held-out points; --out writes a scenario "
        "that extends --scenario with hardware.NAME replaced (or, with --block-only, the block).",
    )
    src = p.add_argument_group("measurements (repeatable, any mix)")
    src.add_argument(
        "--prefill-csv",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help=f"prefill times: columns {','.join(PREFILL_COLUMNS)} (cached_tokens optional)",
    )
    src.add_argument(
        "--decode-csv",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help=f"decode step times: columns {','.join(DECODE_COLUMNS)} (context = tokens held by the whole batch)",
    )
    src.add_argument(
        "--aiperf",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="aiperf profile_export.jsonl (or its artifacts directory) of one streaming run",
    )
    src.add_argument(
        "--vllm",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="`vllm bench serve --save-result --save-detailed` result JSON (one or more runs)",
    )
    src.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="requests in flight throughout each aiperf/vllm run; default: the batch in force "
        "from the records' timestamps (or vllm's max_concurrency where the file has none)",
    )
    fit = p.add_argument_group("fit")
    fit.add_argument(
        "--prefill",
        choices=["table", "polynomial"],
        default="table",
        help="prefill curve kind (default table: piecewise linear over uncached tokens)",
    )
    fit.add_argument("--points", type=int, default=16, help="table: at most this many points (default 16)")
    fit.add_argument("--degree", type=int, default=2, help="polynomial degree (default 2)")
    fit.add_argument(
        "--holdout-every",
        type=int,
        default=5,
        metavar="K",
        help="score every K-th point held out of the fit (default 5; 0 = none)",
    )
    fit.add_argument(
        "--overhead",
        type=overhead_arg,
        default=None,
        metavar="fit|SECONDS",
        help="the fixed time per prefill (overhead_s): fit = the fitted curve's own time at zero "
        "uncached tokens, named (default); SECONDS = known, the curve fitted to what remains",
    )
    out = p.add_argument_group("output")
    out.add_argument("--name", help="hardware profile name to write (hardware.NAME)")
    out.add_argument(
        "--scenario", action=StoreOnce, metavar="S", help="base scenario the written one extends (name or path)"
    )
    out.add_argument(
        "--out", action=StoreOnce, type=out_file, metavar="FILE", help="write the scenario (or the block) here"
    )
    out.add_argument(
        "--block-only", action="store_true", help="write only `hardware: {NAME: ...}` (a fragment for a list `extends`)"
    )
    out.add_argument("--bs-max", type=int, help="decode BS_max (default: the base's hardware.NAME)")
    out.add_argument(
        "--kv-capacity", metavar="SIZE", help="decode KV memory, e.g. 200GiB (default: the base's hardware.NAME)"
    )
    out.add_argument(
        "--all-points",
        action="store_true",
        help=f"print every point (default: the {SHOWN_POINTS} with the largest errors)",
    )
    out.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=cmd_calibrate)


def overhead_arg(text: str) -> float | None:
    """`fit` -> None (split it off the fitted curve), else seconds >= 0."""
    if text.strip().lower() == "fit":
        return None
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'fit' nor a number of seconds") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: the overhead must be a finite number of seconds >= 0")
    return v


@dataclass
class Calibration:
    sources: list[str]
    notes: list[str]
    prefill: PrefillFit | None
    decode: DecodeFit | None


def calibrate(args: argparse.Namespace) -> Calibration:
    """Read every source, fit what the measurements allow."""
    sources: list[str] = []
    notes: list[str] = []
    pre: list[PrefillPoint] = []
    dec: list[DecodePoint] = []
    for f in args.prefill_csv:
        pts = read_prefill_csv(f)
        pre += pts
        sources.append(f"prefill CSV {f} ({len(pts)} rows)")
    for f in args.decode_csv:
        dpts = read_decode_csv(f)
        dec += dpts
        sources.append(f"decode CSV {f} ({len(dpts)} rows)")
    records: list[RequestRecord] = []
    for f in args.aiperf:
        st = ReadStats()
        records += read_aiperf(f, st)
        sources.append(f"aiperf export {aiperf_path(f)} ({st.used} requests)")
        notes.append(st.note(aiperf_path(f)))
    for f in args.vllm:
        st = ReadStats()
        records += read_vllm(f, st)
        sources.append(f"vllm bench serve result {f} ({st.used} requests)")
        notes.append(st.note(f))
    if not (pre or dec or records):
        raise CalibrationError("no measurements: give --prefill-csv, --decode-csv, --aiperf or --vllm")
    if args.concurrency is not None and args.concurrency < 1:
        raise CalibrationError("--concurrency must be >= 1")
    first_steps: tuple[FirstStep, ...] = ()
    if records:
        analysis = analyse_requests(records, args.concurrency)
        dec += analysis.decode
        first_steps = analysis.first_steps
        notes += analysis.notes
    decode = fit_decode(dec, args.holdout_every) if dec else None
    if records:
        if not first_steps:
            notes.append(
                "no request ran with nothing else in flight, so the records give no prefill points "
                "(measure prefill at concurrency 1)"
            )
        else:
            if decode is None:
                notes.append("no decode measurements: each TTFT is taken as the prefill time alone")
            else:
                notes.append(
                    "prefill from the records: TTFT less the fitted decode step of batch 1 over the prompt "
                    "(median over requests of equal lengths)"
                )
            pts, more = prefill_points(first_steps, decode.step if decode is not None else None)
            pre += pts
            notes += more
    prefill: PrefillFit | None = None
    if pre:
        overhead = getattr(args, "overhead", None)
        prefill = (
            fit_prefill_table(pre, args.points, args.holdout_every, overhead)
            if args.prefill == "table"
            else fit_prefill_polynomial(pre, args.degree, args.holdout_every, overhead)
        )
    if prefill is None and decode is None:
        raise CalibrationError("the measurements gave neither prefill nor decode points")
    return Calibration(sources, notes, prefill, decode)


# ---- the hardware block ----------------------------------------------------------------------


def _g(x: float) -> float | int:
    """Six significant digits (well inside any measurement's precision); whole numbers as ints."""
    v = float(f"{x:.6g}")
    return int(v) if v.is_integer() and abs(v) < 1e15 else v


class HardwareBlock(TypedDict, total=False):
    """`hardware.NAME` as calibrated: the parts measured, and where they came from."""

    prefill: dict[str, object]
    decode: dict[str, object]
    provenance: dict[str, object]


def block_of(cal: Calibration, bs_max: int | None, kv_capacity: int | None) -> HardwareBlock:
    block: HardwareBlock = {}
    if cal.prefill is not None:
        spec = cal.prefill.spec
        d: dict[str, object] = {"kind": spec.kind}
        if spec.kind == "table":
            d["points"] = [[_g(x), _g(y)] for x, y in spec.points]
        else:
            d["coefficients"] = [_g(c) for c in spec.coefficients]
        d["overhead_s"] = _g(spec.overhead_s)
        d["cached_token_s"] = _g(spec.cached_token_s)
        d["cached_attention_s"] = _g(spec.cached_attention_s)
        block["prefill"] = d
    if cal.decode is not None:
        f = cal.decode
        dd: dict[str, object] = {
            "base_s": _g(f.base_s),
            "per_seq_s": _g(f.per_seq_s),
            "per_context_token_s": _g(f.per_context_token_s),
        }
        if bs_max is not None:
            dd["bs_max"] = bs_max
        if kv_capacity is not None:
            dd["kv_capacity_bytes"] = kv_capacity
        block["decode"] = dd
    fit: dict[str, object] = {}
    scores = (
        ("prefill", cal.prefill.train, cal.prefill.held_out) if cal.prefill is not None else None,
        ("decode", cal.decode.train, cal.decode.held_out) if cal.decode is not None else None,
    )
    for part, train, held in (s for s in scores if s is not None):
        fit[f"{part}_points"] = train.n
        fit[f"{part}_max_abs_rel_error"] = _g(train.max_abs)
        if held is not None:
            fit[f"{part}_held_out_max_abs_rel_error"] = _g(held.max_abs)
    block["provenance"] = {"source": "calibrate", "tool": "testbed calibrate", "fit": fit, "notes": list(cal.sources)}
    return block


def _summary_text(s: ErrorSummary | None) -> str:
    if s is None:
        return "none held out"
    return (
        f"{s.n} point{'s' if s.n != 1 else ''}, mean |err| {100 * s.mean_abs:.2f}%, "
        f"max {100 * s.max_abs:.2f}%, rms {100 * s.rms:.2f}%"
    )


def _prefill_title(f: PrefillFit) -> str:
    spec = f.spec
    shape = (
        f"table of {len(spec.points)} points over uncached tokens"
        if spec.kind == "table"
        else f"polynomial of degree {len(spec.coefficients) - 1} in uncached tokens"
    )
    return (
        f"{shape}, fixed overhead_s {spec.overhead_s:.4g} s per prefill, cached_token_s "
        f"{spec.cached_token_s:.3g}, cached_attention_s {spec.cached_attention_s:.3g}"
    )


def _held(every: int) -> str:
    if not every:
        return "held out"
    suffix = "th" if 10 <= every % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(every % 10, "th")
    return f"held out (every {every}{suffix})"


def header_lines(cal: Calibration, name: str, holdout_every: int) -> list[str]:
    held = _held(holdout_every)
    lines = [f"Hardware profile {name!r} calibrated by `testbed calibrate` from:"]
    lines += [f"  {s}" for s in cal.sources]
    if cal.prefill is not None:
        lines.append(f"prefill: {_prefill_title(cal.prefill)}")
        lines.append(f"  fit: {_summary_text(cal.prefill.train)}; {held}: {_summary_text(cal.prefill.held_out)}")
    if cal.decode is not None:
        lines.append("decode: step = base_s + per_seq_s * batch + per_context_token_s * context tokens")
        lines.append(f"  fit: {_summary_text(cal.decode.train)}; {held}: {_summary_text(cal.decode.held_out)}")
    notes = [*cal.notes, *(cal.prefill.notes if cal.prefill else ()), *(cal.decode.notes if cal.decode else ())]
    lines += [f"note: {n}" for n in notes]
    return lines


def _base_decode(base: Scenario | None, name: str) -> DecodeSpec | None:
    hw = base.hardware.get(name) if base is not None else None
    return hw.decode if hw is not None else None


def _capacity_flags(args: argparse.Namespace) -> tuple[int | None, int | None]:
    kv: int | None = None
    if args.kv_capacity is not None:
        v = size_bytes(args.kv_capacity)
        if not isinstance(v, int) or v <= 0:
            raise CalibrationError(f"--kv-capacity {args.kv_capacity!r} is not a size like 200GiB or 214748364800")
        kv = v
    if args.bs_max is not None and args.bs_max < 1:
        raise CalibrationError("--bs-max must be >= 1")
    return args.bs_max, kv


def _write_atomic(path: Path, text: str, check: Callable[[Path], None] | None = None) -> None:
    """Write beside `path` (so relative `extends` resolve the same), check, then move into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".yaml", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        # mkstemp's file is private (0600); the written profile is an ordinary file.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        if check is not None:
            check(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _comment(lines: list[str]) -> str:
    return "".join(f"# {ln}\n" for ln in lines)


def _validate_scenario(path: Path) -> None:
    try:
        load_scenario(path)
    except ScenarioError as e:
        raise CalibrationError(f"the calibrated scenario does not validate: {e}") from None


def write_output(cal: Calibration, args: argparse.Namespace) -> tuple[HardwareBlock, str]:
    """(the hardware block, the YAML text written, or to print without --out). With --out and
    no --block-only: a scenario extending --scenario; otherwise `hardware: {NAME: block}`."""
    base: Scenario | None = None
    base_path: Path | None = None
    if args.scenario is not None:
        base_path = resolve_path(args.scenario)
        try:
            base = load_scenario(base_path)
        except ScenarioError as e:
            raise CalibrationError(
                f"{e}\n(--scenario must be a runnable scenario; for a fragment, write "
                "--block-only and list it in an `extends`)"
            ) from None
    full = args.out is not None and not args.block_only
    if args.out is not None and args.name is None:
        raise CalibrationError("--out needs --name: the hardware profile to write")
    if full and base is None:
        raise CalibrationError("--out needs --scenario, the base to extend (or --block-only)")
    name: str = args.name or "calibrated"
    below = _base_decode(base, name)
    block = block_of(cal, *_capacity_flags(args))
    notes: list[str] = []
    dec = block.get("decode")
    if dec is not None and below is not None and not full:
        # A block on its own must be whole: what was not measured comes from the base.
        dec.setdefault("bs_max", below.bs_max)
        dec.setdefault("kv_capacity_bytes", below.kv_capacity_bytes)
    if dec is not None and below is None and not {"bs_max", "kv_capacity_bytes"} <= dec.keys():
        if full:
            raise CalibrationError(
                f"hardware {name!r} of {args.scenario} has no decode profile to keep BS_max and "
                "KV capacity from: pass --bs-max and --kv-capacity"
            )
        notes.append(
            "the decode block has no bs_max / kv_capacity_bytes (not measured): merge it over a profile "
            "that has them, or pass --bs-max and --kv-capacity"
        )
    if full and base is not None and "prefill" not in block and name not in base.hardware:
        raise CalibrationError(f"hardware {name!r} is new to {args.scenario}: it needs prefill measurements too")
    if base is not None and not any(c.hardware == name for c in base.clusters):
        print(
            f"warning: no cluster of {base.name} uses hardware {name!r} "
            f"(they use: {', '.join(sorted({c.hardware for c in base.clusters}))})",
            file=sys.stderr,
        )
    head = _comment(header_lines(cal, name, args.holdout_every) + [f"note: {n}" for n in notes])
    if not full:
        text = head + yaml.safe_dump({"hardware": {name: block}}, sort_keys=False, default_flow_style=None)
        if args.out is not None:
            _write_atomic(args.out, text)
        return block, text
    assert base is not None and base_path is not None
    out: Path = args.out
    # Relative when the two share a project tree (a scenario beside the shipped ones), else
    # absolute: sharing only "/" or a top-level directory such as /tmp is no shared tree.
    target, here = base_path.resolve(), out.resolve().parent
    shared = len(Path(os.path.commonpath([target, here])).parts) > 2
    doc = {
        "extends": os.path.relpath(target, here) if shared else str(target),
        "name": out.stem if _NAME_RE.match(out.stem) else f"{base.name}-calibrated",
        "description": f"{base.name} with hardware {name!r} calibrated from measurements (see the header)",
        "hardware": {name: block},
    }
    text = head + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None)
    _write_atomic(out, text, _validate_scenario)
    return block, text


# ---- report ----------------------------------------------------------------------------------


def _rows(points: tuple[PointError, ...], all_points: bool) -> tuple[list[PointError], str]:
    if all_points or len(points) <= SHOWN_POINTS:
        return list(points), ""
    worst = sorted(points, key=lambda e: -abs(e.rel_error))[:SHOWN_POINTS]
    order = {id(e): i for i, e in enumerate(points)}
    return (
        sorted(worst, key=lambda e: order[id(e)]),
        f"  ({SHOWN_POINTS} of {len(points)} points, those with the largest errors; --all-points for every one)",
    )


def _table(title: str, cols: tuple[str, str], points: tuple[PointError, ...], all_points: bool) -> list[str]:
    shown, more = _rows(points, all_points)
    w = max([len(title), *(len(e.label) for e in shown)])
    lines = [f"  {title:<{w}}  {cols[0]:>12} {cols[1]:>12} {'measured s':>11} {'fitted s':>11} {'error':>8}"]
    for e in shown:
        mark = "  held out" if e.held_out else ""
        lines.append(
            f"  {e.label:<{w}}  {e.inputs[0]:>12,.6g} {e.inputs[1]:>12,.6g} {e.measured:>11.5f} "
            f"{e.fitted:>11.5f} {100 * e.rel_error:>+7.2f}%{mark}"
        )
    return lines + ([more] if more else [])


def report_lines(cal: Calibration, args: argparse.Namespace) -> list[str]:
    lines = ["data:", *(f"  {s}" for s in cal.sources)]
    held = _held(args.holdout_every)
    if cal.prefill is not None:
        f = cal.prefill
        lines += ["", f"prefill: {_prefill_title(f)}"]
        if f.spec.kind == "table":
            lines.append("  points: " + ", ".join(f"{x:,.0f} -> {y:.4g} s" for x, y in f.spec.points))
        else:
            lines.append("  coefficients: " + ", ".join(f"{c:.6g}" for c in f.spec.coefficients))
        lines += _table("point", ("uncached", "cached"), f.points, args.all_points)
        lines += [f"  fit: {_summary_text(f.train)}", f"  {held}: {_summary_text(f.held_out)}"]
        lines += [f"  note: {n}" for n in f.notes]
    if cal.decode is not None:
        d = cal.decode
        lines += [
            "",
            f"decode: step = {d.base_s:.6g} + {d.per_seq_s:.6g} * batch + "
            f"{d.per_context_token_s:.6g} * context tokens (s)",
        ]
        lines += _table("point", ("batch", "context"), d.points, args.all_points)
        lines += [f"  fit: {_summary_text(d.train)}", f"  {held}: {_summary_text(d.held_out)}"]
        lines += [f"  note: {n}" for n in d.notes]
    if cal.notes:
        lines += ["", *(f"note: {n}" for n in cal.notes)]
    return lines


def _point_json(e: PointError, keys: tuple[str, str]) -> dict[str, object]:
    return {
        "label": e.label,
        keys[0]: e.inputs[0],
        keys[1]: e.inputs[1],
        "measured_s": e.measured,
        "fitted_s": e.fitted,
        "rel_error": e.rel_error,
        "held_out": e.held_out,
    }


def figures(cal: Calibration, block: HardwareBlock, out: Path | None) -> dict[str, object]:
    def summ(s: ErrorSummary | None) -> dict[str, object] | None:
        return asdict(s) if s is not None else None

    doc: dict[str, object] = {
        "sources": cal.sources,
        "notes": cal.notes,
        "block": block,
        "out": str(out) if out is not None else None,
    }
    if cal.prefill is not None:
        f = cal.prefill
        doc["prefill"] = {
            "spec": f.spec.model_dump(mode="json"),
            "train": summ(f.train),
            "held_out": summ(f.held_out),
            "notes": list(f.notes),
            "points": [_point_json(e, ("uncached", "cached")) for e in f.points],
        }
    if cal.decode is not None:
        d = cal.decode
        doc["decode"] = {
            "base_s": d.base_s,
            "per_seq_s": d.per_seq_s,
            "per_context_token_s": d.per_context_token_s,
            "train": summ(d.train),
            "held_out": summ(d.held_out),
            "notes": list(d.notes),
            "points": [_point_json(e, ("batch", "context_tokens")) for e in d.points],
        }
    return doc


def cmd_calibrate(args: argparse.Namespace) -> int:
    cal = calibrate(args)
    block, text = write_output(cal, args)
    if args.json:
        print(json.dumps(figures(cal, block, args.out), indent=2))
        return 0
    print("\n".join(report_lines(cal, args)))
    print()
    if args.out is not None:
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0
