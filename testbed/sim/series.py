"""Time series of a simulated run, in the format live services write (`timeseries/<source>.jsonl`,
`{"ts", "source", "metric", "value", "labels"}` per line; see `testbed.metrics.timeseries`).
The run's t0 is 0: `ts` is wire seconds since the start (paper seconds / speedup)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Iterable

Sample = tuple[str, float, dict[str, str]]   # metric, value, labels


class SeriesFile:
    __slots__ = ("source", "_fh", "_head", "speedup", "lines", "_labels")

    def __init__(self, path: Path, source: str, speedup: float, repeated_labels: bool = True) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.source = source
        self._fh: IO[str] = path.open("w")
        self._head = f', "source": {json.dumps(source)}, "metric": '
        self.speedup = speedup
        self.lines = 0
        # Samples repeat the same few label sets: encode each once (not for one-off labels).
        self._labels: dict[tuple[tuple[str, str], ...], str] | None = {} if repeated_labels else None

    def write(self, t_paper: float, samples: Iterable[Sample]) -> None:
        self._write(f'{{"ts": {t_paper / self.speedup:.6f}{self._head}', samples)

    def source_write(self, t_paper: float, source: str, samples: Iterable[Sample]) -> None:
        """Samples of another source into this file (a file may hold many sources)."""
        self._write(f'{{"ts": {t_paper / self.speedup:.6f}, "source": {json.dumps(source)}, "metric": ', samples)

    def _write(self, ts: str, samples: Iterable[Sample]) -> None:
        out = []
        cache = self._labels
        for metric, value, labels in samples:
            if not labels:
                lab = "{}"
            elif cache is None:
                lab = json.dumps(labels)
            else:
                key = tuple(labels.items())
                known = cache.get(key)
                if known is None:
                    known = cache[key] = json.dumps(labels)
                lab = known
            out.append(f'{ts}"{metric}", "value": {float(value)!r}, "labels": {lab}}}\n')
        self._fh.write("".join(out))
        self.lines += len(out)

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
