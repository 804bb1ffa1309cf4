"""`testbed regress RUN --baseline FILE`: a pass/fail gate on a run's figures, for users' CI.

A baseline file (YAML) names summary.json figures by dotted key, each with the value a
reference run measured, a tolerance and a direction:

    metrics:
      ttft_s.mean: {baseline: 2.04, direction: lower_is_better, rel: 0.15}
      requests.failed: {baseline: 0, direction: lower_is_better, abs: 0}

The allowance is max(rel * |baseline|, abs) (either may be left out; both out means exact):
`lower_is_better` fails above baseline + allowance, `higher_is_better` below baseline -
allowance, `both` outside either side. A figure the run lacks (absent, or null because the
set it is taken over is empty) fails. `taken_from` records what the baseline was measured on;
a run that differs there gets a warning, not a failure, because comparing across setups is
sometimes what a user means to do.

Exit codes: 0 every metric within tolerance, 1 at least one outside, 2 unreadable input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from testbed.config.input_files import MAX_CONFIG_BYTES, InputFileError, read_text_capped
from testbed.config.loader import loc_text, yaml_problem
from testbed.metrics.artefacts import RunDirError, RunInfo, Summary, read_artefact
from testbed.metrics.summary import SCHEMA_VERSION

Direction = Literal["lower_is_better", "higher_is_better", "both"]
BASELINE_SCHEMA = 1

# What `--update` records when no baseline exists yet, in this order.
DEFAULT_METRICS: tuple[str, ...] = (
    "requests.failed",
    "throughput.completed_rps_paper",
    "ttft_s.mean",
    "ttft_s.p50",
    "ttft_s.p90",
    "ttft_s.p99",
    "tpot_s.mean",
    "offload.ratio",
    "wan_egress.mean_Bps_paper",
)


class RegressError(ValueError):
    """Unreadable input: the message names the file."""


class MetricSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    baseline: float
    direction: Direction
    rel: float | None = Field(default=None, ge=0)
    abs: float | None = Field(default=None, ge=0)


class TakenFrom(BaseModel):
    """What the baseline was measured on; every field optional so hand-written files stay short."""

    model_config = ConfigDict(extra="allow")

    run: str | None = None
    scenario: str | None = None
    policy: str | None = None
    threshold: float | None = None
    speedup: float | None = None
    byte_scale: float | None = None
    shaping: str | None = None
    backend: str | None = None
    requests: int | None = None
    offered_rate_rps: float | None = None
    created: str | None = None
    note: str | None = None


class Baseline(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_: int = Field(default=BASELINE_SCHEMA, alias="schema")
    taken_from: TakenFrom = TakenFrom()
    metrics: dict[str, MetricSpec] = Field(min_length=1)


def default_spec(key: str, value: float) -> MetricSpec:
    """Default direction and tolerance of a summary key.

    Latency on a shared machine is noisy, and more so in the tail: 15% on means and medians,
    20% on P90, 25% on P99; throughput 10%. Counts of failures must not grow at all. Offload
    ratio follows from the seeded workload and the threshold, so 2 points absolute. Byte and
    egress figures are neither better nor worse when they move, so they are checked both ways.
    """
    last = key.rsplit(".", 1)[-1]
    if key in ("requests.failed", "requests.pending"):
        return MetricSpec(baseline=value, direction="lower_is_better", abs=0)
    if key == "requests.completed":
        return MetricSpec(baseline=value, direction="higher_is_better", abs=0)
    if key.startswith("throughput."):
        return MetricSpec(baseline=value, direction="higher_is_better", rel=0.10)
    if key == "offload.ratio":
        return MetricSpec(baseline=value, direction="both", abs=0.02)
    if key.startswith(("ttft_s.", "tpot_s.", "wire.ttft_s.", "wire.tpot_s.")):
        rel = {"p90": 0.20, "p99": 0.25}.get(last, 0.15)
        return MetricSpec(baseline=value, direction="lower_is_better", rel=rel)
    if key.startswith(("ttft_breakdown_s.", "wire.ttft_breakdown_s.")):
        # Small stages (a few ms) swing by large ratios: an absolute floor of 10 ms paper.
        return MetricSpec(baseline=value, direction="lower_is_better", rel=0.25, abs=0.01)
    return MetricSpec(baseline=value, direction="both", rel=0.15)


# ---------------------------------------------------------------------------------- inputs


def lookup(figures: Mapping[str, Any], key: str) -> Any:
    """Value at a dotted key of a summary's JSON content (`Summary.to_json_dict()`: baseline keys
    are the file's keys, so they are looked up in what the file holds). Keys may themselves hold
    dots (`links.pd-p0{dest=127.0.0.1:4000}...`): at each level the longest matching prefix of the
    remaining parts wins."""
    node: Any = figures
    parts = key.split(".")
    i = 0
    while i < len(parts):
        if not isinstance(node, dict):
            raise KeyError(key)
        for j in range(len(parts), i, -1):
            cand = ".".join(parts[i:j])
            if cand in node:
                node, i = node[cand], j
                break
        else:
            raise KeyError(key)
    return node


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def load_baseline(path: Path) -> Baseline:
    try:
        raw = yaml.safe_load(read_text_capped(path, MAX_CONFIG_BYTES))
    except InputFileError as e:
        raise RegressError(str(e)) from None
    except OSError as e:
        raise RegressError(f"{path}: cannot read baseline: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise RegressError(yaml_problem(path, e)) from None
    if not isinstance(raw, dict):
        raise RegressError(f"{path}: a baseline is a mapping with 'metrics:', got {type(raw).__name__}")
    known = {f.alias or n for n, f in Baseline.model_fields.items()}
    if raw and not any(k in known for k in raw):  # not ours: quote none of its keys
        raise RegressError(
            f"{path}: not a baseline: none of its {len(raw)} top-level keys is one of its fields "
            f"({', '.join(sorted(known))})"
        )
    try:
        b = Baseline.model_validate(raw)
    except ValidationError as e:
        fields = "; ".join(f"field '{loc_text(err['loc'])}': {err['msg']}" for err in e.errors())
        raise RegressError(f"{path}: invalid baseline: {fields}") from None
    if b.schema_ != BASELINE_SCHEMA:
        raise RegressError(f"{path}: baseline schema {b.schema_} is not {BASELINE_SCHEMA}")
    return b


def load_run(run: Path) -> tuple[Summary, RunInfo | None, Path]:
    """(summary, run.json or None, run directory). RUN is a run directory or its summary.json;
    a directory without summary.json is summarised from its records (nothing is written). A
    summary of any version up to this testbed's reads (one without `schema_version` is version 1)."""
    if run.is_file():
        spath, run_dir = run, run.parent
    elif run.is_dir():
        spath, run_dir = run / "summary.json", run
    else:
        raise RegressError(f"{run}: no such run directory or summary file")
    try:
        if spath.exists():
            summary = read_artefact(spath, Summary)
        else:
            from testbed.metrics.summary import summarize

            summary = summarize(run_dir)
    except (OSError, ValueError) as e:  # their messages name the file (and the field)
        raise RegressError(str(e)) from None
    meta: RunInfo | None = None
    try:
        meta = read_artefact(run_dir / "run.json", RunInfo)
    except RunDirError:
        pass  # only the backend comes from here; the summary carries every other fact
    return summary, meta, run_dir


