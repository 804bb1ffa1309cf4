"""The columns of a batch of decision lines (decisions.parquet's `ts`, `source`, `metric`, `value`
and its labels' keys and values), made in one pass over the samples as held; compiled where built
(`testbed.compiled`): a million-request run holds a million decisions of seven labels each. Pure
Python: the Arrow arrays are the caller's (`testbed.metrics.columnar`)."""

from __future__ import annotations

import math
from typing import Any

_INF = math.inf


class DecisionColumns:
    """A batch's values column by column; `counts`: each line's number of labels."""

    __slots__ = ("ts", "sources", "metrics", "values", "counts", "keys", "texts")

    def __init__(self) -> None:
        self.ts: list[float] = []
        self.sources: list[str] = []
        self.metrics: list[str] = []
        self.values: list[float] = []
        self.counts: list[int] = []
        self.keys: list[str] = []
        self.texts: list[str] = []


def decision_columns(held: list[Any], speedup: float) -> DecisionColumns:
    """`held`: (paper time, source, samples) as written; each sample (metric, value, labels).
    Times as wire seconds rounded to the microsecond, values as floats (infinite ones NaN:
    decisions.jsonl writes them null, read back as NaN), labels as text."""
    out = DecisionColumns()
    ts, sources, metrics, values = out.ts, out.sources, out.metrics, out.values
    counts, keys, texts = out.counts, out.keys, out.texts
    for entry in held:
        t = round(float(entry[0]) / speedup, 6)
        source: Any = entry[1]
        samples: Any = entry[2]
        for sample in samples:
            metric: Any = sample[0]
            v = float(sample[1])
            lab: Any = sample[2]
            ts.append(t)
            sources.append(source)
            metrics.append(metric)
            values.append(v if -_INF < v < _INF else math.nan)
            counts.append(len(lab))
            for k, x in lab.items():
                keys.append(k if type(k) is str else str(k))
                texts.append(x if type(x) is str else str(x))
    return out
