"""`testbed sweep`: one replay per grid point of one or two scenario fields, measured beside the model.

Writes, under the sweep directory DIR:

- `NN-<field>=<value>[_...]/`: a normal run directory per point;
- `sweep.csv` (rewritten after every point, so an interrupted sweep keeps what finished) and
  `sweep.md`: one row per point, the parameter values, measured figures and the analytical
  model's figures for that point (`model_*` columns), all in paper units;
- `model_curve.csv` when `policy.threshold` is swept: Lambda_max and the stage capacities over a
  fine threshold grid (the shape of the paper's Fig. 5b), one curve per value of the other field.

Fields are scenario dotted paths, and list elements are addressed by index
(`clusters.1.prefill`). `load_scenario` deep-merges dictionaries but replaces lists whole, so an
indexed path copies the resolved list into the overrides and edits that copy.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from testbed.config import run_lock
from testbed.config.cli_args import StoreOnce, add_overwrite, out_dir
from testbed.config.overrides import build_overrides, parse_assignments
from testbed.config.resolved import ResolvedScenario
from testbed.config.scenarios import ScenarioError, load_scenario
from testbed.core.schema.scenario import Scenario
from testbed.deploy import registry
from testbed.metrics.artefacts import Summary
from testbed.model.errors import ModelError
from testbed.run.load import load
from testbed.run.run_args import RunArgs, add_run_args, run_assignments, trace_for, warn_if_planned
from testbed.run.stoppable import run_stoppable
from testbed.traces.types import Trace

if TYPE_CHECKING:
    from testbed.studies.capacity.capacity import CapacityResult

# A swept or set field's value as YAML gives it (a number, a string, a bool, a list, ...).
FieldValue = object
# A figure of a row: a number, a status or bottleneck text, None where undefined.
Figure = float | str | None
# One row of sweep.csv (and of --json's points): the point's field values, then its figures.
Row = dict[str, object]

MAX_PARAMS = 2
THRESHOLD_FIELD = "policy.threshold"
CURVE_POINTS = 240  # per spacing (log and linear); enough for a smooth Fig. 5b-like curve
# TTFT needs a full model evaluation per t (~10 ms each): a coarser grid keeps the curve under a second.
TTFT_CURVE_POINTS = 50

MEASURED_COLUMNS: tuple[str, ...] = (
    "status",
    "offered_rate_rps",
    "requests",
    "completed",
    "failed",
    "throughput_rps",
    "goodput_rps",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "tpot_mean_s",
    "offload_ratio",
    "wan_egress_mean_Bps",
    "threshold_used",
    "measured_lambda_max",
    "lowest_unstable_rate",
)
MODEL_COLUMNS: tuple[str, ...] = (
    "model_lambda_max",
    "model_theta_prfaas",
    "model_theta_pdp",
    "model_theta_pdd",
    "model_p",
    "model_ttft_mean_s",
    "model_ttft_p90_s",
    "model_bottleneck",
    "model_load",
    "model_egress_Bps",
    "model_error",
)
CURVE_COLUMNS: tuple[str, ...] = (
    "t",
    "p",
    "l_long",
    "l_short",
    "theta_prfaas",
    "theta_prfaas_compute",
    "theta_prfaas_link",
    "theta_pdp",
    "theta_pdd",
    "prfaas_limit",
    "pdp_limit",
    "lambda_max",
    "ttft_mean_s",
    "ttft_p90_s",
)


# ---------------------------------------------------------------------------------- grid


def parse_param(spec: str) -> tuple[str, list[FieldValue]]:
    """`field.path=v1,v2,...` -> (field, values); each value is parsed as YAML (10, 0.5, auto, true)."""
    key, sep, raw = spec.partition("=")
    key = key.strip()
    if not sep or not key or not raw.strip():
        raise ScenarioError(f"--param {spec!r} must look like field.path=V1,V2,...")
    values = [yaml.safe_load(v.strip()) for v in raw.split(",") if v.strip()]
    if len(values) != len({json.dumps(v, sort_keys=True) for v in values}):
        raise ScenarioError(f"--param {spec!r} repeats a value")
    return key, values


def build_grid(params: Sequence[tuple[str, list[FieldValue]]]) -> list[dict[str, FieldValue]]:
    """Cartesian product, the first field varying slowest."""
    if not params:
        raise ScenarioError("give at least one --param field=V1,V2,...")
    if len(params) > MAX_PARAMS:
        raise ScenarioError(f"at most {MAX_PARAMS} --param fields (a grid of more is too slow to run here)")
    fields = [k for k, _ in params]
    if len(set(fields)) != len(fields):
        raise ScenarioError(f"--param field given twice: {fields}")
    return [dict(zip(fields, combo)) for combo in itertools.product(*(v for _, v in params))]


def point_label(index: int, point: Mapping[str, FieldValue]) -> str:
    """Directory name of a point: `03-policy.threshold=19400`, safe characters only."""
    body = "_".join(f"{k}={_value_text(v)}" for k, v in point.items())
    return f"{index:02d}-" + re.sub(r"[^A-Za-z0-9._=+-]+", "-", body)[:120]


def _value_text(v: object) -> str:
    return v if isinstance(v, str) else json.dumps(v)


@dataclass
class Point:
    index: int
    values: dict[str, FieldValue]
    resolved: ResolvedScenario
    overrides: dict[str, Any]

    @property
    def scenario(self) -> Scenario:
        return self.resolved.spec

    @property
    def label(self) -> str:
        return point_label(self.index, self.values)


def plan_points(
    scenario: str, base: Sequence[tuple[str, FieldValue]], grid: Sequence[Mapping[str, FieldValue]]
) -> list[Point]:
    """Load and validate every point's scenario before anything runs: a bad value fails the sweep
    at once, naming the point, rather than after an hour of runs."""
    resolved = load_scenario(scenario).model_dump(mode="json")
    points = []
    for i, values in enumerate(grid):
        ov = build_overrides(resolved, [*base, *values.items()])
        try:
            rs = load(scenario, ov)
        except ScenarioError as e:
            where = ", ".join(f"{k}={_value_text(v)}" for k, v in values.items())
            raise ScenarioError(f"sweep point {where}: {e}") from None
        points.append(Point(i, dict(values), rs, ov))
    return points


# ---------------------------------------------------------------------------------- figures


def measured_figures(summary: Summary | None, status: str) -> dict[str, Figure]:
    """A row's measured columns; all None when the point left no readable summary."""
    if summary is None:
        return {
            "status": status,
            **{k: None for k in MEASURED_COLUMNS[1:-2]},
        }  # between status and the capacity columns
    s = summary
    return {
        "status": status,
        "offered_rate_rps": s.run.offered_rate_rps,
        "requests": s.requests.total,
        "completed": s.requests.completed,
        "failed": s.requests.failed,
        "throughput_rps": s.throughput.completed_rps_paper,
        "goodput_rps": s.throughput.goodput_rps_paper,
        "ttft_mean_s": s.ttft_s.mean,
        "ttft_p50_s": s.ttft_s.p50,
        "ttft_p90_s": s.ttft_s.p90,
        "ttft_p99_s": s.ttft_s.p99,
        "tpot_mean_s": s.tpot_s.mean,
        "offload_ratio": s.offload.ratio,
        "wan_egress_mean_Bps": s.wan_egress.mean_Bps_paper,
        "threshold_used": s.run.threshold,
    }


