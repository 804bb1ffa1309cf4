"""Prometheus pieces every service's `/metrics` shares: the labels vLLM puts on every series
(`model_name`, `engine`) and counters read at scrape time from a service's own monotonic ints
(prometheus_client's `Counter` can only be incremented, and these counts live in the services'
state where the I/O-free core keeps them)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# vLLM labels every series with the served model and the engine (its engine index; here the
# service: "router", or the node id).
LABELS = ("model_name", "engine")


class ScrapeTimeMetrics(Collector):
    """Counters (`NAME_total`) and gauges whose values are read from callables at each scrape,
    all with one service's labels."""

    def __init__(self, labels: dict[str, str]) -> None:
        self._labels = labels
        self._counters: list[tuple[str, str, Callable[[], float]]] = []
        self._gauges: list[tuple[str, str, Callable[[], float | None]]] = []

    def counter(self, name: str, doc: str, fn: Callable[[], float]) -> ScrapeTimeMetrics:
        self._counters.append((name, doc, fn))
        return self

    def gauge(self, name: str, doc: str, fn: Callable[[], float | None]) -> ScrapeTimeMetrics:
        """A gauge; `fn` returning None leaves the series out of that scrape (nothing known yet)."""
        self._gauges.append((name, doc, fn))
        return self

    def collect(self) -> Iterator[Metric]:
        names, values = list(self._labels), list(self._labels.values())
        for name, doc, fn in self._counters:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, float(fn()))
            yield c
        for name, doc, gfn in self._gauges:
            g = GaugeMetricFamily(name, doc, labels=names)
            v = gfn()
            if v is not None:
                g.add_metric(values, float(v))
            yield g

    def register(self, reg: CollectorRegistry) -> None:
        reg.register(self)
