"""`testbed plan`'s options (its flags, one field each) and its result (plan.json's content as
typed data; `PlanResult.to_json()` writes the file)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from testbed.core.sessions import ArrivalMode
from testbed.model.planner import KINDS, Candidate, Objective, PlanSettings
from testbed.model.workload import WorkloadSummary
from testbed.studies.plan.plan_report import key
from testbed.traces.csvutil import Window


@dataclass(frozen=True)
class PlanOptions:
    """`testbed plan`'s flags, one field each."""

    trace: Path
    format: str = "auto"
    window: Window | None = None
    scenario: tuple[str, ...] = ()
    kinds: str = ",".join(KINDS)
    objective: Objective = "lambda"
    ttft_slo: float | None = None
    tpot_slo: float | None = None
    budget: tuple[str, ...] = ()
    vary_counts: bool = False
    link_gbps: float | None = None
    top: int = 3
    refine: int = 0
    no_sim: bool = False
    arrivals: ArrivalMode | None = None  # None: the first base scenario's workload.arrivals
    out: Path | None = None
    overwrite: bool = False
    json: bool = False

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> PlanOptions:
        return cls(
            trace=Path(ns.trace),
            format=ns.format,
            window=ns.window,
            scenario=tuple(ns.scenario or ()),
            kinds=ns.kinds,
            objective=ns.objective,
            ttft_slo=ns.ttft_slo,
            tpot_slo=ns.tpot_slo,
            budget=tuple(ns.budget),
            vary_counts=ns.vary_counts,
            link_gbps=ns.link_gbps,
            top=ns.top,
            refine=ns.refine,
            no_sim=ns.no_sim,
            arrivals=ns.arrivals,
            out=ns.out,
            overwrite=ns.overwrite,
            json=ns.json,
        )


@dataclass(frozen=True)
class KindPlan:
    """One kind's outcome: its first choice (and the file written for it), the model's first
    choice before simulation, its base as it stands and its fewest instances meeting the SLOs."""

    best: Candidate | None
    model_first: Candidate | None
    reference: Candidate | None
    fewest: Candidate | None
    candidates: int


@dataclass(frozen=True)
class PlanResult:
    """What `run_plan` found; `to_json()` is plan.json's content."""

    trace: Path
    window: Window | None
    workload: WorkloadSummary  # TraceWorkload.summary()
    settings: PlanSettings
    vary_counts: bool
    cache_aware: bool
    simulated_per_kind: int
    budgets: dict[str, str]
    bases: dict[str, Path]
    notes: list[str]
    verification: str | None  # why the plans are not verified by simulation (None: they are)
    kinds: dict[str, KindPlan]
    ranking: list[Candidate]
    simulated: dict[str, Candidate]
    files: dict[tuple[object, ...], str]  # the scenario file written per candidate key
    out: Path
    seconds: float
    schedulers: dict[str, str] = field(default_factory=dict)  # hardware -> the prefill scheduler assumed
    arrivals: ArrivalMode = "open"  # the mode the simulated replays used (the model reads arrivals as open)
    sessions: int = 0  # sessions of two or more turns in the trace (stated or inferred)

    @property
    def verified(self) -> bool:
        return self.verification is None

    def file(self, c: Candidate) -> str | None:
        return self.files.get(key(c))

    def _with_file(self, c: Candidate) -> dict[str, object]:
        return {**c.to_dict(), "file": self.file(c)}

    def to_json(self) -> dict[str, object]:
        s = self.settings
        return {
            "trace": str(self.trace),
            "window": list(self.window) if self.window else None,
            "workload": self.workload,
            "settings": {
                "objective": s.objective,
                "ttft_slo_s": s.ttft_slo_s,
                "tpot_slo_s": s.tpot_slo_s,
                "link_bps": s.link_bps,
                "link_delay_s": s.link_delay_s,
                "vary_counts": self.vary_counts,
                "cache_aware": self.cache_aware,
                "simulated_per_kind": self.simulated_per_kind,
                "budgets": self.budgets,
                "schedulers": self.schedulers,
                "arrivals": self.arrivals,
                "sessions": self.sessions,
            },
            "bases": {k: str(p) for k, p in self.bases.items()},
            "notes": self.notes,
            "verified": self.verified,
            "verification": self.verification or "simulated",
            "kinds": {
                kind: {
                    "best": self._with_file(k.best) if k.best else None,
                    "model_first": k.model_first.to_dict() if k.model_first else None,
                    "reference": k.reference.to_dict() if k.reference else None,
                    "fewest": self._with_file(k.fewest) if k.fewest else None,
                    "candidates": k.candidates,
                }
                for kind, k in self.kinds.items()
            },
            "ranking": [self._with_file(c) for c in self.ranking],
            "simulated": {name: c.to_dict() for name, c in self.simulated.items()},
            "out": str(self.out),
            "seconds": self.seconds,
        }
