"""Load-aware cache routing (`policy.cache_routing: load-aware`), I/O-free.

The paper's cache-aware rules (`testbed.core.routing.policy.prfaas`) send a request to the cluster that
holds its prefix whatever that cluster's queue. This policy predicts, for every candidate, the
TTFT it would give:

    TTFT = max(queue wait, cache move) + prefill of the uncached tokens + KV transfer tail

- candidates: each cluster with a prefill instance up, with the prefix its own pool holds, or
  with a longer prefix moved in from another cluster that holds one (and has an instance up to
  send it);
- queue wait: the backlog of the cluster's least-loaded prefill instance (the modelled work the
  router booked there and has not seen finish), the instance the request would join;
- cache move: the moved KV (full-attention blocks in between, and the linear state) at the
  link's rate plus its one-way delay; it starts at routing, so it overlaps the wait, and the
  prefill cannot start before it has arrived;
- prefill: the cluster hardware's calibrated time of (uncached, cached) tokens;
- KV transfer tail: the KV the decode cluster lacks streams layer by layer while the prefill
  computes, so TTFT pays what is left at its end (at least the last layer) plus the one-way
  delay; across datacenters at the link monitor's bandwidth estimate (the configured rate when
  nothing measures it), inside one at the intra-DC rate.
The decode side (its queue and first step) is the same whichever prefill is chosen and is left
out.

The threshold rule stays the default: the cluster the paper's rules pick (short increments stay
on the local PD cluster) is kept unless another candidate is predicted faster by more than a
margin (`LoadAwareSpec`). Offloading ships a request's whole linear state however short it is,
and a prediction for one request does not see the link capacity that takes from later ones; the
margin keeps such offloads to where the gain pays for them. On the rule's cluster the move is
made only when it is predicted faster than recomputing, so a move that costs more than it saves
is never made. Ties go to the rule's cluster, then to fewer WAN bytes, then to the cluster name,
then to no move: the same view always gives the same decision.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from testbed.core.engine.kvsize import KVModel
from testbed.core.engine.servicetime import PrefillTime
from testbed.core.routing.policy import (
    CacheMove,
    ClusterView,
    Decision,
    NoCapacity,
    Policy,
    RoutingRequest,
    View,
    build_decision,
    decode_cluster_for,
    get_policy,
    least_loaded_prefill,
    prfaas,
)
from testbed.core.schema.kinds import unknown_kind
from testbed.core.schema.linkprofile import LinkProfile
from testbed.core.schema.scenario import Scenario


@dataclass(frozen=True)
class LinkCost:
    rate_bps: float  # paper bit/s
    delay_s: float  # one way

    def time(self, nbytes: float, rate_bps: float | None = None) -> float:
        return nbytes * 8.0 / (rate_bps or self.rate_bps) + self.delay_s


@dataclass(frozen=True)
class RouteCosts:
    """What the predictions need of a deployment, in paper units."""

    kv: KVModel
    prefill: Mapping[str, PrefillTime]  # cluster -> its hardware's prefill time
    intra: LinkCost
    inter: LinkCost
    min_gain_s: float = 0.0  # the rule's pick stands unless another is predicted faster by more

    @classmethod
    def for_scenario(cls, sc: Scenario, intra: LinkProfile, inter: LinkProfile) -> RouteCosts:
        la = sc.policy.load_aware
        return cls(
            KVModel.from_spec(sc.model),
            {c.name: PrefillTime.from_spec(sc.hardware[c.hardware].prefill) for c in sc.clusters},
            LinkCost(intra.rate, intra.delay),
            LinkCost(inter.rate, inter.delay),
            la.min_gain_s,
        )


@dataclass(frozen=True)
class Candidate:
    """One way to serve a request, with its predicted TTFT parts (paper seconds)."""

    cluster: str
    cached: int  # prefix the prefill reuses
    move: CacheMove | None
    wait_s: float
    move_s: float
    prefill_s: float
    kv_s: float
    wan_bytes: int  # cache move and KV that cross datacenters

    @property
    def ttft_s(self) -> float:
        return max(self.wait_s, self.move_s) + self.prefill_s + self.kv_s

    def text(self) -> str:
        mv = f"+move {self.move.tokens - self.move.from_tokens} from {self.move.src_cluster}" if self.move else ""
        return (
            f"{self.cluster}{mv} {self.ttft_s:.2f} s (wait {self.wait_s:.2f}, move {self.move_s:.2f}, "
            f"prefill {self.prefill_s:.2f}, kv {self.kv_s:.2f}; {self.wan_bytes / 1e6:.0f} MB WAN)"
        )


def _link(costs: RouteCosts, view: View, a: ClusterView, b: ClusterView) -> tuple[LinkCost, float | None]:
    """The link between two clusters and the rate to use on it."""
    if a.datacenter == b.datacenter:
        return costs.intra, None
    return costs.inter, view.bandwidth_bps


def _candidate(
    view: View, req: RoutingRequest, costs: RouteCosts, c: ClusterView, src: ClusterView | None
) -> Candidate:
    own = req.cached.get(c.name, 0)
    move = None
    move_s = 0.0
    wan = 0
    cached = own
    if src is not None:
        cached = req.cached[src.name]
        move = CacheMove(src.name, c.name, cached, own)
        nbytes = costs.kv.incremental(cached, own)
        link, rate = _link(costs, view, src, c)
        move_s = link.time(nbytes, rate)
        wan += nbytes if src.datacenter != c.datacenter else 0
    wait = least_loaded_prefill(c).backlog * view.backlog_scale
    uncached = max(req.input_tokens - cached, 0)
    prefill_s = costs.prefill[c.name](uncached, cached)
    dc = decode_cluster_for(view, c)
    dec_cached = cached if dc.name == c.name else req.cached.get(dc.name, 0)
    total, last = costs.kv.shipped(req.input_tokens, dec_cached)
    link, rate = _link(costs, view, c, dc)
    stream = link.time(total, rate) - link.delay_s
    kv_s = max(stream - prefill_s, link.time(last, rate) - link.delay_s) + link.delay_s
    wan += total if dc.datacenter != c.datacenter else 0
    return Candidate(c.name, cached, move, wait, move_s, prefill_s, kv_s, wan)


def candidates(view: View, req: RoutingRequest, costs: RouteCosts) -> list[Candidate]:
    """Every cluster with a prefill instance up, with its own prefix and with each longer
    prefix another cluster (with an instance up to send it) could move in."""
    up = [c for c in view.clusters if c.prefill]
    out = []
    for c in up:
        out.append(_candidate(view, req, costs, c, None))
        own = req.cached.get(c.name, 0)
        for s in up:
            if s.name != c.name and req.cached.get(s.name, 0) > own:
                out.append(_candidate(view, req, costs, c, s))
    return out


def load_aware(view: View, req: RoutingRequest, costs: RouteCosts) -> Decision:
    cands = candidates(view, req, costs)
    if not cands:
        raise NoCapacity("no cluster has prefill instances")
    rule_cluster, rule_why = None, ""
    if view.by_kind("pd", "prefill") and view.by_kind("prfaas", "prefill"):
        paper = prfaas(view, req, cache_aware=True)
        rule_cluster, rule_why = paper.prefill_cluster, paper.reason

    def order(c: Candidate) -> tuple[float, bool, int, str, bool, str]:
        # Rounded so that equal predictions reached by different float paths tie.
        return (
            round(c.ttft_s, 9),
            c.cluster != rule_cluster,
            c.wan_bytes,
            c.cluster,
            c.move is not None,
            c.move.src_cluster if c.move else "",
        )

    best = min(cands, key=order)
    by_name = {c.name: c for c in view.clusters}
    if rule_cluster is None:
        pick, why = best, f"load-aware: only {by_name[best.cluster].kind} prefill is up: {best.text()}"
    else:
        rule = min((c for c in cands if c.cluster == rule_cluster), key=order)
        gain = rule.ttft_s - best.ttft_s
        margin = costs.min_gain_s
        if best is rule:
            pick, why = rule, f"load-aware: rule ({rule_why}) and fastest: {rule.text()}"
        elif gain <= margin:
            pick, why = (
                rule,
                (f"load-aware: rule ({rule_why}): {rule.text()}; {best.text()} gains {gain:.2f} s <= {margin:.2f} s"),
            )
        else:
            pick, why = (
                best,
                (
                    f"load-aware: {best.text()} beats the rule ({rule_why}): {rule.text()} "
                    f"by {gain:.2f} s > {margin:.2f} s"
                ),
            )
    return build_decision(view, req, by_name[pick.cluster], why, True, cached=pick.cached, move=pick.move)


def router_policy(sc: Scenario, intra: LinkProfile, inter: LinkProfile) -> Policy:
    """The policy a scenario names, with the load-aware costs bound when it asks for them."""
    pol = sc.policy
    match pol.cache_routing:
        case "paper":
            return get_policy(pol.name, pol.cache_aware)
        case "load-aware":
            pass
        case _:
            unknown_kind("cache routing", pol.cache_routing)
    costs = RouteCosts.for_scenario(sc, intra, inter)

    def decide(view: View, req: RoutingRequest) -> Decision:
        return load_aware(view, req, costs)

    decide.__name__ = "prfaas+load-aware"
    return decide