def run_facts(summary: Summary, meta: RunInfo | None, run_dir: Path | None = None) -> TakenFrom:
    run = summary.run
    return TakenFrom(
        run=str(run_dir) if run_dir is not None else None,
        scenario=run.scenario,
        policy=run.policy,
        threshold=_number(run.threshold),
        speedup=_number(run.speedup),
        byte_scale=_number(run.byte_scale),
        shaping=run.shaping_method,
        backend=meta.backend if meta is not None else None,
        requests=summary.requests.total,
        offered_rate_rps=_number(run.offered_rate_rps),
    )


# ---------------------------------------------------------------------------------- check


@dataclass
class MetricResult:
    key: str
    direction: Direction
    baseline: float
    measured: float | None
    rel: float | None
    abs: float | None
    low: float | None  # allowed band; None = unbounded on that side
    high: float | None
    passed: bool
    note: str = ""

    @property
    def change(self) -> float | None:
        if self.measured is None or self.baseline == 0:
            return None
        return self.measured / self.baseline - 1.0


@dataclass
class Verdict:
    results: list[MetricResult]
    warnings: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[MetricResult]:
        return [r for r in self.results if not r.passed]

    @property
    def passed(self) -> bool:
        return not self.failed

    def to_dict(self) -> dict[str, object]:
        return {
            "verdict": "pass" if self.passed else "fail",
            "failed": [r.key for r in self.failed],
            "warnings": self.warnings,
            "metrics": [{**asdict(r), "change": r.change} for r in self.results],
        }


def band(spec: MetricSpec) -> tuple[float | None, float | None]:
    allow = max(spec.rel * abs(spec.baseline) if spec.rel is not None else 0.0, spec.abs or 0.0)
    lo = None if spec.direction == "lower_is_better" else spec.baseline - allow
    hi = None if spec.direction == "higher_is_better" else spec.baseline + allow
    return lo, hi


