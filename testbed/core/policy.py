"""Routing policies: pure `decide(view, request) -> Decision`, registered by name.

The router (live or simulated) builds a `View` of cluster load; a policy picks the prefill
cluster, then the least-loaded instance there and the least-loaded decode instance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

from testbed.core.scenario import Scenario


@dataclass(frozen=True)
class InstanceLoad:
    node_id: str
    backlog: float = 0.0     # prefill: modelled work queued (s); decode: unused
    active: int = 0          # requests assigned and not finished


@dataclass(frozen=True)
class ClusterView:
    name: str
    kind: str                # prfaas | pd
    datacenter: str
    prefill: tuple[InstanceLoad, ...] = ()
    decode: tuple[InstanceLoad, ...] = ()


@dataclass(frozen=True)
class View:
    clusters: tuple[ClusterView, ...]
    threshold: float | None = None
    now: float = 0.0

    def by_kind(self, kind: str, role: str) -> list[ClusterView]:
        return [c for c in self.clusters if c.kind == kind and getattr(c, role)]


@dataclass(frozen=True)
class RoutingRequest:
    request_id: str
    input_tokens: int
    cached: Mapping[str, int] = field(default_factory=dict)   # cluster -> cached prefix tokens


@dataclass(frozen=True)
class Decision:
    prefill_cluster: str
    prefill_node: str
    decode_cluster: str
    decode_node: str
    cached_tokens: int
    incremental_tokens: int
    crossed_wan: bool
    threshold: float | None
    reason: str


class NoCapacity(RuntimeError):
    """No instance can take the request (e.g. a cluster with zero instances)."""


Policy = Callable[[View, RoutingRequest], Decision]


def least_loaded_prefill(c: ClusterView) -> InstanceLoad:
    return min(c.prefill, key=lambda i: (i.backlog, i.active, i.node_id))


def least_loaded_decode(c: ClusterView) -> InstanceLoad:
    return min(c.decode, key=lambda i: (i.active, i.node_id))


def _decision(view: View, req: RoutingRequest, prefill: ClusterView, reason: str) -> Decision:
    decode_clusters = view.by_kind("pd", "decode")
    if not decode_clusters:
        raise NoCapacity("no pd cluster with decode instances")
    # Prefer decode in the prefill cluster's datacenter; PrfaaS clusters have none, so KV crosses.
    same_dc = [c for c in decode_clusters if c.datacenter == prefill.datacenter]
    dc = min(same_dc or decode_clusters, key=lambda c: min(i.active for i in c.decode))
    dnode = least_loaded_decode(dc)
    pnode = least_loaded_prefill(prefill)
    cached = req.cached.get(prefill.name, 0)
    return Decision(
        prefill_cluster=prefill.name,
        prefill_node=pnode.node_id,
        decode_cluster=dc.name,
        decode_node=dnode.node_id,
        cached_tokens=cached,
        incremental_tokens=max(req.input_tokens - cached, 0),
        crossed_wan=prefill.datacenter != dc.datacenter,
        threshold=view.threshold,
        reason=reason,
    )


def _pick(clusters: list[ClusterView]) -> ClusterView:
    if not clusters:
        raise NoCapacity("no cluster of the needed kind has prefill instances")
    return min(clusters, key=lambda c: min(i.backlog for i in c.prefill))


def homogeneous(view: View, req: RoutingRequest) -> Decision:
    """Baseline: every prefill on the local PD cluster's prefill instances."""
    return _decision(view, req, _pick(view.by_kind("pd", "prefill")), "homogeneous")


def naive(view: View, req: RoutingRequest) -> Decision:
    """Baseline: every prefill in the PrfaaS cluster, whatever its length."""
    return _decision(view, req, _pick(view.by_kind("prfaas", "prefill")), "naive: all to prfaas")


def prfaas(view: View, req: RoutingRequest) -> Decision:
    """Selective offload: incremental (uncached) length l > t goes to PrfaaS, else PD-P.
    The incremental length is judged against the PD cluster's own cache (bandwidth-scarce rule;
    with no cache information both are the full input length)."""
    t = view.threshold if view.threshold is not None else math.inf
    pd = _pick(view.by_kind("pd", "prefill"))
    l_inc = req.input_tokens - req.cached.get(pd.name, 0)
    if l_inc > t:
        return _decision(view, req, _pick(view.by_kind("prfaas", "prefill")), f"l={l_inc} > t={t:g}")
    return _decision(view, req, pd, f"l={l_inc} <= t={t:g}")


POLICIES: dict[str, Policy] = {"homogeneous": homogeneous, "naive": naive, "prfaas": prfaas}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None


class LoadTracker:
    """Router-side load book-keeping: what it assigned and what has finished. The router sees
    every assignment, so this is exact without polling nodes."""

    def __init__(self, sc: Scenario) -> None:
        self._clusters = sc.clusters
        self.prefill_backlog: dict[str, float] = {}
        self.active: dict[str, int] = {}
        for c in sc.clusters:
            for i in range(c.prefill):
                self.prefill_backlog[f"{c.name}-p{i}"] = 0.0
                self.active[f"{c.name}-p{i}"] = 0
            for i in range(c.decode):
                self.active[f"{c.name}-d{i}"] = 0

    def view(self, threshold: float | None, now: float = 0.0, down: frozenset[str] = frozenset()) -> View:
        cvs = []
        for c in self._clusters:
            p = tuple(
                InstanceLoad(f"{c.name}-p{i}", self.prefill_backlog[f"{c.name}-p{i}"], self.active[f"{c.name}-p{i}"])
                for i in range(c.prefill)
                if f"{c.name}-p{i}" not in down
            )
            d = tuple(
                InstanceLoad(f"{c.name}-d{i}", 0.0, self.active[f"{c.name}-d{i}"])
                for i in range(c.decode)
                if f"{c.name}-d{i}" not in down
            )
            cvs.append(ClusterView(c.name, c.kind, c.datacenter, p, d))
        return View(tuple(cvs), threshold, now)

    def assign(self, d: Decision, prefill_work: float) -> None:
        self.prefill_backlog[d.prefill_node] += prefill_work
        self.active[d.prefill_node] += 1
        self.active[d.decode_node] += 1

    def prefill_done(self, d: Decision, prefill_work: float) -> None:
        self.prefill_backlog[d.prefill_node] = max(self.prefill_backlog[d.prefill_node] - prefill_work, 0.0)
        self.active[d.prefill_node] -= 1

    def decode_done(self, d: Decision) -> None:
        self.active[d.decode_node] -= 1
