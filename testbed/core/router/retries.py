"""A request's attempts as the router runs them (I/O-free): its deadline, whether a failed
attempt is tried again, and where the retry must not go. The live router
(`testbed.live.router.attempts`) and the simulator (`testbed.sim`) apply the same rules.

- Deadline: the whole request, retries included, has `Scenario.deadline_s` paper seconds, never
  less than `serving.deadline_floor_wire_s` of wire time (at the scenario's speedup).
- Retry: once, and only while the client has seen no token (tokens sent cannot be taken back),
  for a failure that allows it.
- Where: away from the instance to blame, or, with none named, from both the attempt used.
"""

from __future__ import annotations

from testbed.core.router.route_step import RoutePlan
from testbed.core.schema.scenario import Scenario

MAX_RETRIES = 1


def deadline_paper_s(sc: Scenario, output_tokens: int) -> float:
    """A request's time limit in paper seconds (wire seconds: divide by the speedup)."""
    return max(sc.deadline_s(output_tokens), sc.serving.deadline_floor_wire_s * sc.scale.speedup)


def deadline_reason(sc: Scenario, output_tokens: int) -> str:
    return f"deadline exceeded: no answer within {sc.deadline_s(output_tokens):.4g} s (paper)"


def may_retry(retryable: bool, tokens_sent: int, retries: int) -> bool:
    return retryable and not tokens_sent and retries < MAX_RETRIES


def avoid_after(blamed: str, plan: RoutePlan) -> frozenset[str]:
    """Where a retry should not go: the instance to blame, or both the attempt used."""
    return frozenset({blamed} if blamed else {plan.d.prefill_node, plan.d.decode_node})


def retry_id(rid: str, retries: int) -> str:
    """The id the nodes know an attempt by: a retry may land where the failed attempt is still
    being cleaned up."""
    return rid if not retries else f"{rid}~retry{retries}"