def check_metric(key: str, spec: MetricSpec, figures: Mapping[str, Any]) -> MetricResult:
    """One metric against the summary's JSON content (`Summary.to_json_dict()`)."""
    lo, hi = band(spec)
    note = ""
    try:
        measured = _number(lookup(figures, key))
        if measured is None:
            note = "null or not a number in the run's summary"
    except KeyError:
        measured, note = None, "not in the run's summary"
    passed = measured is not None
    if measured is not None:
        # A hair of slack so a rerun that reproduces the baseline exactly never fails on rounding.
        eps = 1e-9 * max(1.0, abs(spec.baseline))
        passed = (lo is None or measured >= lo - eps) and (hi is None or measured <= hi + eps)
    return MetricResult(key, spec.direction, spec.baseline, measured, spec.rel, spec.abs, lo, hi, passed, note)


def mismatches(base: TakenFrom, run: TakenFrom) -> list[str]:
    """Setup facts where the run differs from the baseline's reference run."""
    out: list[str] = []
    for name in (
        "scenario",
        "policy",
        "threshold",
        "speedup",
        "byte_scale",
        "shaping",
        "backend",
        "requests",
        "offered_rate_rps",
    ):
        a, b = getattr(base, name), getattr(run, name)
        if a is None or b is None:
            continue
        if isinstance(a, float) or isinstance(b, float):
            same = math.isclose(float(a), float(b), rel_tol=1e-3)
        else:
            same = a == b
        if not same:
            out.append(f"{name} {_show(b)} (baseline {_show(a)})")
    return out


def check(baseline: Baseline, summary: Summary, facts: TakenFrom) -> Verdict:
    figures = summary.to_json_dict()
    v = Verdict([check_metric(k, s, figures) for k, s in baseline.metrics.items()])
    diff = mismatches(baseline.taken_from, facts)
    if diff:
        v.warnings.append("run differs from the baseline's reference run: " + ", ".join(diff))
    if summary.run.interrupted:
        v.warnings.append("the run was interrupted; its figures cover what finished")
    if summary.layout not in (None, 1, SCHEMA_VERSION):
        v.warnings.append(f"summary schema {summary.layout!r}; this testbed writes {SCHEMA_VERSION}")
    if summary.validity is not None and not summary.validity.valid:
        # A run the testbed could not time faithfully measures nothing; it cannot pass a gate.
        v.results.append(
            MetricResult(
                "validity.valid", "higher_is_better", 1.0, 0.0, None, None, 1.0, None, False, "the run is invalid"
            )
        )
        v.warnings.append("the run is marked invalid: " + "; ".join(summary.validity.reasons))
    return v


def apply_overrides(metrics: dict[str, MetricSpec], rel: dict[str, float], abs_: dict[str, float]) -> None:
    for key, r in rel.items():
        if key in metrics:
            metrics[key] = metrics[key].model_copy(update={"rel": r})
    for key, a in abs_.items():
        if key in metrics:
            metrics[key] = metrics[key].model_copy(update={"abs": a})


def make_baseline(
    summary: Summary,
    facts: TakenFrom,
    previous: Baseline | None = None,
    extra: tuple[str, ...] = (),
    note: str | None = None,
) -> tuple[Baseline, list[str]]:
    """A baseline holding the run's values; (baseline, keys skipped because the run has no value).

    With a `previous` baseline its metric list, directions and tolerances are kept (they may have
    been tuned by hand) and only the values and `taken_from` are renewed.
    """
    keys = list(previous.metrics) if previous is not None else list(DEFAULT_METRICS)
    keys += [k for k in extra if k not in keys]
    metrics: dict[str, MetricSpec] = {}
    skipped: list[str] = []
    figures = summary.to_json_dict()
    for key in keys:
        try:
            value = _number(lookup(figures, key))
        except KeyError:
            value = None
        if value is None:
            skipped.append(key)
            continue
        # 6 significant figures: the file stays readable and noise is far above that.
        value = float(f"{value:.6g}")
        old = previous.metrics.get(key) if previous is not None else None
        metrics[key] = old.model_copy(update={"baseline": value}) if old is not None else default_spec(key, value)
    taken = facts.model_copy(
        update={
            "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "note": note if note is not None else (previous.taken_from.note if previous is not None else None),
        }
    )
    if not metrics:
        raise RegressError(f"the run has no value for any of {', '.join(keys)}")
    return Baseline(schema=BASELINE_SCHEMA, taken_from=taken, metrics=metrics), skipped


