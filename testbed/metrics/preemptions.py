"""`preemptions.csv`: each decode preemption by recompute (`testbed.core.engine.decode_blocks`),
written beside records.csv when a run had any: which request, on which decode instance, when it
was preempted, when it ran again, the recompute its rejoining step carried, and the tokens it held.
Wire seconds, as records.csv."""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from testbed.core.engine.decode_blocks import Preemption

PREEMPTIONS_CSV = "preemptions.csv"
FIELDS = ("request_id", "decode_node", "preempted_at", "resumed_at", "waited_s", "recompute_s", "tokens")


@dataclass(frozen=True)
class PreemptionRow:
    request_id: str
    decode_node: str
    preempted_at: float
    resumed_at: float  # NaN: it had not run again when the run ended
    recompute_s: float
    tokens: int

    @property
    def waited_s(self) -> float:
        return self.resumed_at - self.preempted_at


def write_preemptions(path: Path, events: Sequence[tuple[str, Preemption]], wire: Callable[[float], float]) -> None:
    """`events` (decode node, preemption) in the driver's time; `wire` converts it to wire seconds."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(FIELDS)
        for node, e in events:
            resumed = math.nan if e.resumed_at is None else wire(e.resumed_at)
            at = wire(e.at)
            w.writerow(
                [
                    e.request_id,
                    node,
                    f"{at:.6f}",
                    f"{resumed:.6f}",
                    f"{resumed - at:.6f}",
                    f"{wire(e.recompute_s):.6f}",
                    e.tokens,
                ]
            )


def read_preemptions(path: Path) -> list[PreemptionRow]:
    with path.open(newline="") as f:
        return [
            PreemptionRow(
                r["request_id"],
                r["decode_node"],
                float(r["preempted_at"]),
                float(r["resumed_at"]),
                float(r["recompute_s"]),
                int(r["tokens"]),
            )
            for r in csv.DictReader(f)
        ]
