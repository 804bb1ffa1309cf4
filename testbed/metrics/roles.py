"""The router's long-term loop in a run's summary and report: what it decided and why (the
`role_decision` lines of `decisions.jsonl`), the PD cluster's instances per role over time
(the router's `role_instances` series) and the stage loads it judged (`stage_load`).

Summary keys (`long_term`, paper units; absent when the loop did not run):

- `long_term.decisions`: Decisions by action: `drain` (an instance leaves its role's routing), `activate`
  (it serves in the other role), `retune` (threshold re-optimised), `hold` (a bottleneck the loop could
  not relieve).
- `long_term.conversions`: Role conversions completed (activations).
- `long_term.changes`: The first 50 decisions: `t_s` (paper s since t0), `action`, `node`, `role`,
  `prefill`, `decode`, `threshold`, `reason`.
- `long_term.split_start`, `.split_end`: PD prefill / decode instances at the first and last sample, e.g.
  `"3/5"`.
- `long_term.prefill_mean`: Time-weighted mean of the PD instances serving as prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from testbed.core.schema.scaling import Scale
from testbed.metrics.artefacts import Summary
from testbed.metrics.fault_effects import FaultWindow, draw_fault_bands
from testbed.metrics.plot_style import stamp
from testbed.metrics.series_format import SeriesPoint
from testbed.metrics.timeseries import decision_points, select, time_weighted_mean

MAX_CHANGES = 50
ACTIONS = ("drain", "activate", "retune", "hold")
MARKS = {
    "drain": ("v", "tab:red"),
    "activate": ("^", "tab:green"),
    "retune": ("D", "tab:purple"),
    "hold": ("x", "gray"),
}


def read_role_decisions(run_dir: Path, t0: float | None, speedup: float) -> list[dict[str, object]]:
    """The long-term loop's decisions from `decisions.jsonl`, in paper seconds since t0."""
    out = []
    for p in decision_points(run_dir, t0, speedup, "role_decision"):
        lab = p.labels
        thr = lab.get("threshold")
        out.append(
            {
                "t_s": p.t,
                "action": str(lab.get("action", "")),
                "node": str(lab.get("node", "")),
                "role": str(lab.get("role", "")),
                "prefill": int(lab.get("prefill", 0)),
                "decode": int(lab.get("decode", 0)),
                "threshold": None if thr is None else float(thr),
                "reason": str(lab.get("reason", "")),
            }
        )
    return out


def _counts(samples: Sequence[SeriesPoint], role: str) -> list[SeriesPoint]:
    return sorted(select(samples, metric="role_instances", labels={"role": role}), key=lambda p: p.t)


def long_term_summary(
    run_dir: Path, t0: float | None, samples: Sequence[SeriesPoint], scale: Scale
) -> dict[str, object] | None:
    pre, dec = _counts(samples, "prefill"), _counts(samples, "decode")
    ds = read_role_decisions(run_dir, t0, scale.speedup)
    if not pre and not ds:
        return None
    mean = time_weighted_mean(pre) if len(pre) >= 2 else None

    def split(i: int) -> str | None:
        return f"{pre[i].value:.0f}/{dec[i].value:.0f}" if pre and dec else None

    return {
        "decisions": {a: sum(1 for d in ds if d["action"] == a) for a in ACTIONS},
        "conversions": sum(1 for d in ds if d["action"] == "activate"),
        "changes": ds[:MAX_CHANGES],
        "split_start": split(0),
        "split_end": split(-1),
        "prefill_mean": mean,
    }


def long_term_rows(s: Summary) -> list[tuple[str, str]]:
    lt = s.long_term
    if not lt:
        return []
    n = lt.decisions
    mean = lt.prefill_mean
    return [
        ("PD split (prefill / decode) at start -> end", f"{lt.split_start or 'n/a'} -> {lt.split_end or 'n/a'}"),
        ("Role conversions completed", f"{lt.conversions:,}"),
        ("Decisions: drain / activate / retune / hold", " / ".join(f"{n.get(a, 0):,}" for a in ACTIONS)),
        ("Time-weighted mean of PD prefill instances", "n/a" if mean is None else f"{mean:.2f}"),
    ]


