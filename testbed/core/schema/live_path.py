"""What the live path costs a request beyond the modelled prefill, KV transfer and decode steps
(I/O-free: a parameter set the simulator applies, measured per host by `testbed bench
live-path`).

The emulator's services talk HTTP and run on asyncio timers: the client's request reaches the
router and is routed, the router asks the decode and prefill nodes, each token travels back
through the router to the client, and on a busy host a decode step now and then ends late
(the live batch loop keeps absolute deadlines, so lateness is lost only when the loop stalls
for a whole step; `testbed.core.engine.decode_loop`). These costs are wire seconds: they belong to the
host and its load, not to the scenario, so a run at speedup s pays s times as much paper time.
With them the simulator predicts an emulated run on the same host, not only the model.

- `routing_s`: the client sent the request -> the router decided (HTTP in, parse, route);
- `dispatch_s`: the router decided -> the prefill node queued it (two HTTP calls; a prefill
  node in another datacenter adds the WAN's delay, which the simulator models itself);
- `relay_s`: the decode node produced the first token -> the client has it (two hops);
- `relay_last_s`: the same for the last token. Measured apart: the first token's relay carries
  the stream's set-up and its tail, the last's the steady stream's, and a request's TPOT (last
  minus first over the tokens between) feels their difference, so drawing both from one pooled
  distribution gives short outputs a TPOT tail the emulator does not have. A figures file
  without it takes `relay_s`'s (files written before it was measured apart);
- `stall_rate_per_s`, `stall_s`: decode batch loop stalls (a step that ended more than a
  whole step late): how many per wire second of decoding on one instance, and the mean time
  each loses; every step of the instance's batch is that much later;
- `restart_s`: a restarted service answers its health check this long after it was started.

The first four are means; `quantiles` may hold each one's distribution (equally spaced
quantiles from 0 to 1), from which the simulator draws per request: a busy host's costs have
long tails, and a P90 TTFT feels them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

DRAWN = ("routing_s", "dispatch_s", "relay_s", "relay_last_s")


@dataclass(frozen=True)
class LivePathCosts:
    routing_s: float = 0.0
    dispatch_s: float = 0.0
    relay_s: float = 0.0
    relay_last_s: float = 0.0
    stall_rate_per_s: float = 0.0
    stall_s: float = 0.0
    restart_s: float = 0.0
    quantiles: dict[str, tuple[float, ...]] = field(default_factory=dict)
    source: str = "none"  # where they came from: "none", a file, "scenario"

    @property
    def any(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self) if f.name not in ("source", "quantiles"))

    def draw(self, name: str, u: float) -> float:
        """Cost `name` at probability `u` of its distribution (its mean without one)."""
        q = self.quantiles.get(name)
        if not q:
            return float(getattr(self, name))
        x = u * (len(q) - 1)
        i = min(int(x), len(q) - 2)
        return q[i] + (q[i + 1] - q[i]) * (x - i)

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["quantiles"] = {k: list(v) for k, v in self.quantiles.items()}
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, object], source: str) -> LivePathCosts:
        """Strict: every figure a finite number >= 0, each distribution increasing (`ValueError`
        naming the field)."""
        known = [f.name for f in fields(cls) if f.name not in ("source", "quantiles")]  # checked in this order
        extra = sorted(set(d) - set(known) - {"source", "quantiles", "host", "measured", "runs", "backend", "scenario"})
        if extra:
            raise ValueError(f"unknown field {extra[0]!r} (known: {', '.join(sorted(known))})")
        if "relay_last_s" not in d and "relay_s" in d:
            d = {**d, "relay_last_s": d["relay_s"]}
            qs0 = d.get("quantiles")
            if isinstance(qs0, dict) and "relay_s" in qs0 and "relay_last_s" not in qs0:
                d["quantiles"] = {**qs0, "relay_last_s": qs0["relay_s"]}
        vals: dict[str, float] = {}
        for k in known:
            v = d.get(k, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or math.isinf(v):
                raise ValueError(f"field {k!r}: {v!r} is not a number >= 0")
            vals[k] = float(v)
        qs = d.get("quantiles") or {}
        if not isinstance(qs, dict):
            raise ValueError("field 'quantiles': not an object")
        out: dict[str, tuple[float, ...]] = {}
        for k, q in qs.items():
            if k not in DRAWN:
                raise ValueError(f"field 'quantiles.{k}': only {', '.join(DRAWN)} have distributions")
            if (
                not isinstance(q, list)
                or len(q) < 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < math.inf for x in q)
                or any(b < a for a, b in zip(q, q[1:]))
            ):
                raise ValueError(f"field 'quantiles.{k}': not an increasing list of at least 2 numbers >= 0")
            out[k] = tuple(float(x) for x in q)
        return cls(**vals, quantiles=out, source=source)


def quantiles(xs: list[float], n: int = 21) -> tuple[float, ...]:
    """`n` equally spaced quantiles (0 to 1) of `xs`, linearly interpolated."""
    s = sorted(xs)
    if not s:
        return ()
    out = []
    for j in range(n):
        x = j / (n - 1) * (len(s) - 1)
        i = min(int(x), len(s) - 2) if len(s) > 1 else 0
        out.append(s[i] + (s[i + 1] - s[i]) * (x - i) if len(s) > 1 else s[0])
    return tuple(out)


__all__ = ["DRAWN", "LivePathCosts", "quantiles"]
