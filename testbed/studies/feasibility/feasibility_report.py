"""The feasibility map's outputs: map.csv (one row per model x rate x RTT), map.json, report.md
and map.png (a heatmap per RTT: rows models, columns link rates, colour the throughput gain of
PrfaaS-PD over homogeneous PD)."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from testbed.config.scenarios import load_model_profile
from testbed.core.engine.servicetime import PrefillTime
from testbed.metrics.markdown_table import table_lines
from testbed.model.feasibility import PROFILE_HARDWARE, BreakEven, MapPoint, ModelMap, SourceMaps, label
from testbed.studies.feasibility.feasibility import (
    CONFIRM_TOLERANCE,
    Confirmation,
    RunSettings,
    SimResults,
    confirm_table,
)

# A row of map.csv (or source-map.csv): column -> a number, a label, a bound, None where
# undefined; as read back from the file, a string.
MapRow = dict[str, object]

SIM_COLUMNS = (
    "lambda_max_sim",
    "homogeneous_lambda_max_sim",
    "gain_sim",
    "offload_share_sim",
    "ttft_p90_sim_s",
    "ttft_rate_sim",
    "lowest_unstable_sim",
)


@dataclass(frozen=True)
class Timing:
    """This invocation's time: the model map, the capacity searches it ran (not those it reused
    from an earlier run into the same directory) and the whole command."""

    model_wall_s: float
    model_cpu_s: float
    sim_runs: int
    sim_reused: int
    sim_wall_s: float
    sim_cpu_s: float
    sim_reused_wall_s: float
    sim_reused_cpu_s: float
    emulation_runs: int
    emulation_wall_s: float
    total_wall_s: float


def rows(mm: ModelMap, sim: SimResults) -> list[MapRow]:
    """map.csv's rows: the model's figures of every point, the simulated ones where simulated."""
    be = {m.model: m.break_even for m in mm.models}
    out = []
    for p in mm.points:
        r: MapRow = {"label": label(p.model), **p.to_dict()}
        b = be.get(p.model)
        r["break_even_gbps"] = None if b is None or b.rate_bps is None else b.rate_bps / 1e9
        r["break_even_bound"] = None if b is None else b.bound
        m, h = sim.points.get(p.key), sim.homogeneous.get(p.model)
        r.update(dict.fromkeys(SIM_COLUMNS))
        if m is not None:
            r.update(
                lambda_max_sim=m.lambda_max,
                offload_share_sim=m.offload_share,
                ttft_p90_sim_s=m.ttft_p90_s,
                ttft_rate_sim=m.ttft_rate,
                lowest_unstable_sim=m.lowest_unstable,
                gain_sim=sim.gain(p),
            )
        if m is not None and h is not None:
            r["homogeneous_lambda_max_sim"] = h.lambda_max
        out.append(r)
    return out


def write_csv(table: Sequence[MapRow], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        for r in table:
            w.writerow({k: ("" if v is None else v) for k, v in r.items()})


def write_json(
    mm: ModelMap, sim: SimResults, settings: RunSettings, conf: Sequence[Confirmation], timing: Timing, path: Path
) -> None:
    data = {
        "grid": {"rates_gbps": mm.rates_gbps, "rtts_ms": mm.rtts_ms, "split": mm.split, "pd_curve": mm.pd_curve},
        "settings": asdict(settings),
        "models": [m.to_dict() for m in mm.models],
        "points": [
            {
                **p.to_dict(),
                "key": p.key,
                "gain_sim": sim.gain(p),
                "sim": asdict(sim.points[p.key]) if p.key in sim.points else None,
            }
            for p in mm.points
        ],
        "homogeneous_sim": {k: asdict(v) for k, v in sim.homogeneous.items()},
        "confirm": [
            {
                "point": c.key,
                "diff": c.diff,
                "within": c.within(),
                "emulated": asdict(c.emulated),
                "simulated_lambda_max": c.simulated.lambda_max,
            }
            for c in conf
        ],
        "timing": asdict(timing),
    }
    path.write_text(json.dumps(data, indent=1))


# ---------------------------------------------------------------------------------------------
# The heatmap


def _float(v: object) -> float:
    """A number cell, as computed or as read back from map.csv (text)."""
    if isinstance(v, (int, float, str)):
        return float(v)
    raise ValueError(f"not a number: {v!r}")


def _num(v: object) -> float | None:
    if v is None or v == "":
        return None
    x = _float(v)
    return None if math.isnan(x) else x


def plot_heatmap(table: Sequence[MapRow], path: Path) -> str:
    """map.png from map.csv-shaped rows; colour = the simulated gain when every cell has one,
    else the model's (the other source, where present, is the cell's second line). Returns
    the colour's source."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure

    models = list(dict.fromkeys(str(r["model"]) for r in table))
    rates = sorted({_float(r["rate_gbps"]) for r in table})
    rtts = sorted({_float(r["rtt_ms"]) for r in table})
    cell = {(str(r["model"]), _float(r["rate_gbps"]), _float(r["rtt_ms"])): r for r in table}
    source = "sim" if all(_num(r.get("gain_sim")) is not None for r in table) else "model"
    key, other = ("gain_sim", "gain") if source == "sim" else ("gain", "gain_sim")
    vals = [v for r in table if (v := _num(r.get(key))) is not None]
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(min(vals), 0.9), vmax=max(max(vals), 1.1))
    fig = Figure(figsize=(2.4 + 0.95 * len(rates) * len(rtts), 1.4 + 0.55 * len(models)), layout="constrained")
    axes = fig.subplots(1, len(rtts), squeeze=False, sharey=True)[0]
    im = None
    for n, (ax, rtt) in enumerate(zip(axes, rtts)):
        grid = [[_num(cell[(m, r, rtt)].get(key)) if (m, r, rtt) in cell else None for r in rates] for m in models]
        im = ax.imshow(
            [[math.nan if v is None else v for v in row] for row in grid], cmap="RdYlGn", norm=norm, aspect="auto"
        )
        for i, m in enumerate(models):
            for j, r in enumerate(rates):
                c = cell.get((m, r, rtt))
                v = grid[i][j]
                if c is None or v is None:
                    continue
                o = _num(c.get(other))
                ax.text(
                    j,
                    i - (0.12 if o is not None else 0.0),
                    f"{v:.2f}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    fontweight="bold",
                )
                if o is not None:
                    ax.text(
                        j,
                        i + 0.22,
                        f"{'sim' if other == 'gain_sim' else 'model'} {o:.2f}",
                        ha="center",
                        va="center",
                        fontsize=5.5,
                    )
        ax.set_xticks(range(len(rates)), [f"{r:g}" for r in rates])
        ax.set_yticks(range(len(models)), [f"{label(m)} ({cell_kind(table, m)})" for m in models])
        ax.tick_params(axis="y", labelleft=n == 0)
        ax.set_xlabel("inter-DC link rate (Gbit/s)")
        ax.set_title(f"RTT {rtt:g} ms", fontsize=10)
    if im is not None:
        fig.colorbar(im, ax=list(axes), label=f"gain ({source})", shrink=0.9)
    fig.suptitle(r"$\Lambda_{max}$ of PrfaaS-PD / $\Lambda_{max}$ of homogeneous PD", fontsize=11)
    fig.savefig(path, dpi=110)
    return source


