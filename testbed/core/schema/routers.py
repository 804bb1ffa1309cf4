"""Foreign PD routers that can stand in the router's place (`router.kind`), their policies, and
the ones refused before anything starts with the reason (a policy needing what the mock nodes
do not provide would run degraded and look like a result)."""

from __future__ import annotations

# kind -> (the node protocol it speaks, its policies; both routers default to cache_aware)
ROUTERS: dict[str, tuple[str, frozenset[str]]] = {
    "vllm-router": (
        "vllm",
        frozenset(
            {
                "random",
                "round_robin",
                "cache_aware",
                "kv_aware",
                "power_of_two",
                "consistent_hash",
                "sticky_least_loaded",
            }
        ),
    ),
    "sglang-router": (
        "sglang",
        frozenset({"random", "round_robin", "cache_aware", "power_of_two", "manual", "bucket"}),
    ),
}
# Policies a router has but that cannot run faithfully on the mock nodes, with why.
REFUSED: dict[tuple[str, str], str] = {
    ("vllm-router", "kv_aware"): (
        "it routes on vLLM's KV-cache events (ZMQ, --kv-event-source), which the mock nodes do not "
        "publish: without them vllm-router 0.1.17 starts and routes with an empty index"
    ),
}
# Policies valid only for one side of a PD router.
PREFILL_ONLY: dict[str, frozenset[str]] = {"sglang-router": frozenset({"bucket"})}


def policy_refusal(kind: str, side: str, policy: str) -> str | None:
    """Why `policy` cannot be `kind`'s `side` policy here (side: policy, prefill_policy,
    decode_policy), or None."""
    _, known = ROUTERS[kind]
    if policy not in known:
        return f"{kind} has no policy {policy!r}; its policies: {', '.join(sorted(known))}"
    if policy in PREFILL_ONLY.get(kind, frozenset()) and side != "prefill_policy":
        return f"{kind}'s {policy!r} policy is for the prefill side only (router.prefill_policy)"
    if (why := REFUSED.get((kind, policy))) is not None:
        return f"{kind} policy {policy!r} is refused: {why}"
    return None