def _model_threshold(sc: Scenario, link_bps: float) -> int | None:
    from testbed.model.optimise import resolve_threshold

    # The router resolves "auto" the same way, so the model sees the threshold the run used.
    return resolve_threshold(sc, link_bps) if sc.policy.name == "prfaas" else None


def model_figures(sc: Scenario, link_bps: float) -> dict[str, Figure]:
    from testbed.model.analytical import evaluate

    out: dict[str, Figure] = {k: None for k in MODEL_COLUMNS}
    try:
        r = evaluate(sc, link_bps, threshold=_model_threshold(sc, link_bps))
    except ModelError as e:  # e.g. a field value the model cannot evaluate; the run still counts
        out["model_error"] = str(e)
        return out
    rate = sc.workload.rate
    out.update(
        {
            "model_lambda_max": r.lambda_max,
            "model_theta_prfaas": r.theta_prfaas,
            "model_theta_pdp": r.theta_pdp,
            "model_theta_pdd": r.theta_pdd,
            "model_p": r.p,
            "model_ttft_mean_s": r.ttft_mean_s,
            "model_ttft_p90_s": r.ttft_p90_s,
            "model_bottleneck": r.bottleneck,
            "model_load": rate / r.lambda_max if r.lambda_max > 0 else None,
            # Bytes/s like the measured wan_egress column (the model works in bits/s).
            "model_egress_Bps": r.egress_at(rate) / 8.0,
        }
    )
    return out


