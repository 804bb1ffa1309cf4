"""Time-series sampling into the run directory: one JSONL file per source."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path
from typing import Callable, Iterable, TextIO

from testbed.live.clock import now

Sample = tuple[str, float, dict[str, str]]   # metric, value, labels
log = logging.getLogger("testbed.series")


class SeriesWriter:
    def __init__(self, path: Path | None, source: str) -> None:
        self.source = source
        self._lock = threading.Lock()   # link monitors write from a thread of their own
        self._fh: TextIO | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = path.open("a")

    def write(self, samples: Iterable[Sample], ts: float | None = None) -> None:
        if self._fh is None:
            return
        t = now() if ts is None else ts
        text = "".join(
            json.dumps({"ts": round(t, 6), "source": self.source, "metric": metric, "value": value, "labels": labels})
            + "\n"
            for metric, value, labels in samples
        )
        with self._lock:
            if self._fh is not None:
                self._fh.write(text)
                self._fh.flush()

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


async def sample_forever(writer: SeriesWriter, collect: Callable[[], Iterable[Sample]], interval: float) -> None:
    """Sample `collect` every `interval` wire seconds until cancelled."""
    while True:
        try:
            writer.write(collect())
        except Exception:  # a failing probe must not take the node down
            log.exception("sampling %s failed", writer.source)
        await asyncio.sleep(interval)