def cell_kind(table: Sequence[MapRow], model: str) -> str:
    return next(str(r["kind"]) for r in table if r["model"] == model)


# ---------------------------------------------------------------------------------------------
# report.md


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _gbps(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if x < 1000 else f"{x:,.0f}"


def headline_rate(mm: ModelMap) -> float:
    return min(mm.rates_gbps, key=lambda r: abs(math.log(r / 100.0)))


def claim_lines(mm: ModelMap, sim: SimResults) -> list[str]:
    """The paper's qualitative claim, checked on the map: at ~100 Gbit/s the hybrids gain over
    homogeneous PD, the dense models do not."""
    rate = headline_rate(mm)
    out = []
    for rtt in mm.rtts_ms:
        col = [p for p in mm.points if p.rate_gbps == rate and p.rtt_ms == rtt]
        for source in ("model", "simulation"):
            gains = {p.model: (p.gain if source == "model" else sim.gain(p)) for p in col}
            if any(v is None for v in gains.values()):
                continue
            hy = [p for p in col if p.kind == "hybrid"]
            de = [p for p in col if p.kind == "dense"]
            hy_ok = [p for p in hy if (gains[p.model] or 0) > 1]
            de_gain = [p for p in de if (gains[p.model] or 0) > 1]
            holds = len(hy_ok) == len(hy) and not de_gain
            parts = [f"{len(hy_ok)} of {len(hy)} hybrid models gain"]
            parts.append(
                f"{len(de_gain)} of {len(de)} dense models gain"
                + (f" ({', '.join(f'{label(p.model)} {gains[p.model]:.2f}x' for p in de_gain)})" if de_gain else "")
            )
            out.append(
                f"- {rate:g} Gbit/s, {rtt:g} ms RTT, by {source}: "
                + "; ".join(parts)
                + f" -> the claim {'holds' if holds else 'does NOT hold'} here."
            )
    return out


def _gap_note(mm: ModelMap, sim: SimResults, settings: RunSettings) -> str:
    """Simulated against model Lambda_max of PrfaaS-PD, by what binds in the model."""

    def spread(sel: Callable[[MapPoint], bool]) -> str | None:
        r = [
            m.lambda_max / p.lambda_max - 1
            for p in mm.points
            if sel(p) and (m := sim.points.get(p.key)) is not None and m.lambda_max is not None
        ]
        return None if not r else f"{min(r):+.0%} to {max(r):+.0%} ({len(r)} points)"

    parts = []
    if (g := spread(lambda p: p.bottleneck == "pdp")) is not None:
        parts.append(f"where PD-P binds, {g}: the same convexity as homogeneous PD's")
    if (g := spread(lambda p: p.link_utilisation >= 0.95)) is not None:
        parts.append(
            f"where the model's link is saturated (>= 95% at Λ_max), {g}: a fluid link at its rate has no "
            "slack for bursts of long offloaded requests, whose KV then queues"
        )
    if (g := spread(lambda p: p.bottleneck == "pdd" and p.link_utilisation < 0.9)) is not None:
        parts.append(
            f"where decode binds with link headroom, {g}: these can read above the model, because a "
            f"request holds its decode slot for L_out x T_decode (25.6 s at 1024 tokens) and a "
            f"{settings.requests}-request probe fills the slots late, so waits grow little before it ends"
        )
    if (g := spread(lambda p: p.bottleneck == "prfaas" and p.prfaas_bound == "compute")) is not None:
        parts.append(f"where PrfaaS compute binds, {g}")
    return (" PrfaaS-PD, simulated against the model: " + "; ".join(parts) + ".") if parts else ""


# ---------------------------------------------------------------------------------------------
# Profile sources side by side

SOURCE_TAGS = {"paper": "paper", "aiconfigurator": "aic"}
SOURCE_NOTE = (
    "paper: back-solved from the paper's Table 3 (scenarios/models, ~0.3-0.45 s fixed per prefill); "
    "aic: aiconfigurator's measured kernels (scenarios/models/aiconfigurator, kernel time only)"
)


def _tag(source: str) -> str:
    return SOURCE_TAGS.get(source, source)


def _be(be: BreakEven | None) -> str:
    if be is None:
        return "-"
    if be.bound == "exact":
        return f"{_gbps(be.rate_bps / 1e9 if be.rate_bps else None)} Gbit/s"
    if be.bound == "below":
        return f"<= {_gbps(be.lo_bps / 1e9)} Gbit/s"
    return f"never ({be.gain_at_hi:.2f} at {_gbps(be.hi_bps / 1e9)})"


def _curve(model: str, source: str) -> PrefillTime | None:
    try:
        return PrefillTime.from_spec(load_model_profile(model, source).hardware[PROFILE_HARDWARE].prefill)
    except (KeyError, ValueError):
        return None


def source_rows(sm: SourceMaps) -> list[MapRow]:
    """sources.csv: one row per model x source x rate (the first RTT: Λ_max and t do not depend on it)."""
    out: list[MapRow] = []
    for src, mm in sm.maps.items():
        rtt = mm.rtts_ms[0]
        for m in mm.models:
            for rate in mm.rates_gbps:
                p = mm.point(m.model, rate, rtt)
                be = m.break_even
                out.append(
                    {
                        "model": m.model,
                        "source": src,
                        "rate_gbps": rate,
                        "threshold": p.threshold,
                        "n_p": p.n_p,
                        "n_d": p.n_d,
                        "offload_share": p.offload_share,
                        "lambda_max": p.lambda_max,
                        "homogeneous_lambda_max": p.homogeneous_lambda_max,
                        "gain": p.gain,
                        "egress_gbps": p.egress_gbps,
                        "bottleneck": p.bottleneck,
                        "break_even_gbps": None if be is None or be.rate_bps is None else be.rate_bps / 1e9,
                        "break_even_bound": None if be is None else be.bound,
                    }
                )
    return out


def source_lines(sm: SourceMaps, rate: float) -> list[str]:
    """report.md's section: every model by every source that has it, at `rate`, and its gain by rate."""
    srcs = sm.sources()
    if len(srcs) < 2:
        return []
    first = next(iter(sm.maps.values()))
    rtt = first.rtts_ms[0]
    L = [
        "",
        "## Profile sources side by side",
        "",
        f"The same map from each source's prefill curves, by the model only (not simulated). {SOURCE_NOTE}. "
        "A fixed time per prefill weighs most on short requests: it moves the best threshold, the offload share "
        "and the bandwidth a PrfaaS cluster needs.",
        "",
        f"At {rate:g} Gbit/s (Λ_max and t do not depend on the RTT):",
        "",
    ]
    rows: list[list[str]] = []
    for model in sm.models():
        for src in srcs:
            p, ms = sm.point(src, model, rate, rtt), sm.summary(src, model)
            if p is None or ms is None:
                continue
            c = _curve(model, src)
            rows.append(
                [
                    label(model),
                    _tag(src),
                    _f(None if c is None else c.fixed_time(), "{:.3f}"),
                    _f(None if c is None else c.uncached_time(32768), "{:.3f}"),
                    f"{p.threshold:,}",
                    f"{p.n_p}/{p.n_d}",
                    _pct(p.offload_share),
                    f"{p.lambda_max:.2f}",
                    f"{p.homogeneous_lambda_max:.2f}",
                    f"{p.gain:.2f}",
                    _gbps(p.egress_gbps),
                    p.bottleneck,
                    _be(ms.break_even),
                ]
            )
    L += table_lines(
        [
            "model",
            "source",
            "fixed s / prefill",
            "T(32K) s",
            "t",
            "split",
            "offload share",
            "Λ PrfaaS-PD",
            "Λ homog.",
            "gain",
            "egress Gbit/s",
            "bottleneck",
            "break-even",
        ],
        rows,
    )
    L += ["", "Gain by link rate and source:", ""]
    gains: list[list[str]] = []
    for model in sm.models():
        for src in srcs:
            pts = [sm.point(src, model, r, rtt) for r in first.rates_gbps]
            if any(p is None for p in pts):
                continue
            gains.append([label(model), _tag(src), *(f"{p.gain:.2f}" for p in pts if p)])
    L += table_lines(["model", "source", *(f"{r:g}G" for r in first.rates_gbps)], gains)
    return L


def source_summary(sm: SourceMaps, rate: float) -> list[str]:
    srcs = sm.sources()
    if len(srcs) < 2:
        return []
    rtt = next(iter(sm.maps.values())).rtts_ms[0]
    out = [f"by profile source at {rate:g} Gbit/s (model only): threshold t, gain, PrfaaS egress, break-even"]
    for model in sm.models():
        cells = []
        for src in srcs:
            p, ms = sm.point(src, model, rate, rtt), sm.summary(src, model)
            if p is not None and ms is not None:
                cells.append(
                    f"{_tag(src)} t {p.threshold / 1000:.1f}K, {p.gain:.2f}x, {_gbps(p.egress_gbps)} Gbit/s, "
                    f"b/e {_be(ms.break_even)}"
                )
        if len(cells) > 1:
            out.append(f"  {label(model):<14} " + " | ".join(cells))
    return out if len(out) > 1 else []


def write_report(
    mm: ModelMap,
    sim: SimResults,
    settings: RunSettings,
    conf: Sequence[Confirmation],
    timing: Timing,
    out: Path,
    colour: str,
    sources: SourceMaps | None = None,
) -> Path:
    rate = headline_rate(mm)
    first = mm.rtts_ms[0]
    L = ["# Feasibility map: PrfaaS-PD against homogeneous PD by model and link", ""]
    L += [
        f"Deployments: the paper's (Table 6) with each model profile of `scenarios/models` swapped in: "
        f"PrfaaS-PD = 4 H200 PrfaaS instances + 8 H20 PD instances over the inter-DC link, homogeneous PD = 12 H20 "
        f"instances. H20 prefill curve: **{mm.pd_curve}** "
        + (
            "(the model's H200 time x the case-study model's H20/H200 ratio at each length)"
            if mm.pd_curve == "scaled"
            else "(the base scenario's, measured for the case-study model)"
        )
        + f"; splits: **{mm.split}** "
        + (
            "(PrfaaS-PD by the paper's 2-D search over t and N_p/N_d; homogeneous PD's best N_p/N_d)"
            if mm.split == "optimise"
            else "(Table 6's 3/5 and 9/3; t optimised)"
        )
        + ".",
        "",
    ]
    ttft_slo = "the scenario's TTFT SLO" if settings.ttft_slo_s is None else f"{settings.ttft_slo_s:g} s"
    L += [
        "Gain = Λ_max(PrfaaS-PD) / Λ_max(homogeneous PD). The model is the paper's queue-free fluid model: its "
        "Λ_max does not depend on RTT, its P90 TTFT adds the KV's one-way delay and last-layer tail for offloaded "
        "requests. Simulated: capacity bisection on `--backend sim` at the model's threshold and split, "
        f"{settings.probes} probes of {settings.requests} requests (seed {settings.seed}), stable = every request "
        f"completed, P90 TPOT within the SLO, P90 TTFT <= {ttft_slo} and mean wait growth <= "
        f"{settings.wait_growth_s:g} s; P90 TTFT simulated at {settings.ttft_load:g} x the model's Λ_max.",
        "",
    ]
    L += ["![map](map.png)", "", f"Colour: the gain by {'simulation' if colour == 'sim' else 'the model'}.", ""]
    L += ["## Headline", ""]
    L += [
        f"Gain at {rate:g} Gbit/s, {first:g} ms RTT, and the link rate at which each model breaks even (gain 1):",
        "",
    ]
    headline: list[list[str]] = []
    for m in mm.models:
        p = mm.point(m.model, rate, first)
        be = m.break_even
        bes = (
            "-"
            if be is None
            else {
                "exact": f"{_gbps(be.rate_bps / 1e9 if be.rate_bps else None)} Gbit/s",
                "below": f"<= {_gbps(be.lo_bps / 1e9)} Gbit/s",
                "never": f"never (gain {be.gain_at_hi:.2f} at {_gbps(be.hi_bps / 1e9)} Gbit/s)",
            }[be.bound]
        )
        s = sim.points.get(p.key)
        headline.append(
            [
                label(m.model),
                m.kind,
                f"{p.gain:.2f}",
                _f(sim.gain(p)),
                f"{p.bottleneck}{f' ({p.prfaas_bound})' if p.bottleneck == 'prfaas' else ''}",
                _pct(p.link_utilisation),
                f"{_pct(p.offload_share)} / {_pct(None if s is None else s.offload_share)}",
                bes,
            ]
        )
    L += table_lines(
        [
            "model",
            "kind",
            "gain, model",
            "gain, sim",
            "bottleneck (model)",
            "link utilisation",
            "offload share model / sim",
            "break-even (model)",
        ],
        headline,
    )
    L += ["", "The paper's claim (on a 100 Gbit/s cross-region link hybrid models gain, dense ones do not):", ""]
    L += claim_lines(mm, sim) or ["- (the map has no ~100 Gbit/s point)"]
    for rtt in mm.rtts_ms:
        L += ["", f"## Gain by model and link rate, RTT {rtt:g} ms (model / simulation)", ""]
        grid: list[list[str]] = []
        for m in mm.models:
            cells = [label(m.model)]
            for r in mm.rates_gbps:
                p = mm.point(m.model, r, rtt)
                g = sim.gain(p)
                cells.append(f"{p.gain:.2f}" + ("" if g is None else f" / {g:.2f}"))
            grid.append(cells)
        L += table_lines(["model", *(f"{r:g}G" for r in mm.rates_gbps)], grid)
    L += [
        "",
        "## Every point",
        "",
        "t: best threshold (tokens); split N_p/N_d of the PD instances; Λ in req/s; TTFT P90 in s (model: queue-free "
        "with the WAN; sim: at the light load).",
        "",
    ]
    every: list[list[str]] = []
    for p in mm.points:
        s, h = sim.points.get(p.key), sim.homogeneous.get(p.model)
        every.append(
            [
                label(p.model),
                f"{p.rate_gbps:g}",
                f"{p.rtt_ms:g}",
                f"{p.threshold:,}",
                f"{p.n_p}/{p.n_d}",
                f"{_pct(p.offload_share)}/{_pct(None if s is None else s.offload_share)}",
                f"{p.lambda_max:.2f}/{_f(None if s is None else s.lambda_max)}",
                f"{p.homogeneous_lambda_max:.2f}/{_f(None if s is None or h is None else h.lambda_max)}",
                f"{p.gain:.2f}/{_f(sim.gain(p))}",
                f"{p.ttft_p90_s:.2f}/{_f(None if s is None else s.ttft_p90_s)}",
                f"{p.bottleneck}{f' ({p.prfaas_bound})' if p.bottleneck == 'prfaas' else ''}",
                _pct(p.link_utilisation),
            ]
        )
    L += table_lines(
        [
            "model",
            "rate",
            "RTT",
            "t",
            "split",
            "share model/sim",
            "Λ PrfaaS model/sim",
            "Λ homog. model/sim",
            "gain model/sim",
            "TTFT P90 model/sim",
            "bound",
            "link util.",
        ],
        every,
    )
    L += [
        "",
        "Homogeneous PD per model (N_p/N_d, Λ_max by the model, bottleneck; Λ_max with PD-P's capacity "
        "N_p / E[T(L)] in place of the formula's N_p / T(E[L]); simulated): "
        + "; ".join(
            f"{label(m.model)} {m.homogeneous.n_p}/{m.homogeneous.n_d}, {m.homogeneous.lambda_max:.2f} "
            f"({m.homogeneous.bottleneck}), {m.homogeneous.lambda_mean_service:.2f}, "
            f"{_f(None if m.model not in sim.homogeneous else sim.homogeneous[m.model].lambda_max)}"
            for m in mm.models
        )
        + ".",
        "",
        "Where simulation and model differ: the paper's formula evaluates T_prefill at a stage's mean length; "
        "a replay pays T(l) per request, and with T convex in l a prefill-bound stage sustains N / E[T(L)], less "
        "than N / T(E[L]). Homogeneous PD is prefill-bound for most models, so its simulated Λ_max sits near the "
        "E[T(L)] figure and the simulated gains come out above the model's." + _gap_note(mm, sim, settings),
    ]
    if sources is not None:
        L += source_lines(sources, rate)
    if conf:
        L += ["", "## Confirmed by emulation", "", *confirm_table(conf, CONFIRM_TOLERANCE)]
    L += [
        "",
        "## Time",
        "",
        f"Model map: {timing.model_wall_s:.1f} s wall ({timing.model_cpu_s:.1f} s CPU). Simulation: "
        f"{timing.sim_runs} capacity searches in {timing.sim_wall_s:.1f} s wall ({timing.sim_cpu_s:.1f} s CPU)"
        + (
            f", {timing.sim_reused} reused from an earlier run (which took {timing.sim_reused_wall_s:.1f} s wall, "
            f"{timing.sim_reused_cpu_s:.1f} s CPU)"
            if timing.sim_reused
            else ""
        )
        + (
            f". Emulation: {timing.emulation_runs} searches in {timing.emulation_wall_s:.0f} s"
            if timing.emulation_runs
            else ""
        )
        + f". Total {timing.total_wall_s:.1f} s.",
    ]
    path = out / "report.md"
    path.write_text("\n".join(L) + "\n")
    return path


def summary_lines(mm: ModelMap, sim: SimResults, timing: Timing, sources: SourceMaps | None = None) -> list[str]:
    """What the command prints: the headline column and the break-even rates."""
    rate, first = headline_rate(mm), mm.rtts_ms[0]
    out = [
        f"gain of PrfaaS-PD over homogeneous PD at {rate:g} Gbit/s, {first:g} ms RTT (model / sim), "
        "and break-even link rate (model):"
    ]
    for m in mm.models:
        p = mm.point(m.model, rate, first)
        be = m.break_even
        bes = (
            "-"
            if be is None
            else (f"{be.rate_bps / 1e9:.3g} Gbit/s" if be.bound == "exact" and be.rate_bps else be.bound)
        )
        out.append(f"  {label(m.model):<14} {m.kind:<6} {p.gain:5.2f} / {_f(sim.gain(p)):>5}   break-even {bes}")
    out += claim_lines(mm, sim)
    if sources is not None:
        out += source_summary(sources, rate)
    out.append(
        f"time: model {timing.model_wall_s:.1f} s, simulation {timing.sim_wall_s:.1f} s wall "
        f"({timing.sim_cpu_s:.1f} s CPU, {timing.sim_runs} searches run, {timing.sim_reused} reused)"
        + (
            f", emulation {timing.emulation_wall_s:.0f} s ({timing.emulation_runs} searches)"
            if timing.emulation_runs
            else ""
        )
        + f", total {timing.total_wall_s:.1f} s"
    )
    return out
