"""The router's long-term loop (I/O-free): find the bottleneck stage, convert PD instances
between the prefill and decode roles, re-optimise the threshold (docs/paper.md section 3.4).

Every `sample_s` the driver hands `LongTermController.update` what it measured since the last
call (`RoleSignals`, paper units): per prefill stage (PrfaaS, PD-P) the modelled prefill work the
router routed there and the work still assigned and unfinished per instance; for PD-D the
sequences in the decode batches and those waiting for a slot; how many requests each node of the
PD cluster still holds; the recent requests' incremental and output lengths and arrival rate.
Every `interval_s` the controller judges the interval's means:

- a stage's *load* is the work routed per instance-second (prefill) or the share of decode slots
  in use; a stage is *hot* (a bottleneck) when its load reaches `hot_utilisation`, or when its
  queue (prefill work per instance; decode sequences waiting per instance) stands at
  `hot_queue_s` / `hot_waiting` or more and did not shrink over the interval (a queue that
  drains is a past bottleneck, not a present one);
- with a planner (`Planner`: the analytical model the driver passes in) and a threshold (policy
  prfaas), it first re-optimises t for the split in force on the recent sample; a change of more
  than `min_change` that lowers the higher predicted prefill stage load by `min_gain` is made at once, and
  PD-P's load it judged (measured at the old t) starts no conversion;
- when PD-P is hot and PD-D is not (or the reverse) in `confirm` judgements in a row, at least
  `min_interval_s` after the last conversion (and, for PD-P, the last retune), it converts one
  instance of the other role:
  if that role, one instance short, stays at or under `donor_utilisation` (scaled from its
  measured load) and not below `min_prefill` / `min_decode`, and the planner predicts a lower
  peak stage load at the new split (each at its own best t) than at the present one. The slot
  whose node holds the fewest requests drains (`testbed.core.control.roles`): it leaves routing at once,
  and the slot takes the new role at the first sample that finds its node empty; the threshold
  is then re-optimised for the new split. One conversion runs at a time.

The gap between `donor_utilisation` and `hot_utilisation`, `confirm` and `min_interval_s` keep
the loop from flapping: an instance moved to the bottleneck cannot make the role it left hot at
the same load. Every action (drain, activate, retune) and every confirmed bottleneck it cannot
relieve (hold) comes back as a `RoleDecision` with its reason and the signals it saw.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from testbed.core.control.bandwidth import BandwidthController, ThresholdChange
from testbed.core.control.roles import Role, RoleBook, other
from testbed.core.control.short_term import Recent, change_line
from testbed.core.routing.load_tracker import LoadTracker
from testbed.core.schema.scenario import LongTermSpec, Scenario

Stage = Literal["prfaas", "pdp", "pdd"]
Action = Literal["drain", "activate", "retune", "hold"]
STAGES: tuple[Stage, ...] = ("prfaas", "pdp", "pdd")
_STAGE_OF: dict[Role, Stage] = {"prefill": "pdp", "decode": "pdd"}

# metric, value, labels: one time-series sample (as `testbed.core.control.short_term.SeriesSample`)
SeriesSample = tuple[str, float, dict[str, str]]


@dataclass(frozen=True)
class PrefillSignals:
    instances: int  # routed to now
    routed_s: float  # modelled prefill work routed to the stage since the last signals (paper s)
    backlog_s: float  # work assigned and unfinished, per instance, now (paper s)


@dataclass(frozen=True)
class DecodeSignals:
    instances: int  # routed to now
    running: float  # sequences in their batches now
    waiting: float  # sequences with their KV in, waiting for a slot, now
    bs_max: int


@dataclass(frozen=True)
class RoleSignals:
    now: float
    interval_s: float  # since the previous signals
    pdp: PrefillSignals
    pdd: DecodeSignals
    prfaas: PrefillSignals | None = None
    active: Mapping[str, int] = field(default_factory=dict)  # requests each PD node still holds
    rate: float = 0.0  # recent arrivals, req/s
    lengths: Sequence[float] = ()  # recent requests' incremental lengths (tokens)
    outputs: Sequence[float] = ()  # their output lengths (tokens)


@dataclass(frozen=True)
class WorkloadSample:
    lengths: Sequence[float]
    outputs: Sequence[float]
    rate: float


@dataclass(frozen=True)
class ThresholdPlan:
    """The planner's answer for one split: the threshold (optimised, or the one asked about) and
    each stage's predicted load (offered rate over its capacity) there."""

    threshold: float
    loads: Mapping[str, float]

    @property
    def peak(self) -> float:
        return max(self.loads.values(), default=0.0)

    @property
    def prefill_peak(self) -> float:
        """The higher of the two prefill stages' loads: what the threshold moves."""
        return max((v for k, v in self.loads.items() if k != "pdd"), default=0.0)

    def text(self) -> str:
        return ", ".join(f"{k} {v:.2f}" for k, v in self.loads.items())