def threshold_grid(sc: Scenario, extra: Sequence[float] = (), points: int | None = None) -> Any:
    """Thresholds over the input length support, log- and linearly spaced (Fig. 5b spans both
    short and long t), plus the swept values so the curve passes through the measured points."""
    lo, hi = float(sc.workload.input.min), float(sc.workload.input.max)
    n = CURVE_POINTS if points is None else points
    ts = np.concatenate(
        [
            np.geomspace(lo, hi, n),
            np.linspace(lo, hi, n),
            np.asarray([t for t in extra if lo <= t <= hi], dtype=np.float64),
        ]
    )
    return np.unique(np.round(ts))


def model_curve(sc: Scenario, link_bps: float, extra: Sequence[float] = ()) -> list[dict[str, float | None]]:
    """Analytical figures of the `prfaas` policy for each t of `threshold_grid` (paper units);
    queue-free TTFT only on the coarser TTFT grid (empty elsewhere)."""
    from testbed.core.engine.kvsize import KVModel
    from testbed.model.analytical import LengthDistribution, StagePools, evaluate, threshold_curves

    dep = StagePools.from_scenario(sc)
    if not dep.prfaas or not dep.pd_prefill:
        raise ModelError(f"scenario {sc.name!r} lacks PrfaaS or PD prefill instances: no threshold curve")
    ttft_ts = threshold_grid(sc, extra, TTFT_CURVE_POINTS)
    ts = np.union1d(threshold_grid(sc, extra), ttft_ts)
    with_ttft = set(ttft_ts.tolist())
    cur = threshold_curves(
        dep, LengthDistribution.from_spec(sc.workload.input), KVModel.from_spec(sc.model), ts, link_bps
    )
    prfaas_sc = (
        sc
        if sc.policy.name == "prfaas"
        else sc.model_copy(update={"policy": sc.policy.model_copy(update={"name": "prfaas", "threshold": 0})})
    )
    rows = []
    for i, t in enumerate(ts):
        ev = evaluate(prfaas_sc, link_bps, threshold=int(t)) if float(t) in with_ttft else None
        rows.append(
            {
                "t": float(t),
                "p": float(cur.p[i]),
                "l_long": float(cur.l_long[i]),
                "l_short": float(cur.l_short[i]),
                "theta_prfaas": float(cur.theta_prfaas[i]),
                "theta_prfaas_compute": float(cur.theta_prfaas_compute[i]),
                "theta_prfaas_link": float(cur.theta_prfaas_link[i]),
                "theta_pdp": float(cur.theta_pdp[i]),
                "theta_pdd": float(cur.theta_pdd),
                "prfaas_limit": float(cur.prfaas_limit[i]),
                "pdp_limit": float(cur.pdp_limit[i]),
                "lambda_max": float(cur.lambda_max[i]),
                "ttft_mean_s": ev.ttft_mean_s if ev else None,
                "ttft_p90_s": ev.ttft_p90_s if ev else None,
            }
        )
    return rows


# ---------------------------------------------------------------------------------- outputs


def _cell(v: object) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return "" if not math.isfinite(v) else repr(v)
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return str(v)


