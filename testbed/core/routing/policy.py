"""Routing policies: pure `decide(view, request) -> Decision`, registered by name.

The router (live or simulated) builds a `View` of cluster load and the WAN's state, and looks
up each cluster's usable cached prefix; a policy picks the prefill cluster (and any cache move),
then the least-loaded instance there and the least-loaded decode instance. Prefix caches are
cluster-wide pools, so every instance of a cluster reaches the same cached prefix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Literal, NamedTuple, get_args

from testbed.core.routing.no_capacity import NoCapacity as NoCapacity
from testbed.core.schema.kinds import unknown_kind
from testbed.core.schema.scenario import PolicyName

# What routing builds per request is immutable: named tuples rather than frozen dataclasses,
# whose constructor sets each field through object.__setattr__ (a request's view and decision
# cost 5 us that way, 1 us as tuples).


class InstanceLoad(NamedTuple):
    node_id: str
    backlog: float = 0.0  # prefill: modelled work queued (s); decode: unused
    active: int = 0  # requests assigned and not finished


class ClusterView(NamedTuple):
    name: str
    kind: str  # prfaas | pd
    datacenter: str
    prefill: tuple[InstanceLoad, ...] = ()
    decode: tuple[InstanceLoad, ...] = ()


BandwidthState = Literal["scarce", "abundant"]


class View(NamedTuple):
    clusters: tuple[ClusterView, ...]
    threshold: float | None = None
    now: float = 0.0
    # WAN state for the cache-aware rules (docs/paper.md section 3.4): judged by the router's link
    # monitor; "scarce" when nothing measures it.
    bandwidth: BandwidthState = "scarce"
    # The link monitor's estimate of what the inter-DC link gives (paper bit/s); None when
    # nothing measures it (load-aware routing then takes the link's configured rate).
    bandwidth_bps: float | None = None
    # Paper seconds per unit of the instances' backlog (the driver's speedup: the live router
    # books wire seconds, the simulator paper seconds).
    backlog_scale: float = 1.0

    def by_kind(self, kind: str, role: str) -> list[ClusterView]:
        # Each request asks this about three times: the roles by name rather than getattr.
        if role == "prefill":
            return [c for c in self.clusters if c.kind == kind and c.prefill]
        if role == "decode":
            return [c for c in self.clusters if c.kind == kind and c.decode]
        return [c for c in self.clusters if c.kind == kind and getattr(c, role)]


_NOTHING_CACHED: Mapping[str, int] = MappingProxyType({})


class RoutingRequest(NamedTuple):
    request_id: str
    input_tokens: int
    cached: Mapping[str, int] = _NOTHING_CACHED  # cluster -> usable cached prefix tokens


class CacheMove(NamedTuple):
    """Copy a cached prefix between clusters before the prefill: the destination holds
    `from_tokens` of it already, so only the KV of the tokens in between (and the linear state
    at `tokens`) crosses."""

    src_cluster: str
    dst_cluster: str
    tokens: int
    from_tokens: int


class Decision(NamedTuple):
    prefill_cluster: str
    prefill_node: str
    decode_cluster: str
    decode_node: str
    cached_tokens: int  # prefix the prefill reuses (after any cache move)
    incremental_tokens: int  # what the prefill computes
    crossed_wan: bool
    threshold: float | None
    reason: str
    decode_cached_tokens: int = 0  # prefix the decode cluster holds: KV below it is not shipped
    cache_move: CacheMove | None = None
    # A request in flight on the prefill instance whose prompt computes the end of `cached_tokens`:
    # the prefill starts once that one's has ended ("" when the pool holds it all already).
    prefix_after: str = ""


Policy = Callable[[View, RoutingRequest], Decision]


# A router's view lists one instance per role (`LoadTracker.view`): that one is the least loaded.


def least_loaded_prefill(c: ClusterView) -> InstanceLoad:
    if len(c.prefill) == 1:
        return c.prefill[0]
    return min(c.prefill, key=lambda i: (i.backlog, i.active, i.node_id))


def least_loaded_decode(c: ClusterView) -> InstanceLoad:
    if len(c.decode) == 1:
        return c.decode[0]
    return min(c.decode, key=lambda i: (i.active, i.node_id))


def decode_cluster_for(view: View, prefill: ClusterView) -> ClusterView:
    decode_clusters = view.by_kind("pd", "decode")
    if not decode_clusters:
        raise NoCapacity("no pd cluster with decode instances")
    # Prefer decode in the prefill cluster's datacenter; PrfaaS clusters have none, so KV crosses.
    same_dc = [c for c in decode_clusters if c.datacenter == prefill.datacenter]
    among = same_dc or decode_clusters
    if len(among) == 1:
        return among[0]
    return min(among, key=lambda c: min(i.active for i in c.decode))


def build_decision(
    view: View,
    req: RoutingRequest,
    prefill: ClusterView,
    reason: str,
    cache_aware: bool = False,
    cached: int | None = None,
    move: CacheMove | None = None,
) -> Decision:
    dc = decode_cluster_for(view, prefill)
    dnode = least_loaded_decode(dc)
    pnode = least_loaded_prefill(prefill)
    use = req.cached.get(prefill.name, 0) if cached is None else cached
    # The decode side loads what its own cluster's pool holds (a prefix moved in lands there too);
    # without cache awareness the sender cannot know that, and ships the whole prompt's KV.
    dec_cached = use if dc.name == prefill.name else req.cached.get(dc.name, 0)
    return Decision(
        prefill_cluster=prefill.name,
        prefill_node=pnode.node_id,
        decode_cluster=dc.name,
        decode_node=dnode.node_id,
        cached_tokens=use,
        incremental_tokens=max(req.input_tokens - use, 0),
        crossed_wan=prefill.datacenter != dc.datacenter,
        threshold=view.threshold,
        reason=reason,
        decode_cached_tokens=dec_cached if cache_aware else 0,
        cache_move=move,
    )


def _pick(clusters: list[ClusterView]) -> ClusterView:
    if not clusters:
        raise NoCapacity("no cluster of the needed kind has prefill instances")
    if len(clusters) == 1:
        return clusters[0]
    return min(clusters, key=lambda c: min(i.backlog for i in c.prefill))


def homogeneous(view: View, req: RoutingRequest, cache_aware: bool = False) -> Decision:
    """Baseline: every prefill on the local PD cluster's prefill instances."""
    return build_decision(view, req, _pick(view.by_kind("pd", "prefill")), "homogeneous", cache_aware)


