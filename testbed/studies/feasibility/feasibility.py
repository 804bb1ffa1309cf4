"""The feasibility map (`testbed feasibility`): for each model profile x inter-DC link rate x RTT,
PrfaaS-PD against homogeneous PD by the analytical model (`testbed.model.feasibility`), by
simulation (capacity bisection on the sim backend) and, for a few points, by emulation.

Every simulated or emulated point runs the deployment the model chose for it (its best
threshold and split) over a link profile of that rate and RTT, written to `links/` of the
output directory; the scenarios themselves go to `scenarios/`, so any point can be rerun with
`testbed capacity --scenario OUT/scenarios/NAME.yaml`. The capacity search is the one of
`make replay-paper` (same criteria and workload sample), bracketed around the model's
Lambda_max; P90 TTFT is measured in one more replay at a light load (`ttft_load` x the model's
Lambda_max), where queueing is small.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from testbed.config.overrides import overrides_for
from testbed.config.profiles import load_profile
from testbed.config.resolved import ResolvedScenario
from testbed.config.scenarios import ScenarioError, dump_scenario
from testbed.core.schema.linkprofile import LinkProfile
from testbed.core.schema.scenario import Scenario
from testbed.deploy.registry import is_simulated
from testbed.metrics.markdown_table import table_lines
from testbed.metrics.run_files import read_run_records
from testbed.model.feasibility import Deployments, HomogeneousPoint, MapPoint, ModelMap, point_key
from testbed.run.load import load
from testbed.studies.capacity.capacity import CapacityResult, model_lambda, search, write_outputs

SimChoice = Literal["all", "none", "subset"]

# The link profile a map link copies its TCP settings and jitter from: a cross-region one up to
# this RTT, an intercontinental one (BBR, larger buffers) beyond.
CROSS_REGION_BASE = "cross-region-100g"
INTERCONTINENTAL_BASE = "intercontinental-100g"
CROSS_REGION_MAX_RTT_MS = 60.0
SUBSET_RATE_GBPS = 100.0
CONFIRM_TOLERANCE = 0.10


@dataclass(frozen=True)
class RunSettings:
    """How a point is measured; defaults are `make replay-paper`'s (PAPER_TABLE in the Makefile)."""

    requests: int = 300
    probes: int = 6
    seed: int = 45
    ttft_slo_s: float | None = None  # None: each scenario's slo.ttft_s
    wait_growth_s: float = 2.5
    spread: float = 0.25  # bisection between (1 -/+ spread) x the model's Lambda_max
    ttft_load: float = 0.5  # the TTFT replay's offered rate, x the model's Lambda_max
    sets: tuple[str, ...] = ()  # --set FIELD=VALUE, applied to every run
    keep_series: bool = False  # keep simulated probes' time series and decisions

    def check(self) -> None:
        if self.requests < 1 or self.probes < 1:
            raise ScenarioError("--requests and --probes must be >= 1")
        if not 0 < self.spread < 1:
            raise ScenarioError(f"--spread must be in (0, 1), got {self.spread}")
        if not 0 < self.ttft_load < 1:
            raise ScenarioError(f"--ttft-load must be in (0, 1), got {self.ttft_load}")


