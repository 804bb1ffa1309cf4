"""How far a run's WAN interface counters may exceed the KV bytes its records say crossed,
from what the run measured rather than a fixed margin.

The counters see every byte on the wire. Over the KV payload the records hold, that is:
- what the KV senders' sockets put on the wire beyond it: the KV frames' headers and every
  retransmitted segment, measured per connection as `tcp_bytes_sent` (tcpi_bytes_sent), plus
  transfers resumed after a lost connection (`kv_bytes_resent`, in case the old connection's
  last sample missed them);
- one set of Ethernet, IP and TCP headers per counted packet (66 bytes with timestamps; a
  segmentation-offload packet is counted once with one set), from the link's own packet counter:
  a busy host sends smaller packets, and this term grows with them;
- the control traffic sharing the link (the router's requests and health probes answered from
  the remote datacenter): at most what crossed the other way, since every answer here follows a
  request there.
Each term is measured in the run, so the bound holds on a busy machine as on a quiet one."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from testbed.metrics.series_format import SeriesPoint
from testbed.metrics.timeseries import load_timeseries

HEADER_BYTES = 14 + 20 + 32  # Ethernet, IPv4, TCP with the timestamp option


def _last_per_series(points: list[SeriesPoint], metrics: tuple[str, ...], sources: set[str]) -> dict[str, float]:
    last: dict[tuple[str, str, tuple[tuple[str, str], ...]], float] = {}
    for p in points:
        if p.metric in metrics and p.source in sources:
            last[(p.source, p.metric, tuple(sorted(p.labels.items())))] = p.value
    out = dict.fromkeys(metrics, 0.0)
    for (_, metric, _), v in last.items():
        out[metric] += v
    return out


def _link_growth(points: list[SeriesPoint], metric: str) -> dict[str, float]:
    """Growth of a WAN link counter over the run, per link."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for p in points:
        if p.source == "wan" and p.metric == metric:
            link = p.labels.get("link", "?")
            first.setdefault(link, p.value)
            last[link] = p.value
    return {k: last[k] - first[k] for k in last}


def wan_senders(run_dir: Path) -> set[str]:
    """Prefill nodes whose KV crossed the WAN, from the records."""
    with (run_dir / "records.csv").open(newline="") as f:
        return {r["prefill_node"] for r in csv.DictReader(f) if r["crossed_wan"] in ("1", "True", "true")}


def counters_bound(run_dir: Path, summary: dict[str, Any]) -> float:
    """The largest `counters_over_records` this run can show with nothing on its KV link but
    the KV and the control traffic it measured."""
    w = summary["wan_link"]
    kv = w["records_kv_bytes_wire"]
    points = load_timeseries(run_dir)
    sent = _last_per_series(points, ("tcp_bytes_sent", "kv_bytes_resent"), wan_senders(run_dir))
    packets = _link_growth(points, "link_packets")
    control = sum(v["bytes_wire"] for k, v in w["links"].items() if k != w["link"])
    on_wire = (
        max(sent["tcp_bytes_sent"], kv) + sent["kv_bytes_resent"] + HEADER_BYTES * packets.get(w["link"], 0.0) + control
    )
    return on_wire / kv