# (recent sample, N_p, N_d, threshold or None to optimise) -> plan
Planner = Callable[[WorkloadSample, int, int, float | None], ThresholdPlan]


@dataclass(frozen=True)
class Assessment:
    """One judgement: each stage's mean load over the interval, its queue at the end and at the
    start (prefill s per instance; decode sequences waiting per instance) and whether it is hot."""

    at: float
    loads: Mapping[str, float]
    queues: Mapping[str, float]
    queues_before: Mapping[str, float]
    hot: Mapping[str, bool]

    def text(self, stage: str) -> str:
        unit = " waiting" if stage == "pdd" else " s"
        return (
            f"{_NAMES[stage]} load {self.loads[stage]:.2f}, queue {self.queues[stage]:.1f}{unit} "
            f"(was {self.queues_before[stage]:.1f})"
        )

    def signals(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for st in self.loads:
            out[f"load_{st}"] = self.loads[st]
            out[f"queue_{st}"] = self.queues[st]
        return out


_NAMES = {"prfaas": "PrfaaS", "pdp": "PD-P", "pdd": "PD-D"}


@dataclass(frozen=True)
class RoleDecision:
    at: float
    action: Action
    reason: str
    prefill: int  # PD slots routed as prefill after the decision
    decode: int  # ... as decode
    draining: int  # ... changing role
    node: str = ""  # drain: the node leaving routing; activate: the node joining
    role: str = ""  # drain / activate: the role the slot goes to
    threshold_old: float | None = None
    threshold: float | None = None
    signals: Mapping[str, float] = field(default_factory=dict)


@dataclass
class _Window:
    """Sums over the judgement interval."""

    dt: float = 0.0
    routed: dict[str, float] = field(default_factory=lambda: {"prfaas": 0.0, "pdp": 0.0})
    capacity: dict[str, float] = field(default_factory=lambda: {"prfaas": 0.0, "pdp": 0.0})
    running: float = 0.0
    slots: float = 0.0
    first: dict[str, float] | None = None
    last: dict[str, float] = field(default_factory=dict)


def _queues(s: RoleSignals) -> dict[str, float]:
    q = {"pdp": s.pdp.backlog_s, "pdd": s.pdd.waiting / max(s.pdd.instances, 1)}
    if s.prfaas is not None:
        q["prfaas"] = s.prfaas.backlog_s
    return q


class LongTermController:
    def __init__(
        self, cfg: LongTermSpec, roles: RoleBook, threshold: float | None = None, planner: Planner | None = None
    ) -> None:
        self.cfg = cfg
        self.roles = roles
        self.threshold = threshold
        self.planner = planner
        self.retunes = planner is not None and threshold is not None and cfg.retune
        self.decisions: list[RoleDecision] = []
        self.assessments: list[Assessment] = []
        self._w = _Window()
        self._judged: float | None = None
        self._last_conversion = -math.inf  # a drain began or ended
        self._last_retune = -math.inf
        self._want: Role | None = None
        self._streak = 0
        self._last_hold = ""

    # -- the driver's entry point --------------------------------------------------------------

    def update(self, s: RoleSignals) -> list[RoleDecision]:
        """Take one sample's signals; returns the decisions made (often none)."""
        out: list[RoleDecision] = []
        self._accumulate(s)
        for slot, node, to in self.roles.draining():
            if s.active.get(node, 0) == 0:
                self.roles.apply(slot, "drained")
                self._last_conversion = s.now
                out.append(
                    self._decision(
                        s.now,
                        "activate",
                        f"{node} drained: slot {slot} now serves as {to} ({self.roles.node(slot, to)})",
                        node=self.roles.node(slot, to),
                        role=to,
                    )
                )
                r = self._retune(s, f"split now {self._split_text()}")
                if r is not None:
                    out.append(r)
        if self._judged is None:
            self._judged = s.now - s.interval_s
        if s.now - self._judged < self.cfg.interval_s - 1e-9:
            return self._keep(out)
        a = self._assess(s.now)
        self._judged = s.now
        if a is None or self.roles.draining() or len(s.lengths) < self.cfg.min_requests:
            return self._keep(out)
        r = self._retune(s, "re-optimised", a)
        if r is not None:
            out.append(r)
        d = self._judge(s, a, retuned=r is not None)
        if d is not None:
            out.append(d)
        return self._keep(out)

    # -- internals -----------------------------------------------------------------------------

    def _keep(self, out: list[RoleDecision]) -> list[RoleDecision]:
        self.decisions.extend(out)
        return out

    def _accumulate(self, s: RoleSignals) -> None:
        w = self._w
        dt = max(s.interval_s, 0.0)
        w.dt += dt
        for name, st in (("prfaas", s.prfaas), ("pdp", s.pdp)):
            if st is not None:
                w.routed[name] += st.routed_s
                w.capacity[name] += st.instances * dt
        w.running += s.pdd.running * dt
        w.slots += s.pdd.instances * s.pdd.bs_max * dt
        q = _queues(s)
        if w.first is None:
            w.first = q
        w.last = q

    def _assess(self, now: float) -> Assessment | None:
        w, self._w = self._w, _Window()
        if w.dt <= 0 or w.first is None:
            return None
        cfg = self.cfg
        loads: dict[str, float] = {}
        for name in ("prfaas", "pdp"):
            if name in w.last:
                loads[name] = w.routed[name] / w.capacity[name] if w.capacity[name] > 0 else math.inf
        loads["pdd"] = w.running / w.slots if w.slots > 0 else math.inf
        hot: dict[str, bool] = {}
        for name in loads:
            q, q0 = w.last[name], w.first.get(name, 0.0)
            limit = cfg.hot_waiting if name == "pdd" else cfg.hot_queue_s
            hot[name] = loads[name] >= cfg.hot_utilisation or (q >= limit and q >= q0)
        a = Assessment(now, loads, dict(w.last), dict(w.first), hot)
        self.assessments.append(a)
        return a

    def _sample(self, s: RoleSignals) -> WorkloadSample:
        return WorkloadSample(tuple(s.lengths), tuple(s.outputs), s.rate)

    def _split(self) -> tuple[int, int]:
        c = self.roles.counts()
        return c["prefill"], c["decode"]

    def _split_text(self) -> str:
        n_p, n_d = self._split()
        return f"{n_p} P / {n_d} D"

    def _retune(self, s: RoleSignals, why: str, a: Assessment | None = None) -> RoleDecision | None:
        if (
            not self.retunes
            or self.planner is None
            or self.threshold is None
            or s.rate <= 0
            or len(s.lengths) < self.cfg.min_requests
        ):
            return None
        n_p, n_d = self._split()
        smp = self._sample(s)
        plan = self.planner(smp, n_p, n_d, None)
        old = self.threshold
        if abs(plan.threshold - old) <= self.cfg.min_change * old:
            return None
        now_plan = self.planner(smp, n_p, n_d, old)
        if plan.prefill_peak > now_plan.prefill_peak * (1 - self.cfg.min_gain):
            return None
        self.threshold = plan.threshold
        self._last_retune = s.now
        reason = (
            f"{why}: best t for {n_p} P / {n_d} D on the last {len(smp.lengths)} requests "
            f"({smp.rate:.2f} req/s); predicted load at t={old:.0f}: {now_plan.text()} -> at "
            f"t={plan.threshold:.0f}: {plan.text()}"
        )
        return self._decision(s.now, "retune", reason, threshold_old=old, a=a)

    def _judge(self, s: RoleSignals, a: Assessment, retuned: bool) -> RoleDecision | None:
        cfg = self.cfg
        hot_p, hot_d = a.hot["pdp"], a.hot["pdd"]
        want: Role | None = "prefill" if hot_p and not hot_d else "decode" if hot_d and not hot_p else None
        if want == "prefill" and retuned:
            # PD-P's load was measured at the old threshold: the new one is to be seen first. (PD-D's
            # does not depend on t, so a decode bottleneck stands.)
            self._want, self._streak = None, 0
            return None
        self._streak = self._streak + 1 if want is not None and want == self._want else (1 if want else 0)
        self._want = want
        if want is None:
            if hot_p and hot_d:
                return self._hold(
                    s,
                    a,
                    "both",
                    f"PD-P and PD-D are both bottlenecks ({a.text('pdp')}; "
                    f"{a.text('pdd')}): neither role has an instance to give",
                )
            self._last_hold = ""
            return None
        if self._streak < cfg.confirm:
            return None
        donor = other(want)
        stage, dstage = _STAGE_OF[want], _STAGE_OF[donor]
        seen = f"{a.text(stage)}; {a.text(dstage)}"
        last = max(self._last_conversion, self._last_retune if want == "prefill" else -math.inf)
        if s.now - last < cfg.min_interval_s:
            return None  # quiet: the last action's effect is still settling
        n = self.roles.counts()[donor]
        floor = cfg.min_prefill if donor == "prefill" else cfg.min_decode
        if n - 1 < floor:
            return self._hold(
                s,
                a,
                "floor",
                f"{_NAMES[stage]} is the bottleneck ({seen}), but {donor} is at its minimum of {floor} instance(s)",
            )
        after = a.loads[dstage] * n / (n - 1)
        if a.hot[dstage] or after > cfg.donor_utilisation:
            return self._hold(
                s,
                a,
                "donor",
                f"{_NAMES[stage]} is the bottleneck ({seen}), but {_NAMES[dstage]} with "
                f"{n - 1} instance(s) would run at load {after:.2f} (> {cfg.donor_utilisation:g})",
            )
        model = ""
        if self.planner is not None and s.rate > 0:
            n_p, n_d = self._split()
            new = (n_p + 1, n_d - 1) if want == "prefill" else (n_p - 1, n_d + 1)
            smp = self._sample(s)
            cur = self.planner(smp, n_p, n_d, None)
            nxt = self.planner(smp, new[0], new[1], None)
            if nxt.peak >= cur.peak:
                return self._hold(
                    s,
                    a,
                    "model",
                    f"{_NAMES[stage]} is the bottleneck ({seen}), but the model predicts "
                    f"no gain at {new[0]} P / {new[1]} D: peak load {nxt.peak:.2f} ({nxt.text()}) vs "
                    f"{cur.peak:.2f} ({cur.text()}) now",
                )
            model = f"; model: peak load {cur.peak:.2f} now, {nxt.peak:.2f} at {new[0]} P / {new[1]} D"
        slot = min(self.roles.holding(donor), key=lambda i: (s.active.get(self.roles.node(i, donor), 0), -i))
        node = self.roles.node(slot, donor)
        self.roles.apply(slot, "convert")
        self._last_conversion = s.now
        self._want, self._streak, self._last_hold = None, 0, ""
        reason = (
            f"{_NAMES[stage]} is the bottleneck {cfg.confirm} judgement(s) in a row ({seen}); "
            f"{_NAMES[dstage]} one short would run at load {after:.2f}{model}; draining {node} "
            f"({s.active.get(node, 0)} request(s) on it) to serve as {want}"
        )
        return self._decision(s.now, "drain", reason, node=node, role=want, a=a)

    def _hold(self, s: RoleSignals, a: Assessment, kind: str, reason: str) -> RoleDecision | None:
        """A bottleneck the loop cannot relieve: recorded once until the cause changes."""
        if kind == self._last_hold:
            return None
        self._last_hold = kind
        return self._decision(s.now, "hold", reason, a=a)

    def _decision(
        self,
        at: float,
        action: Action,
        reason: str,
        node: str = "",
        role: str = "",
        threshold_old: float | None = None,
        a: Assessment | None = None,
    ) -> RoleDecision:
        c = self.roles.counts()
        sig = a.signals() if a is not None else (self.assessments[-1].signals() if self.assessments else {})
        return RoleDecision(
            at, action, reason, c["prefill"], c["decode"], c["draining"], node, role, threshold_old, self.threshold, sig
        )


def role_series(ctl: LongTermController, judged: bool) -> list[SeriesSample]:
    """The router's time-series samples of one update: instances per role of the PD cluster,
    the threshold the loop holds and, after a judgement, the stage loads and queues it saw."""
    c = ctl.roles.counts()
    lab = {"cluster": ctl.roles.cluster}
    out: list[SeriesSample] = [
        ("role_instances", float(c[r]), {**lab, "role": r}) for r in ("prefill", "decode", "draining")
    ]
    if ctl.threshold is not None:
        out.append(("longterm_threshold", ctl.threshold, {}))
    if judged and ctl.assessments:
        a = ctl.assessments[-1]
        for st, v in a.loads.items():
            out.append(("stage_load", v if math.isfinite(v) else -1.0, {"stage": st}))
            out.append(("stage_queue", a.queues[st], {"stage": st}))
    return out


def decision_line(d: RoleDecision, cluster: str) -> SeriesSample:
    """The `decisions.jsonl` sample of a long-term decision: its value is the PD slots routed as
    prefill after it; labels carry the action, reason, counts, threshold and signals."""
    labels = {
        "action": d.action,
        "cluster": cluster,
        "node": d.node,
        "role": d.role,
        "reason": d.reason,
        "prefill": str(d.prefill),
        "decode": str(d.decode),
        "draining": str(d.draining),
    }
    if d.threshold is not None:
        labels["threshold"] = f"{d.threshold:.0f}"
    if d.threshold_old is not None:
        labels["threshold_old"] = f"{d.threshold_old:.0f}"
    for k, v in d.signals.items():
        labels[k] = f"{v:.4g}"
    return ("role_decision", float(d.prefill), labels)


def controller_for(sc: Scenario, threshold: float | None, planner: Planner | None) -> LongTermController | None:
    """The long-term loop a scenario asks for (`policy.control.long_term`), if any: over the
    (one) PD cluster's slots, holding the threshold under the prfaas policy."""
    lt = sc.policy.control.long_term
    if not lt.enabled:
        return None
    pd = next(c for c in sc.clusters if c.kind == "pd")
    t = threshold if sc.policy.name == "prfaas" and threshold is not None and threshold > 0 else None
    return LongTermController(lt, RoleBook(pd.name, pd.prefill, pd.decode), t, planner)


class RoleMeter:
    """The prefill stages' signals from the router's own books (`LoadTracker`: work routed to
    each instance for good, work assigned and unfinished), between two calls. `paper_per_unit`
    turns the tracker's time unit (the driver's) into paper seconds."""

    def __init__(self, sc: Scenario, tracker: LoadTracker, roles: RoleBook, paper_per_unit: float = 1.0) -> None:
        self.tracker = tracker
        self.roles = roles
        self.k = paper_per_unit
        self.prfaas = [n for c in sc.clusters if c.kind == "prfaas" for n in tracker.node_ids(c.name)[0]]
        self.pd_prefill = [roles.prefill_node(i) for i in range(roles.size)]
        self.pd_nodes = roles.nodes()
        self._prev = dict(tracker.assigned_work)

    def _stage(self, nodes: Sequence[str], routed: Sequence[str], work: Mapping[str, float]) -> PrefillSignals:
        tr = self.tracker
        done = sum(work[n] - self._prev.get(n, 0.0) for n in nodes)
        backlog = sum(tr.prefill_backlog[n] for n in routed)
        return PrefillSignals(len(routed), done * self.k, backlog * self.k / len(routed) if routed else 0.0)

    def signals(
        self,
        now: float,
        interval_s: float,
        decode: DecodeSignals,
        down: frozenset[str] = frozenset(),
        recent: Recent | None = None,
    ) -> RoleSignals:
        """This sample's signals at paper time `now`; `down`: instances out of routing for their
        health (they count as no capacity)."""
        work = dict(self.tracker.assigned_work)
        pdp = self._stage(self.pd_prefill, [n for n in self.roles.routable("prefill") if n not in down], work)
        pf = self._stage(self.prfaas, [n for n in self.prfaas if n not in down], work) if self.prfaas else None
        self._prev = work
        active = {n: self.tracker.active[n] for n in self.pd_nodes}
        if recent is None:
            return RoleSignals(now, interval_s, pdp, decode, pf, active)
        return RoleSignals(
            now, interval_s, pdp, decode, pf, active, recent.rate(now), tuple(recent.lengths), tuple(recent.outputs)
        )


@dataclass(frozen=True)
class Applied:
    """What a driver does with one update's decisions: the threshold to route with (None: no
    change) and the `decisions.jsonl` lines to write."""

    threshold: float | None
    lines: list[SeriesSample]


def apply(ctl: LongTermController, decisions: Sequence[RoleDecision], bandwidth: BandwidthController | None) -> Applied:
    """Carry decisions over to the short-term loop (a retuned t is its new base; a new split its
    PD-P count) and into record lines: each decision, and a retune also as a threshold change
    (the report's threshold table and plot show both loops' changes)."""
    lines: list[SeriesSample] = []
    threshold: float | None = None
    cluster = ctl.roles.cluster
    for d in decisions:
        lines.append(decision_line(d, cluster))
        if d.action == "retune" and d.threshold is not None and d.threshold_old is not None:
            threshold = d.threshold
            old = bandwidth.threshold if bandwidth is not None else d.threshold_old
            if bandwidth is not None:
                bandwidth.rebase(base=d.threshold)
            lines.append(change_line(ThresholdChange(d.at, old, d.threshold, f"long-term loop: {d.reason}")))
        elif d.action in ("drain", "activate") and bandwidth is not None:
            bandwidth.rebase(pdp_instances=d.prefill)
    return Applied(threshold, lines)