def naive(view: View, req: RoutingRequest, cache_aware: bool = False) -> Decision:
    """Baseline: every prefill in the PrfaaS cluster, whatever its length."""
    pfs = view.by_kind("prfaas", "prefill")
    if not pfs and view.by_kind("pd", "prefill"):
        return build_decision(
            view, req, _pick(view.by_kind("pd", "prefill")), "naive: no prfaas prefill is up", cache_aware
        )
    return build_decision(view, req, _pick(pfs), "naive: all to prfaas", cache_aware)


def prfaas(view: View, req: RoutingRequest, cache_aware: bool = False) -> Decision:
    """Selective offload on the incremental length against the threshold t.

    Length-only (cache_aware False): l is the whole prompt; each cluster still reuses its own
    cached prefix, but routing ignores where caches are and the KV ships whole.
    Cache-aware, the paper's rules (section 3.4), with l_pd / l_prfaas the cached prefixes:
    - bandwidth scarce: each cluster's cache judged alone: l_total - l_pd <= t -> PD-P, else
      PrfaaS (reusing its own l_prfaas); no cache crosses;
    - bandwidth abundant: l_prefix = max(l_prfaas, l_pd); l_total - l_prefix <= t -> PD-P, else
      PrfaaS; the longer prefix moves to the chosen cluster when it sits in the other one.
    Either way only the KV the decode cluster lacks crosses."""
    t = view.threshold if view.threshold is not None else math.inf
    total = req.input_tokens
    pds, pfs = view.by_kind("pd", "prefill"), view.by_kind("prfaas", "prefill")
    if not pds or not pfs:
        # One side has no instance up (killed, or cut off by a WAN outage): the other side takes
        # every prefill until it is back, rather than the request failing for want of it.
        side = "pd" if pds else "prfaas"
        return build_decision(view, req, _pick(pds or pfs), f"only {side} prefill is up: l={total}", cache_aware)
    pd, pf = _pick(pds), _pick(pfs)
    if not cache_aware:
        if total > t:
            return build_decision(view, req, pf, f"l={total} > t={t:g}")
        return build_decision(view, req, pd, f"l={total} <= t={t:g}")
    l_pd, l_pf = req.cached.get(pd.name, 0), req.cached.get(pf.name, 0)
    match view.bandwidth:
        case "scarce":
            if total - l_pd <= t:
                return build_decision(view, req, pd, f"scarce: l-l_pd={total - l_pd} <= t={t:g}", True)
            return build_decision(view, req, pf, f"scarce: l-l_pd={total - l_pd} > t={t:g}", True)
        case "abundant":
            pass
        case _:
            unknown_kind("bandwidth state", view.bandwidth, get_args(BandwidthState))
    prefix = max(l_pd, l_pf)
    to_pd = total - prefix <= t
    dst, src, l_dst, l_src = (pd, pf, l_pd, l_pf) if to_pd else (pf, pd, l_pf, l_pd)
    op = "<=" if to_pd else ">"
    move = CacheMove(src.name, dst.name, l_src, l_dst) if l_src > l_dst else None
    why = f"abundant: l-l_prefix={total - prefix} {op} t={t:g}" + (
        f", move {l_src - l_dst} cached tokens {src.name}->{dst.name}" if move else ""
    )
    return build_decision(view, req, dst, why, True, cached=prefix, move=move)


def _decider(name: PolicyName) -> Callable[[View, RoutingRequest, bool], Decision]:
    match name:
        case "homogeneous":
            return homogeneous
        case "naive":
            return naive
        case "prfaas":
            return prfaas
        case _:
            unknown_kind("policy", name, sorted(get_args(PolicyName)))


def get_policy(name: PolicyName, cache_aware: bool = False) -> Policy:
    fn = _decider(name)

    def decide(view: View, req: RoutingRequest) -> Decision:
        return fn(view, req, cache_aware)

    decide.__name__ = f"{name}{'+cache' if cache_aware else ''}"
    return decide