@dataclass
class Measured:
    """One deployment's capacity search (and light-load TTFT replay) on one backend."""

    backend: str
    scenario: str
    out: str
    lambda_max: float | None  # largest stable probe, req/s
    lowest_unstable: float | None
    model_lambda_max: float | None
    offload_share: float | None  # at the largest stable probe
    ttft_rate: float | None
    ttft_p90_s: float | None
    ttft_mean_s: float | None
    wall_s: float
    cpu_s: float  # this process only (live backends run services elsewhere)
    probes: list[tuple[float, bool]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Links and scenarios


def link_name(rate_gbps: float, rtt_ms: float) -> str:
    return f"wan-{rate_gbps:g}g-{rtt_ms:g}ms"


def link_profile(rate_gbps: float, rtt_ms: float) -> LinkProfile:
    """A loss-free link of `rate_gbps` and `rtt_ms` with the TCP settings and jitter of the
    shipped cross-region or intercontinental profile (by RTT), no schedule."""
    base = load_profile(CROSS_REGION_BASE if rtt_ms <= CROSS_REGION_MAX_RTT_MS else INTERCONTINENTAL_BASE)
    return base.model_copy(
        update={
            "name": link_name(rate_gbps, rtt_ms),
            "rate": rate_gbps * 1e9,
            "delay": rtt_ms / 2e3,
            "description": f"feasibility map: {rate_gbps:g} Gbit/s, {rtt_ms:g} ms RTT (TCP settings of {base.name})",
            "schedule": [],
            "loss": 0.0,
        }
    )


def write_link(out: Path, rate_gbps: float, rtt_ms: float) -> Path:
    path = out / "links" / f"{link_name(rate_gbps, rtt_ms)}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(link_profile(rate_gbps, rtt_ms).model_dump(mode="json"), sort_keys=False))
    return path


def _with_split(sc: Scenario, n_p: int, n_d: int) -> list[dict[str, Any]]:
    clusters: list[dict[str, Any]] = sc.model_dump(mode="json")["clusters"]
    for c in clusters:
        if c["kind"] == "pd":
            c["prefill"], c["decode"] = n_p, n_d
    return clusters


def _write_scenario(out: Path, base: Scenario, update: dict[str, Any], s: RunSettings) -> ResolvedScenario:
    """The run's scenario as a file of its own under OUT/scenarios, then loaded with --set."""
    data = base.model_dump(mode="json")
    data.update(update)
    data["workload"] = {**data["workload"], "requests": s.requests, "seed": s.seed}
    spec = Scenario.model_validate(data)
    path = out / "scenarios" / f"{spec.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_scenario(spec))
    return load(path, overrides_for(str(path), list(s.sets)))


def prfaas_scenario(out: Path, dep: Deployments, p: MapPoint, s: RunSettings) -> ResolvedScenario:
    """PrfaaS-PD at the point's threshold and split over the point's link."""
    link = write_link(out, p.rate_gbps, p.rtt_ms)
    return _write_scenario(
        out,
        dep.prfaas,
        {
            "name": f"prfaas-{dep.model}-{p.rate_gbps:g}g-{p.rtt_ms:g}ms",
            "clusters": _with_split(dep.prfaas, p.n_p, p.n_d),
            "policy": {**dep.prfaas.policy.model_dump(mode="json"), "threshold": p.threshold},
            "links": {**dep.prfaas.links.model_dump(mode="json"), "inter_dc": str(link.resolve())},
        },
        s,
    )


def homogeneous_scenario(out: Path, dep: Deployments, h: HomogeneousPoint, s: RunSettings) -> ResolvedScenario:
    return _write_scenario(
        out,
        dep.homogeneous,
        {"name": f"homogeneous-{dep.model}", "clusters": _with_split(dep.homogeneous, h.n_p, h.n_d)},
        s,
    )


# ---------------------------------------------------------------------------------------------
# Measuring one deployment


def _prune(run_dir: Path) -> None:
    """What a simulated probe keeps: records, summary, run.json and its scenario (the series
    and per-request decisions are 20x the rest and the map reads neither)."""
    shutil.rmtree(run_dir / "timeseries", ignore_errors=True)
    (run_dir / "decisions.jsonl").unlink(missing_ok=True)
    (run_dir / "decisions.parquet").unlink(missing_ok=True)


def _share(sc: Scenario, run_dir: Path) -> float | None:
    kinds = {c.name: c.kind for c in sc.clusters}
    done = [r for r in read_run_records(run_dir) if r.outcome == "completed"]
    return sum(kinds.get(r.prefill_cluster) == "prfaas" for r in done) / len(done) if done else None


async def measure(rs: ResolvedScenario, out: Path, backend: str, s: RunSettings, verbose: bool = False) -> Measured:
    """Lambda_max by bisection around the model's, then P90 TTFT at a light load."""
    from testbed.run.runner import run_replay_async
    from testbed.traces.loader import trace_from_workload

    sc = rs.spec
    t0, c0 = time.perf_counter(), time.process_time()
    lam = model_lambda(sc, rs.inter_dc.rate)
    centre = lam or 1.0
    out.mkdir(parents=True, exist_ok=True)
    cap: CapacityResult = await search(
        rs,
        out,
        backend,
        (1 - s.spread) * centre,
        (1 + s.spread) * centre,
        s.probes,
        0.25,
        s.ttft_slo_s if s.ttft_slo_s is not None else sc.slo.ttft_s,
        verbose=verbose,
        growth_s=s.wait_growth_s,
    )
    write_outputs(cap, out)
    stable = [p for p in cap.probes if p.stable]
    share = _share(sc, Path(max(stable, key=lambda p: p.rate).run_dir)) if stable else None
    rate = s.ttft_load * centre
    run_dir = out / f"ttft-{rate:.3f}"
    rs_r = rs.at_rate(rate)
    res = await run_replay_async(
        rs_r,
        trace_from_workload(rs_r.spec.workload),
        run_dir,
        backend,
        name=f"{sc.name} @ {rate:.3f} req/s (TTFT)",
        report=not is_simulated(backend),
    )
    ttft = res.summary.ttft_s
    if is_simulated(backend) and not s.keep_series:
        for p in cap.probes:
            _prune(Path(p.run_dir))
        _prune(run_dir)
    return Measured(
        backend,
        sc.name,
        str(out),
        cap.lambda_max,
        cap.lowest_unstable,
        cap.model_lambda_max,
        share,
        rate,
        ttft.p90,
        ttft.mean,
        time.perf_counter() - t0,
        time.process_time() - c0,
        [(p.rate, p.stable) for p in sorted(cap.probes, key=lambda p: p.rate)],
    )


def _cache_key(rs: ResolvedScenario, backend: str, s: RunSettings) -> str:
    """What a measurement depends on: the scenario, its link, the backend and the settings."""
    settings = {k: v for k, v in asdict(s).items() if k != "keep_series"}
    blob = json.dumps(
        [dump_scenario(rs.spec), rs.inter_dc.model_dump(mode="json"), backend, settings], sort_keys=True, default=str
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _load_measured(path: Path, key: str) -> Measured | None:
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key:
            return None
        m = data["measured"]
        return Measured(**{**m, "probes": [tuple(x) for x in m["probes"]]})
    except (OSError, ValueError, TypeError, KeyError):
        return None


async def measure_cached(
    rs: ResolvedScenario, out: Path, backend: str, s: RunSettings, reuse: bool = True, verbose: bool = False
) -> tuple[Measured, bool]:
    """`measure`, or the measurement an earlier run left in `out` for the same scenario, link,
    backend and settings (measured.json); True when measured now."""
    key = _cache_key(rs, backend, s)
    path = out / "measured.json"
    if reuse and (m := _load_measured(path, key)) is not None:
        return m, False
    m = await measure(rs, out, backend, s, verbose)
    path.write_text(json.dumps({"key": key, "measured": asdict(m)}, indent=1))
    return m, True


# ---------------------------------------------------------------------------------------------
# The map by simulation


def subset_keys(mm: ModelMap) -> list[str]:
    """--sim subset: the 100 Gbit/s column (or the grid rate nearest it) at every RTT, and for
    each model the two grid rates around its break-even at the first RTT."""
    near = min(mm.rates_gbps, key=lambda r: abs(math.log(r / SUBSET_RATE_GBPS)))
    keys = [point_key(m.model, near, rtt) for m in mm.models for rtt in mm.rtts_ms]
    for m in mm.models:
        be = m.break_even
        if be is None or be.rate_bps is None:
            continue
        g = be.rate_bps / 1e9
        below = [r for r in mm.rates_gbps if r < g]
        above = [r for r in mm.rates_gbps if r >= g]
        keys += [point_key(m.model, r, mm.rtts_ms[0]) for r in (below[-1:] + above[:1])]
    return list(dict.fromkeys(keys))


def chosen_keys(mm: ModelMap, choice: SimChoice) -> list[str]:
    if choice == "none":
        return []
    if choice == "all":
        return [p.key for p in mm.points]
    return subset_keys(mm)


@dataclass
class Tally:
    """Capacity searches run by this invocation (wall and CPU time) and reused from earlier ones."""

    runs: int = 0
    reused: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    reused_wall_s: float = 0.0  # what the reused searches took when they ran
    reused_cpu_s: float = 0.0

    def add(self, m: Measured, fresh: bool) -> None:
        if fresh:
            self.runs += 1
            self.wall_s += m.wall_s
            self.cpu_s += m.cpu_s
        else:
            self.reused += 1
            self.reused_wall_s += m.wall_s
            self.reused_cpu_s += m.cpu_s


@dataclass
class SimResults:
    points: dict[str, Measured] = field(default_factory=dict)  # point key -> PrfaaS-PD
    homogeneous: dict[str, Measured] = field(default_factory=dict)  # model -> homogeneous PD
    tally: Tally = field(default_factory=Tally)

    def gain(self, p: MapPoint) -> float | None:
        a, b = self.points.get(p.key), self.homogeneous.get(p.model)
        if a is None or b is None or a.lambda_max is None or not b.lambda_max:
            return None
        return a.lambda_max / b.lambda_max


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def simulate_points(
    mm: ModelMap,
    deps: dict[str, Deployments],
    keys: Sequence[str],
    out: Path,
    s: RunSettings,
    results: SimResults | None = None,
    reuse: bool = True,
) -> SimResults:
    """Simulate the points `keys` (and each of their models' homogeneous PD once)."""
    res = results or SimResults()
    by_key = {p.key: p for p in mm.points}
    hom = {m.model: m.homogeneous for m in mm.models}
    todo = [k for k in keys if k not in res.points]
    for i, k in enumerate(todo, 1):
        p = by_key[k]
        dep = deps[p.model]
        if p.model not in res.homogeneous:
            rs = homogeneous_scenario(out, dep, hom[p.model], s)
            m, fresh = await measure_cached(rs, out / "sim" / rs.name, "sim", s, reuse)
            res.homogeneous[p.model] = m
            res.tally.add(m, fresh)
            _say(
                f"  {rs.name}: Λ_max {_f(m.lambda_max)} (model {_f(m.model_lambda_max)}) req/s "
                f"[{f'{m.wall_s:.1f} s' if fresh else 'reused'}]"
            )
        rs = prfaas_scenario(out, dep, p, s)
        m, fresh = await measure_cached(rs, out / "sim" / rs.name, "sim", s, reuse)
        res.points[k] = m
        res.tally.add(m, fresh)
        _say(
            f"  [{i}/{len(todo)}] {k}: Λ_max {_f(m.lambda_max)} (model {_f(m.model_lambda_max)}) req/s "
            f"[{f'{m.wall_s:.1f} s' if fresh else 'reused'}]"
        )
    return res


# ---------------------------------------------------------------------------------------------
# Confirmation by emulation


def parse_point(text: str) -> tuple[str, float, float]:
    """'minimax-m2.5@100g/30ms' -> ('minimax-m2.5', 100.0, 30.0)."""
    try:
        model, rest = text.split("@", 1)
        rate, rtt = rest.split("/", 1)
        return model, float(rate.lower().removesuffix("g")), float(rtt.lower().removesuffix("ms"))
    except ValueError:
        raise ScenarioError(f"point {text!r} must look like MODEL@RATEg/RTTms, e.g. minimax-m2.5@100g/30ms") from None


def confirm_candidates(mm: ModelMap) -> list[str]:
    """Points worth confirming, best first:
    1. the dense model with the lowest gain at 100 Gbit/s, first RTT (its link saturates);
    2. the hybrid with the highest gain there (compute-bound);
    3. at the largest RTT, the hybrid point with the highest rate whose PrfaaS link binds;
    then every other point at 100 Gbit/s, then the rest from the highest rate down."""
    near = min(mm.rates_gbps, key=lambda r: abs(math.log(r / SUBSET_RATE_GBPS)))
    first, last = mm.rtts_ms[0], mm.rtts_ms[-1]
    col = [p for p in mm.points if p.rate_gbps == near and p.rtt_ms == first]
    out: list[str] = []
    dense = [p for p in col if p.kind == "dense"]
    hybrid = [p for p in col if p.kind == "hybrid"]
    if dense:
        out.append(min(dense, key=lambda p: p.gain).key)
    if hybrid:
        out.append(max(hybrid, key=lambda p: p.gain).key)
    bound = [
        p
        for p in mm.points
        if p.rtt_ms == last and p.kind == "hybrid" and p.prfaas_bound == "link" and p.bottleneck == "prfaas"
    ]
    if bound:
        out.append(max(bound, key=lambda p: (p.rate_gbps, p.gain)).key)
    out += [p.key for p in mm.points if p.rate_gbps == near]
    out += [p.key for p in sorted(mm.points, key=lambda p: -p.rate_gbps)]
    return list(dict.fromkeys(out))


def pick_confirm(mm: ModelMap, k: int, explicit: Sequence[str] = ()) -> list[str]:
    keys = []
    for text in explicit:
        model, rate, rtt = parse_point(text)
        try:
            keys.append(mm.point(model, rate, rtt).key)
        except KeyError:
            raise ScenarioError(
                f"--confirm-at {text!r}: not a point of the map (models "
                f"{', '.join(m.model for m in mm.models)}; rates {mm.rates_gbps}; RTTs "
                f"{mm.rtts_ms})"
            ) from None
    for key in confirm_candidates(mm):
        if len(keys) >= max(k, len(explicit)):
            break
        if key not in keys:
            keys.append(key)
    return keys


@dataclass
class Confirmation:
    key: str
    simulated: Measured
    emulated: Measured

    @property
    def diff(self) -> float | None:
        a, b = self.emulated.lambda_max, self.simulated.lambda_max
        return None if a is None or not b else a / b - 1.0

    def within(self, tolerance: float = CONFIRM_TOLERANCE) -> bool:
        return self.diff is not None and abs(self.diff) <= tolerance


async def confirm(
    mm: ModelMap,
    deps: dict[str, Deployments],
    keys: Sequence[str],
    out: Path,
    s: RunSettings,
    sim: SimResults,
    backend: str = "netns",
    reuse: bool = True,
    tally: Tally | None = None,
) -> list[Confirmation]:
    """Emulate each point's capacity search with the simulation's settings and compare."""
    await simulate_points(mm, deps, keys, out, s, sim, reuse)
    by_key = {p.key: p for p in mm.points}
    outc: list[Confirmation] = []
    for k in keys:
        p = by_key[k]
        rs = prfaas_scenario(out, deps[p.model], p, s)
        _say(f"confirming {k} on the {backend} backend -> {out / backend / rs.name}")
        em, fresh = await measure_cached(rs, out / backend / rs.name, backend, s, reuse, verbose=True)
        if tally is not None:
            tally.add(em, fresh)
        c = Confirmation(k, sim.points[k], em)
        outc.append(c)
        _say(
            f"  {k}: emulated Λ_max {_f(em.lambda_max)}, simulated {_f(c.simulated.lambda_max)} req/s "
            f"({'n/a' if c.diff is None else f'{c.diff:+.1%}'})" + ("" if fresh else " [reused]")
        )
    return outc


def confirm_table(conf: Sequence[Confirmation], tolerance: float = CONFIRM_TOLERANCE) -> list[str]:
    head = [
        "point",
        "backend",
        "Λ_max emulated",
        "Λ_max simulated",
        "difference",
        f"within {tolerance:.0%}",
        "Λ_max model",
        "P90 TTFT emulated / simulated (s)",
    ]
    rows = [
        [
            c.key,
            c.emulated.backend,
            _f(c.emulated.lambda_max),
            _f(c.simulated.lambda_max),
            "n/a" if c.diff is None else f"{c.diff:+.1%}",
            "yes" if c.within(tolerance) else "NO",
            _f(c.simulated.model_lambda_max),
            f"{_f(c.emulated.ttft_p90_s)} / {_f(c.simulated.ttft_p90_s)}",
        ]
        for c in conf
    ]
    return table_lines(head, rows)


def write_confirm(conf: Sequence[Confirmation], out: Path, tolerance: float = CONFIRM_TOLERANCE) -> None:
    (out / "confirm.json").write_text(
        json.dumps(
            [
                {
                    "point": c.key,
                    "diff": c.diff,
                    "within": c.within(tolerance),
                    "tolerance": tolerance,
                    "simulated": asdict(c.simulated),
                    "emulated": asdict(c.emulated),
                }
                for c in conf
            ],
            indent=1,
        )
    )
    lines = [
        "# Feasibility map: points confirmed by emulation",
        "",
        "Each point's capacity search ran twice with the same scenario, workload sample and criteria: "
        "simulated and on the backend named.",
        "",
        *confirm_table(conf, tolerance),
    ]
    (out / "confirm.md").write_text("\n".join(lines) + "\n")


def load_confirm(out: Path) -> list[Confirmation]:
    """confirm.json of an earlier run (the report keeps it when the map is redrawn)."""
    try:
        data = json.loads((out / "confirm.json").read_text())
    except (OSError, ValueError):
        return []
    return [
        Confirmation(
            d["point"],
            Measured(**{**d["simulated"], "probes": [tuple(x) for x in d["simulated"]["probes"]]}),
            Measured(**{**d["emulated"], "probes": [tuple(x) for x in d["emulated"]["probes"]]}),
        )
        for d in data
    ]


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if x is None else fmt.format(x)