def write_csv(path: Path, columns: Sequence[str], rows: Sequence[Mapping[str, object]]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow([_cell(r.get(c)) for c in columns])
    tmp.replace(path)  # readers (a notebook mid-sweep) never see half a file


def table_columns(fields: Sequence[str]) -> list[str]:
    return ["point", *fields, "run_dir", *MEASURED_COLUMNS, *MODEL_COLUMNS]


@dataclass(frozen=True)
class SweepFacts:
    """What sweep.md says of the sweep as a whole."""

    scenario: str
    backend: str
    requests: int
    rate: float
    speedup: float
    byte_scale: float
    started: str


def sweep_markdown(rows: Sequence[Row], fields: Sequence[str], facts: SweepFacts, curve: Path | None) -> str:
    from testbed.metrics.markdown_table import md_table
    from testbed.metrics.report_format import fmt, fmt_ms, fmt_pct, fmt_rate

    def opt(v: object, f: Callable[[float], str] = fmt) -> str:
        return f(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "n/a"

    head = [
        *fields,
        "status",
        "done / total",
        "failed",
        "thr (req/s)",
        "TTFT mean / P90 / P99 (s)",
        "TPOT mean",
        "offload",
        "WAN egress mean",
        "measured Λ_max",
        "model Λ_max",
        "model Θ prfaas / pdp / pdd",
        "model p",
        "model TTFT mean / P90 (s)",
        "load ρ",
    ]
    body = []
    for r in rows:
        body.append(
            [
                *(_value_text(r[f]) for f in fields),
                str(r["status"]),
                f"{opt(r['completed'])} / {opt(r['requests'])}",
                opt(r["failed"]),
                opt(r["throughput_rps"]),
                f"{opt(r['ttft_mean_s'])} / {opt(r['ttft_p90_s'])} / {opt(r['ttft_p99_s'])}",
                opt(r["tpot_mean_s"], fmt_ms),
                opt(r["offload_ratio"], fmt_pct),
                opt(r["wan_egress_mean_Bps"], fmt_rate),
                opt(r.get("measured_lambda_max")),
                opt(r["model_lambda_max"]),
                " / ".join(opt(r[k]) for k in ("model_theta_prfaas", "model_theta_pdp", "model_theta_pdd")),
                opt(r["model_p"], fmt_pct),
                f"{opt(r['model_ttft_mean_s'])} / {opt(r['model_ttft_p90_s'])}",
                opt(r["model_load"]),
            ]
        )
    lines = [
        f"# Sweep of {facts.scenario} over {', '.join(fields)}",
        "",
        f"Backend {facts.backend}; {facts.requests} requests per point at {fmt(facts.rate)} req/s offered "
        f"(paper units); speedup {facts.speedup:g}, byte_scale {facts.byte_scale:g}; started {facts.started}.",
        "Measured figures are paper units from each point's summary.json; `model` columns are the queue-free "
        "analytical model (`testbed model`) for the point's scenario, load ρ = offered rate / model Λ_max.",
        "",
        md_table(head, body),
        "",
        f"Rows: `sweep.csv`.{f' Analytical curve over t: `{curve.name}`.' if curve is not None else ''}",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- command


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sweep",
        help="replay a scenario once per grid point of one or two fields; measured vs analytical table",
        description="Run a scenario once per value (or pair of values) of scenario fields and write "
        "DIR/sweep.csv, DIR/sweep.md and, when policy.threshold is swept, DIR/model_curve.csv.",
    )
    p.add_argument("--scenario", action=StoreOnce, required=True, help="scenario name (scenarios/NAME.yaml) or path")
    p.add_argument(
        "--param",
        action="append",
        required=True,
        metavar="FIELD=V1,V2,...",
        help="a scenario field and its values, e.g. policy.threshold=10000,19400,40000 or "
        "clusters.1.prefill=2,3,4 (list elements by index); at most twice",
    )
    add_run_args(
        p, requests_help="requests per point (workload.requests; with --trace, its first N after --window and --sample)"
    )
    p.add_argument("--backend", action=StoreOnce, **registry.backend_option(lead="where every point runs"))
    p.add_argument(
        "--out",
        action=StoreOnce,
        type=out_dir,
        metavar="DIR",
        help="sweep directory (default runs/<time>-sweep-<scenario>)",
    )
    add_overwrite(p, "the sweep directory")
    p.add_argument(
        "--capacity-probes",
        type=int,
        default=0,
        metavar="N",
        help="measure Lambda_max at every point by a capacity search of N replays (testbed capacity) "
        "instead of one replay at the offered rate",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a scenario field for every point (repeatable; list indices allowed)",
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        default=100.0,
        help="PrfaaS egress link B_out of the analytical model, Gbit/s (default 100, as `testbed model`)",
    )
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(func=cmd_sweep)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _read_summary(run_dir: Path) -> Summary | None:
    from testbed.metrics.summary import read_summary

    try:
        return read_summary(run_dir / "summary.json")
    except ValueError:  # the point failed before writing one, or left a broken one: its row says why
        return None


def cmd_sweep(args: argparse.Namespace) -> int:
    link_bps = float(args.link_gbps) * 1e9
    try:
        if link_bps <= 0:
            raise ScenarioError("--link-gbps must be > 0")
        params = [parse_param(s) for s in args.param]
        base = [*parse_assignments(args.set), *run_assignments(RunArgs.from_args(args))]
        points = plan_points(args.scenario, base, build_grid(params))
    except ScenarioError as e:
        print(f"sweep: {e}", file=sys.stderr)
        return 2
    fields = [k for k, _ in params]
    first = points[0].scenario
    trace = trace_for(None, RunArgs.from_args(args)) if args.trace is not None else None
    if trace is None:
        warn_if_planned(first)
    args.backend, warning = registry.pick_backend(args.backend)
    registry.refuse_unhonoured(args.backend, (pt.resolved for pt in points))
    registry.check_host(args.backend)
    registry.check_capacity(args.backend, (pt.resolved for pt in points), args.force_capacity)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    out: Path = args.out or Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-sweep-{first.name}"
    run_lock.acquire(out, args.overwrite)  # this command's until it returns
    facts = SweepFacts(
        scenario=first.name,
        backend=args.backend,
        requests=first.workload.requests if trace is None else len(trace),
        rate=first.workload.rate if trace is None else trace.rate,
        speedup=first.scale.speedup,
        byte_scale=first.scale.byte_scale,
        started=f"{datetime.now():%Y-%m-%d %H:%M:%S}",
    )

    curve_path = _write_curve(out, points, fields, link_bps)
    columns = table_columns(fields)
    rows: list[Row] = []
    interrupted = errors = False

    def flush() -> None:
        write_csv(out / "sweep.csv", columns, rows)
        (out / "sweep.md").write_text(sweep_markdown(rows, fields, facts, curve_path))

    try:
        for pt in points:
            if _run_and_record(pt, out, args.backend, link_bps, len(points), rows, args.capacity_probes, trace):
                interrupted = True
            errors = errors or str(rows[-1]["status"]).startswith("error")
            flush()
            if interrupted:
                break
    except KeyboardInterrupt:  # between points (model figures, writing files): keep what finished
        interrupted = True
        flush()
    if interrupted:
        _log(f"interrupted: kept {len(rows)} of {len(points)} points in {out / 'sweep.csv'}")
    if args.json:
        print(json.dumps({"scenario": first.name, "params": fields, "dir": str(out), "points": rows}, indent=1))
    else:
        print((out / "sweep.md").read_text())
        print(f"wrote {out / 'sweep.csv'}, {out / 'sweep.md'}" + (f", {curve_path}" if curve_path else ""))
    return 130 if interrupted else (1 if errors else 0)


def _run_and_record(
    pt: Point,
    out: Path,
    backend: str,
    link_bps: float,
    n: int,
    rows: list[Row],
    capacity_probes: int = 0,
    trace: Trace | None = None,
) -> bool:
    """Run one point and append its row; True when Ctrl-C stopped it. With `capacity_probes`,
    the point is a capacity search (testbed.studies.capacity.capacity) and its row carries the measured
    Lambda_max and the figures of the highest stable probe. Every point replays the scenario's
    workload, or `trace` (--trace) the same for all."""
    run_dir = out / pt.label
    where = ", ".join(f"{k}={_value_text(v)}" for k, v in pt.values.items())
    _log(
        f"[{pt.index + 1}/{n}] {where}: {pt.scenario.workload.requests if trace is None else len(trace)} requests "
        f"-> {run_dir}"
    )
    status, interrupted = "ok", False
    extra: dict[str, Figure] = {}
    summary_dir = run_dir
    try:
        if capacity_probes:
            res = run_stoppable(_capacity_point(pt, run_dir, backend, capacity_probes, link_bps, trace))
            extra = {"measured_lambda_max": res.lambda_max, "lowest_unstable_rate": res.lowest_unstable}
            best = [p for p in res.probes if p.stable and p.rate == res.lambda_max]
            summary_dir = Path(best[0].run_dir) if best else run_dir
        else:
            run_stoppable(_run_point(pt, run_dir, backend, trace))
    except KeyboardInterrupt:
        # The runner has stopped its services and summarised what finished before re-raising.
        status, interrupted = "interrupted", True
    except Exception as e:  # one broken point must not lose the others: record it and go on
        status = f"error: {type(e).__name__}: {e}"
    row: Row = {
        "point": pt.index,
        **pt.values,
        "run_dir": pt.label,
        **measured_figures(_read_summary(summary_dir), status),
        **extra,
        **model_figures(pt.scenario, link_bps),
    }
    rows.append(row)
    _log(
        f"    {status}: completed {row['completed']}/{row['requests']}, TTFT mean {_short(row['ttft_mean_s'])} s, "
        f"P90 {_short(row['ttft_p90_s'])} s, throughput {_short(row['throughput_rps'])} req/s "
        f"(model Λ_max {_short(row['model_lambda_max'])}, TTFT mean {_short(row['model_ttft_mean_s'])} s)"
    )
    return interrupted


def _short(v: object) -> str:
    return f"{v:.3g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "n/a"


async def _capacity_point(
    pt: Point, run_dir: Path, backend: str, probes: int, link_bps: float, trace: Trace | None = None
) -> CapacityResult:
    from testbed.studies.capacity.capacity import model_lambda, search, write_outputs

    model = model_lambda(pt.scenario, link_bps, trace) or 1.0
    run_dir.mkdir(parents=True, exist_ok=True)
    res = await search(
        pt.resolved, run_dir, backend, 0.75 * model, 1.25 * model, probes, 0.25, pt.scenario.slo.ttft_s, trace=trace
    )
    write_outputs(res, run_dir)
    return res


async def _run_point(pt: Point, run_dir: Path, backend: str, trace: Trace | None = None) -> None:
    from testbed.run.runner import run_replay_async
    from testbed.traces.loader import trace_from_workload

    if trace is None:
        trace = trace_from_workload(pt.scenario.workload)
    await run_replay_async(pt.resolved, trace, run_dir, backend, name=f"{pt.scenario.name} {pt.label[3:]}")


def _write_curve(out: Path, points: Sequence[Point], fields: Sequence[str], link_bps: float) -> Path | None:
    """model_curve.csv: one analytical curve over t per value of the other swept field."""
    if THRESHOLD_FIELD not in fields:
        return None
    others = [f for f in fields if f != THRESHOLD_FIELD]
    rows: list[Row] = []
    seen: set[str] = set()
    for pt in points:
        key = json.dumps([pt.values[f] for f in others])
        if key in seen:
            continue
        seen.add(key)
        swept = [
            float(t)
            for p in points
            if isinstance(t := p.values[THRESHOLD_FIELD], (int, float))
            and json.dumps([p.values[f] for f in others]) == key
        ]
        try:
            curve = model_curve(pt.scenario, link_bps, swept)
        except ModelError as e:
            _log(f"no model curve: {e}")
            return None
        rows += [{**{f: pt.values[f] for f in others}, **r} for r in curve]
    path = out / "model_curve.csv"
    write_csv(path, [*others, *CURVE_COLUMNS], rows)
    return path