def decision_rows(s: Summary, limit: int = 20) -> list[tuple[str, str, str, str, str]]:
    rows = []
    for d in (s.long_term.changes if s.long_term else [])[:limit]:
        thr = d.threshold
        rows.append(
            (
                f"{d.t_s:.1f}",
                d.action + (f" {d.node}" if d.node else ""),
                f"{d.prefill}/{d.decode}",
                "n/a" if thr is None else f"{thr:,.0f}",
                d.reason,
            )
        )
    return rows


def plot_roles(
    samples: Sequence[SeriesPoint],
    decisions: Sequence[dict[str, object]],
    scale: Scale,
    path: Path,
    bands: Sequence[FaultWindow] = (),
    title: str = "",
) -> Path | None:
    """PD instances per role over time with the loop's decisions marked; the stage loads it
    judged; the threshold in force and the one the loop holds."""
    pre = _counts(samples, "prefill")
    if not pre:
        return None
    s = scale.speedup
    from matplotlib.figure import Figure  # here: the summary needs no plotting library

    fig = Figure(figsize=(8, 7.2), layout="constrained")
    ax = fig.subplots(3, 1, sharex=True)
    for role, style in (("prefill", "-"), ("decode", "-"), ("draining", ":")):
        pts = _counts(samples, role)
        ax[0].plot(
            [p.t * s for p in pts],
            [p.value for p in pts],
            drawstyle="steps-post",
            linestyle=style,
            linewidth=1.3,
            label=role,
        )
    top = max((p.value for p in select(samples, metric="role_instances")), default=1.0)
    for action in ACTIONS:
        ds = [d for d in decisions if d["action"] == action]
        if ds:
            m, c = MARKS[action]
            ax[0].scatter(
                [d["t_s"] for d in ds], [top + 0.5] * len(ds), marker=m, color=c, s=28, label=action, zorder=3
            )
    ax[0].set_ylabel("PD instances")
    ax[0].set_ylim(-0.2, top + 1.2)
    ax[0].legend(fontsize="x-small", ncol=4, loc="lower left")
    loads = select(samples, metric="stage_load")
    for stage in ("prfaas", "pdp", "pdd"):
        pts = sorted((p for p in loads if p.labels.get("stage") == stage and p.value >= 0), key=lambda p: p.t)
        if pts:
            ax[1].plot(
                [p.t * s for p in pts],
                [p.value for p in pts],
                marker=".",
                linewidth=0.9,
                label={"prfaas": "PrfaaS", "pdp": "PD-P", "pdd": "PD-D (slots)"}[stage],
            )
    ax[1].set_ylabel("stage load (judged)")
    ax[1].set_ylim(0, max(1.5, min(3.0, max((p.value for p in loads), default=1.0) * 1.05)))
    ax[1].legend(fontsize="x-small")
    thr = sorted(select(samples, metric="threshold", source="router"), key=lambda p: p.t)
    base = sorted(select(samples, metric="longterm_threshold"), key=lambda p: p.t)
    if thr:
        ax[2].plot(
            [p.t * s for p in thr], [p.value for p in thr], drawstyle="steps-post", linewidth=1.0, label="in force"
        )
    if base:
        ax[2].plot(
            [p.t * s for p in base],
            [p.value for p in base],
            drawstyle="steps-post",
            linewidth=1.2,
            linestyle="--",
            label="long-term loop's",
        )
    for d in decisions:
        if d["action"] in ("drain", "activate", "retune"):
            for a in ax[1:]:
                a.axvline(d["t_s"], color=MARKS[d["action"]][1], linewidth=0.6, alpha=0.5)
    ax[2].set_ylabel("threshold t (tokens)")
    if thr or base:
        ax[2].set_yscale("log")
        ax[2].legend(fontsize="x-small")
    ax[2].set_xlabel("time since run start (paper seconds)")
    for a in ax:
        a.grid(alpha=0.3)
    draw_fault_bands(ax, bands)
    stamp(fig, title)
    fig.savefig(path, dpi=110)
    return path


def roles_cell(s: Summary) -> str:
    """One comparison-table cell: conversions and the split at the end."""
    lt = s.long_term
    if not lt:
        return "n/a"
    return f"{lt.conversions} -> {lt.split_end or 'n/a'}"