_HEADER = """\
# testbed regress baseline (`testbed regress RUN --baseline THIS_FILE`).
# Each metric is a summary.json dotted key. Allowed deviation = max(rel * |baseline|, abs):
# lower_is_better fails above baseline + allowance, higher_is_better below baseline - allowance,
# both on either side. Regenerate with `testbed regress RUN --baseline THIS_FILE --update`
# (keeps the metric list and tolerances below, renews values and taken_from).
"""


def dump_baseline(b: Baseline) -> str:
    data = b.model_dump(mode="json", by_alias=True, exclude_none=True)
    return _HEADER + yaml.safe_dump(data, sort_keys=False, width=110)


# ---------------------------------------------------------------------------------- output


def _show(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def _format_or_dash(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def band_text(r: MetricResult) -> str:
    if r.low is None and r.high is None:
        return "any"
    if r.low is None:
        return f"<= {_format_or_dash(r.high)}"
    if r.high is None:
        return f">= {_format_or_dash(r.low)}"
    return f"[{_format_or_dash(r.low)}, {_format_or_dash(r.high)}]"


def tolerance_text(r: MetricResult) -> str:
    parts = [f"rel {r.rel:.0%}" if r.rel * 100 == round(r.rel * 100) else f"rel {r.rel:g}"] if r.rel is not None else []
    parts += [f"abs {r.abs:g}"] if r.abs is not None else []
    return " or ".join(parts) if parts else "exact"


def failure_line(r: MetricResult) -> str:
    measured = "missing" if r.measured is None else _format_or_dash(r.measured)
    change = "" if r.change is None else f" ({r.change:+.1%})"
    why = f"; {r.note}" if r.note else ""
    return (
        f"FAIL {r.key}: measured {measured} vs baseline {_format_or_dash(r.baseline)}{change}, allowed {band_text(r)} "
        f"({r.direction.replace('_', ' ')}; tolerance {tolerance_text(r)}){why}"
    )


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    c = Console(stderr=stderr)
    # CI logs are not terminals and rich would squeeze the table into 80 columns.
    return c if c.is_terminal else Console(stderr=stderr, width=160)


_DIRECTION_SHORT = {"lower_is_better": "lower better", "higher_is_better": "higher better", "both": "both ways"}


def _table(title: str, results: list[MetricResult], with_measured: bool = True) -> Any:
    from rich.table import Table
    from rich.text import Text

    t = Table(title=Text(title))
    t.add_column("Metric", no_wrap=True)
    t.add_column("Direction")
    t.add_column("Baseline", justify="right")
    if with_measured:
        t.add_column("Measured", justify="right")
        t.add_column("Change", justify="right")
    t.add_column("Allowed", justify="right")
    t.add_column("Tolerance")
    if with_measured:
        t.add_column("Verdict")
    for r in results:
        row = [r.key, _DIRECTION_SHORT[r.direction], _format_or_dash(r.baseline)]
        if with_measured:
            row += [_format_or_dash(r.measured), "-" if r.change is None else f"{r.change:+.1%}"]
        row += [band_text(r), tolerance_text(r)]
        if with_measured:
            row.append("ok" if r.passed else "FAIL")
        t.add_row(*(Text(c, style="red" if with_measured and not r.passed and c == "FAIL" else "") for c in row))
    return t


# ---------------------------------------------------------------------------------- command


def _parse_pairs(pairs: list[str], flag: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        raw = raw.strip()
        try:
            val = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
        except ValueError:
            val = -1.0
        if not sep or not key or not math.isfinite(val) or val < 0:
            raise RegressError(f"{flag} {pair!r}: expected KEY=VALUE with VALUE >= 0 (e.g. ttft_s.p99=0.3 or =30%)")
        out[key.strip()] = val
    return out


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "regress",
        help="check a run against a stored baseline; exit 1 when a metric is outside its tolerance",
        description="Compare a run's summary.json with a baseline file (YAML). Exit 0: all metrics within "
        "tolerance; 1: at least one outside (each is named); 2: unreadable input.",
    )
    p.add_argument("run", type=Path, metavar="RUN", help="run directory (or its summary.json)")
    p.add_argument("--baseline", type=Path, required=True, metavar="FILE", help="baseline YAML file")
    p.add_argument(
        "--update",
        action="store_true",
        help="write FILE from this run instead of checking (keeps FILE's metrics and tolerances if it "
        "exists; defaults otherwise)",
    )
    p.add_argument(
        "--tolerance",
        action="append",
        default=[],
        metavar="KEY=REL",
        help="relative tolerance for a metric, e.g. ttft_s.p99=0.3 or =30%% (repeatable; with --update "
        "it is written to FILE, otherwise it applies to this check only)",
    )
    p.add_argument(
        "--abs-tolerance",
        action="append",
        default=[],
        metavar="KEY=ABS",
        help="absolute tolerance for a metric, in its own unit (repeatable)",
    )
    p.add_argument(
        "--metric",
        action="append",
        default=[],
        metavar="KEY",
        help="with --update: also record this summary key (repeatable)",
    )
    p.add_argument("--note", help="with --update: a note on what the baseline was taken from")
    p.add_argument("--json", action="store_true", help="print the verdict (or the new baseline) as JSON")
    p.set_defaults(func=cmd_regress)


def cmd_regress(args: argparse.Namespace) -> int:
    try:
        rel = _parse_pairs(args.tolerance, "--tolerance")
        abs_ = _parse_pairs(args.abs_tolerance, "--abs-tolerance")
        summary, meta, run_dir = load_run(args.run)
        facts = run_facts(summary, meta, run_dir)
        if args.update:
            return _update(args, summary, facts, rel, abs_)
        baseline = load_baseline(args.baseline)
    except RegressError as e:
        print(f"regress: {e}", file=sys.stderr)
        return 2
    unknown = sorted((set(rel) | set(abs_)) - set(baseline.metrics))
    apply_overrides(baseline.metrics, rel, abs_)
    verdict = check(baseline, summary, facts)
    verdict.warnings += [f"--tolerance/--abs-tolerance for {k}: not in {args.baseline}, ignored" for k in unknown]
    if args.json:
        print(json.dumps({"run": str(args.run), "baseline": str(args.baseline), **verdict.to_dict()}, indent=2))
    else:
        from rich.text import Text

        err = _console(stderr=True)
        for w in verdict.warnings:
            err.print(Text(f"warning: {w}", style="yellow"), soft_wrap=True)
        out = _console()
        out.print(_table(f"{args.run} vs baseline {args.baseline}", verdict.results))
        for r in verdict.failed:
            out.print(Text(failure_line(r)), soft_wrap=True)
        n = len(verdict.results)
        if verdict.passed:
            out.print(Text(f"regress: PASS, {n} metric{'s' if n != 1 else ''} within tolerance"))
        else:
            out.print(
                Text(
                    f"regress: FAIL, {len(verdict.failed)} of {n} metrics outside tolerance: "
                    + ", ".join(r.key for r in verdict.failed)
                ),
                soft_wrap=True,
            )
    return 0 if verdict.passed else 1


def _update(
    args: argparse.Namespace, summary: Summary, facts: TakenFrom, rel: dict[str, float], abs_: dict[str, float]
) -> int:
    path: Path = args.baseline
    previous: Baseline | None = None
    notes: list[str] = []
    if path.exists():
        try:
            previous = load_baseline(path)
            notes.append(f"kept the metric list and tolerances of the existing {path}")
        except RegressError as e:
            notes.append(f"existing baseline unreadable, writing defaults instead ({e})")
    extra = tuple(args.metric) + tuple(k for k in (*rel, *abs_) if k not in args.metric)
    baseline, skipped = make_baseline(summary, facts, previous, extra, args.note)
    apply_overrides(baseline.metrics, rel, abs_)
    notes += [f"{k}: the run has no value, not recorded" for k in skipped]
    if summary.requests.failed:
        notes.append(f"the run had {summary.requests.failed} failed request(s); they are the baseline now")
    if summary.run.interrupted:
        notes.append("the run was interrupted; a baseline from it covers only what finished")
    validity = summary.validity
    if validity is not None and not validity.valid:
        notes.append(
            "the run is marked invalid ("
            + "; ".join(validity.reasons)
            + "): its timing is not the model's, so this baseline holds figures the testbed does not vouch "
            "for; take one from a valid run"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dump_baseline(baseline))
    except OSError as e:
        print(f"regress: {path}: cannot write: {e.strerror or e}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                {"baseline": str(path), "written": baseline.model_dump(mode="json", by_alias=True), "notes": notes},
                indent=2,
            )
        )
        return 0
    from rich.text import Text

    err = _console(stderr=True)
    for n in notes:
        err.print(Text(f"note: {n}", style="yellow"), soft_wrap=True)
    figures = summary.to_json_dict()
    results = [check_metric(k, s, figures) for k, s in baseline.metrics.items()]
    _console().print(_table(f"baseline written to {path} from {args.run}", results, with_measured=False))
    return 0
