"""`plan.png`: the plan at a glance. Each kind's first choice as one row: on the left its capacity
(Lambda_max) against the trace's own rate, on the right its mean and P90 TTFT at that rate, the
simulator's where it ran and the model's otherwise, against the TTFT SLO. Drawn from the result
plan.json is written from, so the picture and the tables below it cannot disagree."""

from __future__ import annotations

import math
from pathlib import Path

from testbed.model.planner import Candidate
from testbed.studies.plan.plan_result import PlanResult

KIND_LABEL = {"prfaas": "PrfaaS-PD", "homogeneous": "homogeneous PD", "naive": "naive heterogeneous"}


def _label(c: Candidate) -> str:
    counts = "/".join(
        "-" if n == 0 and k != "n_d" else str(n) for k, n in (("n_prfaas", c.n_prfaas), ("n_p", c.n_p), ("n_d", c.n_d))
    )
    t = c.threshold
    return f"{KIND_LABEL.get(c.kind, c.kind)}\nPrfaaS/prefill/decode {counts}" + (
        f", t={t / 1000:.3g}K" if t is not None and c.kind == "prfaas" else ""
    )


def _figure(sim: dict[str, object] | None, name: str, model: float) -> float:
    """The simulator's figure where it ran, else the model's (None/inf in either: drawn as 0,
    as plan.json's null was)."""
    v = (sim or {}).get(name, model)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else 0.0


def write_plan_figure(result: PlanResult, path: Path) -> Path | None:
    """Draw `result` into `path`; None when no kind has a plan."""
    best = [k.best for k in result.kinds.values() if k.best is not None]
    if not best:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best.sort(key=lambda c: -c.lambda_max)
    rate = float(result.workload["rate_rps"])
    slo = result.settings.ttft_slo_s
    labels = [_label(c) for c in best]
    y = list(range(len(best)))[::-1]
    fig, (ax_l, ax_t) = plt.subplots(
        1, 2, figsize=(10, 1.1 + 0.9 * len(best)), sharey=True, gridspec_kw={"width_ratios": [1, 1]}
    )
    ax_l.barh(y, [c.lambda_max for c in best], color="#3f51b5", height=0.55)
    ax_l.axvline(rate, color="#d32f2f", ls="--", lw=1.2)
    ax_l.text(rate, max(y) + 0.45, f" the trace: {rate:.2f} req/s", color="#d32f2f", fontsize=8, va="bottom")
    for yi, c in zip(y, best):
        ax_l.text(c.lambda_max, yi, f" {c.lambda_max:.2f}", va="center", fontsize=8)
    ax_l.set_yticks(y, labels, fontsize=8)
    ax_l.set_xlabel("Λ_max, the model's capacity (req/s)")
    ax_l.set_xlim(0, max(max(c.lambda_max for c in best), rate) * 1.25)

    sims = [c.simulated or {} for c in best]
    mean = [_figure(s, "ttft_mean_s", c.ttft_mean_s) for s, c in zip(sims, best)]
    p90 = [_figure(s, "ttft_p90_s", c.ttft_p90_s) for s, c in zip(sims, best)]
    ax_t.barh([v + 0.14 for v in y], mean, height=0.28, color="#5c6bc0", label="mean")
    ax_t.barh([v - 0.14 for v in y], p90, height=0.28, color="#9fa8da", label="P90")
    for yi, p, s in zip(y, p90, sims):
        ax_t.text(p, yi - 0.14, f" {p:.2f} s ({'simulated' if s else 'model'})", va="center", fontsize=8)
    top = max(p90)
    if slo <= 3 * top:
        ax_t.axvline(slo, color="#d32f2f", ls="--", lw=1.2)
        ax_t.text(slo, max(y) + 0.45, f" TTFT SLO {slo:g} s", color="#d32f2f", fontsize=8, va="bottom")
    ax_t.set_xlim(0, max(top * 1.6, slo * 1.1 if slo <= 3 * top else 0))
    ax_t.set_xlabel("TTFT at the trace's rate (s)")
    ax_t.legend(loc="upper right", fontsize=8, frameon=False)
    fig.suptitle(f"{result.trace.name}: each kind's first choice", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
