"""Which prefill instance of the chosen cluster takes a prompt (`policy.placement`), and what it
finds cached there (`clusters[].cache_scope`), I/O-free.

A policy picks the prefill cluster; the router's view lists its least-loaded instance, and with
one pool per cluster every instance finds the same cached prefix, so that instance is the
placement (`least_loaded`). Two things change that:

- `cache_scope: instance`: each prefill instance keeps its own pool, so the cached prefix is the
  chosen instance's, not the cluster's best (the policy judged the cluster by its best);
- `placement: kv_overlap`: the instance is the one of least cost by Dynamo's KV router (its
  defaults as of ai-dynamo 1.6: overlap credit 1, prefill load scale 1, temperature 0), in
  blocks of the model's `block_tokens`:

      cost = w * (tokens in flight there + prompt tokens - tokens cached there) / block
             + blocks in flight there + the prompt's blocks

  "In flight" is what the router booked on the instance and has not seen finish: the uncached
  tokens of its prefills (Dynamo's active prefill tokens) and their prompts' blocks (its active
  blocks; each prompt's blocks counted whole, where Dynamo counts blocks shared among active
  prompts once, where the prompts have block hashes; `LoadTracker`), and "the prompt's blocks"
  are those none of them holds, as Dynamo counts new blocks. `w` is `policy.kv_overlap_weight`
  (Dynamo's overlap score weight). Dynamo breaks ties at random; here they go by the least-loaded
  order (backlog, assigned, name), so the live router and the simulator place alike.

With its own pool, an instance also finds what prompts in flight on it will have computed by the
time this one starts: full blocks of theirs that extend the prefix its pool holds count as cached
there, and the prefill waits for the prompt computing the last of them (`Decision.prefix_after`),
as an engine's waiting queue finds the prefix its running prompts computed. That holds where any
cached block is reusable (a model of full attention alone); a hybrid model reuses a prefix only
where a linear state was kept, so there only the pool counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from testbed.core.routing.policy import Decision
from testbed.core.schema.scenario import Scenario


class PrefillLoad(NamedTuple):
    """One prefill instance as placement sees it (`LoadTracker.prefill_loads`)."""

    node_id: str
    backlog: float  # modelled work queued (the tracker's unit)
    active: int  # prompts assigned and not answered
    inflight_tokens: int  # their uncached tokens
    inflight_blocks: int  # their prompts' blocks (a block shared among them once)
    new_blocks: int = -1  # the prompt's blocks none of them holds (-1: all of the prompt's)


def kv_overlap_cost(weight: float, block: int, input_tokens: int, cached: int, load: PrefillLoad) -> float:
    """Dynamo's KV router cost of putting a prompt on an instance (blocks; lower is better)."""
    prefill = max(load.inflight_tokens + input_tokens - cached, 0) / block
    new = load.new_blocks if load.new_blocks >= 0 else -(-input_tokens // block)
    return weight * prefill + load.inflight_blocks + new


@dataclass(frozen=True)
class Placement:
    """The placement rule of a deployment: `kv_overlap` (else least-loaded), the clusters
    whose prefill instances keep their own pools, and whether an instance's prompts in flight
    count towards its cached prefix (`in_flight`: a model whose every cached block is reusable)."""

    kv_overlap: bool
    weight: float
    block: int
    instance_scoped: frozenset[str]
    in_flight: bool = False

    def applies(self, d: Decision) -> bool:
        """Whether `place` can change the decision (default deployments skip it)."""
        return self.kv_overlap or d.prefill_cluster in self.instance_scoped or d.decode_cluster in self.instance_scoped

    def place(
        self,
        d: Decision,
        input_tokens: int,
        loads: Sequence[PrefillLoad],
        cached_at: Mapping[str, int],
        after: Mapping[str, str] | None = None,
    ) -> Decision:
        """`d` with its prefill instance and cached prefix as this rule has them. `loads`: the
        prefill cluster's instances in service; `cached_at`: the prefix each instance's own pool
        holds (instance-scoped clusters only), with what its prompts in flight compute; `after`:
        for an instance where those extend it, the request the prefill then waits for."""
        own = d.prefill_cluster in self.instance_scoped
        mv = d.cache_move
        node, why = d.prefill_node, ""

        def cached(n: str) -> int:
            if mv is not None or not own:
                return d.cached_tokens  # a moved prefix lands wherever the prompt goes
            return cached_at.get(n, 0)

        if self.kv_overlap and loads:
            best = min(
                loads,
                key=lambda x: (
                    kv_overlap_cost(self.weight, self.block, input_tokens, cached(x.node_id), x),
                    x.backlog,
                    x.active,
                    x.node_id,
                ),
            )
            node = best.node_id
            cost = kv_overlap_cost(self.weight, self.block, input_tokens, cached(node), best)
            why = f"; kv_overlap {node}: {cost:.1f} blocks"
        use = cached(node)
        if own:
            why += f"; {node}'s own cache {use}"
        if mv is not None and own:
            mv = mv._replace(from_tokens=min(cached_at.get(node, 0), mv.tokens))
        # Decode instances read no prefill instance's pool: with instance scope they hold nothing.
        dec = 0 if d.decode_cluster in self.instance_scoped else d.decode_cached_tokens
        wait = (after or {}).get(node, "") if own and mv is None else ""
        if wait:
            why += f" once {wait}'s prefill ends"
        return d._replace(
            prefix_after=wait,
            prefill_node=node,
            cached_tokens=use,
            incremental_tokens=max(input_tokens - use, 0),
            decode_cached_tokens=dec,
            reason=d.reason + why,
            cache_move=mv,
        )

    def move_source(self, loads: Sequence[PrefillLoad], cached_at: Mapping[str, int]) -> str:
        """The instance of an instance-scoped source cluster that sends a moved prefix: the one
        holding the longest, then the least loaded."""
        best = min(loads, key=lambda x: (-cached_at.get(x.node_id, 0), x.backlog, x.active, x.node_id))
        return best.node_id


def placement_for(sc: Scenario) -> Placement | None:
    """The scenario's placement rule; None for least-loaded over cluster-wide pools (nothing to do)."""
    pol = sc.policy
    own = frozenset(c.name for c in sc.clusters if c.cache_scope == "instance")
    if pol.placement == "least_loaded" and not own:
        return None
    return Placement(pol.placement == "kv_overlap", pol.kv_overlap_weight, sc.model.block_tokens, own, _blockwise(sc))


def _blockwise(sc: Scenario) -> bool:
    """Any cached block is reusable: a model with no linear state (full attention alone)."""
    return sc.model.linear_state_bytes == 0 and sc.model.window_bytes_per_token == 0


def reads_held_blocks(sc: Scenario) -> bool:
    """Whether placement reads which blocks the prompts in flight on an instance hold: for
    `kv_overlap`'s counts, or for instance pools that count what those prompts compute."""
    own = any(c.cache_scope == "instance" for c in sc.clusters)
    return sc.policy.placement == "kv_overlap" or (own and _blockwise(sc))
