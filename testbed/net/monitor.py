"""Link monitors: byte and packet counters of shaped interfaces, sampled into the run's series.

Counters are read over netlink from inside the WAN router's namespace; each sample is a
cumulative counter, so rates come from differences and a missed sample loses no bytes.
The sampler is a thread of its own: pyroute2's synchronous API runs an event loop of its own
and cannot share a thread with asyncio, and a thread keeps the sampling period steady when
the main loop is busy.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from pyroute2 import NetNS  # type: ignore[import-untyped]

from testbed.metrics.series_format import Sample, SeriesWriter

log = logging.getLogger("testbed.monitor")


@dataclass(frozen=True)
class WatchedLink:
    ifname: str  # interface in the monitored namespace
    link: str  # label, e.g. "dc-remote->dc-local"
    direction: str = "tx"  # count what leaves through the interface


def read_counters(ns: Any, links: list[WatchedLink]) -> list[Sample]:
    by_name = {lk.ifname: lk for lk in links}
    out: list[Sample] = []
    for msg in ns.get_links():
        name = msg.get_attr("IFLA_IFNAME")
        lk = by_name.get(name)
        if lk is None:
            continue
        st = msg.get_attr("IFLA_STATS64")
        labels = {"link": lk.link, "ifname": name}
        d = lk.direction
        out += [
            Sample("link_bytes", float(st[f"{d}_bytes"]), labels),
            Sample("link_packets", float(st[f"{d}_packets"]), labels),
            Sample("link_dropped", float(st[f"{d}_dropped"]), labels),
        ]
    return out


class LinkMonitor:
    """Samples `links` in `netns` every `interval` seconds into `writer` until `stop()`."""

    def __init__(self, netns: str, links: list[WatchedLink], writer: SeriesWriter, interval: float) -> None:
        self.netns = netns
        self.links = links
        self.writer = writer
        self.interval = interval
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"monitor-{netns}", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            ns = NetNS(self.netns)
        except BaseException as e:  # reported to start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            nxt = time.monotonic()
            unwritten: str | None = None  # the write error last reported (a full disk: once)
            while not self._stop.is_set():
                try:
                    # Stamp at the read, not at the write: a thread descheduled in between would
                    # otherwise fold one window's bytes into the next.
                    ts = time.time()
                    counters = read_counters(ns, self.links)
                except Exception:  # a failed read must not end the run; the next one recovers
                    log.exception("reading link counters in %s failed", self.netns)
                else:
                    try:
                        self.writer.write(counters, ts=ts)
                        unwritten = None
                    except OSError as e:
                        # The run directory's disk is full (or gone): one line, not a traceback
                        # every sample; the run reports the files it could not write.
                        if str(e) != unwritten:
                            log.error("link counters of %s not written: %s", self.netns, e)
                        unwritten = str(e)
                nxt += self.interval
                self._stop.wait(max(nxt - time.monotonic(), 0.0))
        finally:
            ns.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
