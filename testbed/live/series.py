"""Periodic time-series sampling of a live service into its `SeriesWriter`
(the line format: `testbed.metrics.series_format`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from testbed.metrics.series_format import Sample, SeriesWriter

log = logging.getLogger("testbed.series")


async def sample_forever(writer: SeriesWriter, collect: Callable[[], Iterable[Sample]], interval: float) -> None:
    """Sample `collect` every `interval` wire seconds until cancelled."""
    unwritten: str | None = None  # the write error last reported (a full disk: once)
    while True:
        try:
            samples = list(collect())
        except Exception:  # a failing probe must not take the node down
            log.exception("sampling %s failed", writer.source)
        else:
            try:
                writer.write(samples)
                unwritten = None
            except OSError as e:
                if str(e) != unwritten:
                    log.error("samples of %s not written: %s", writer.source, e)
                unwritten = str(e)
        await asyncio.sleep(interval)
