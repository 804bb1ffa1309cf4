"""WAN link usage from the interface counters the link monitor sampled (source `wan`).

Utilisation is measured bytes over the configured rate in force (schedules change it), in
windows of 100 ms of wire time; the mean is over the whole run. The records give the same
traffic from the other side (offloaded requests x their KV bytes), which the summary sets
beside the counters as a check of both.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from testbed.core.scaling import Scale
from testbed.metrics.records import RequestRecord
from testbed.metrics.timeseries import Sample, counter_total, group_series, resample

WINDOW_S = 0.1


def _rate_in_force(changes: Sequence[Sample], t: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Configured rate (bit/s) at each time t, from the `link_rate_bps_wire` change samples."""
    ts = np.array([c.t for c in changes])
    vs = np.array([c.value for c in changes])
    idx = np.clip(np.searchsorted(ts, t, side="right") - 1, 0, len(vs) - 1)
    return vs[idx]


def link_usage(samples: Sequence[Sample], records: Sequence[RequestRecord], scale: Scale,
               duration_wire: float | None) -> dict[str, Any]:
    wan = [s for s in samples if s.source == "wan"]
    rates = {k: v for k, v in group_series(x for x in wan if x.metric == "link_rate_bps_wire").items()}
    by_link: dict[str, dict[str, Any]] = {}
    for series in group_series(x for x in wan if x.metric == "link_bytes").values():
        link = series[0].labels.get("link", "?")
        total = counter_total(series)
        changes = next((v for k, v in rates.items() if v and v[0].labels.get("link") == link), [])
        entry: dict[str, Any] = {"bytes_wire": total, "bytes_paper": scale.paper_bytes(total)}
        mean_Bps = total / duration_wire if duration_wire else None
        entry["mean_bps_wire"] = None if mean_Bps is None else mean_Bps * 8
        entry["mean_bps_paper"] = None if mean_Bps is None else scale.paper_rate_bps(mean_Bps * 8)
        if len(series) > 1:
            grid, held = resample(series, WINDOW_S, start=series[0].t, end=series[-1].t, how="last")
            held = np.where(np.isnan(held), series[0].value, held)
            win_bps = np.clip(np.diff(held), 0, None) * 8 / WINDOW_S
            entry["peak_bps_wire"] = float(win_bps.max()) if win_bps.size else None
            entry["peak_bps_paper"] = (None if entry["peak_bps_wire"] is None
                                       else scale.paper_rate_bps(entry["peak_bps_wire"]))
            if changes and win_bps.size:
                cfg = _rate_in_force(changes, grid[1:])
                util = win_bps / cfg
                entry["configured_bps_wire"] = float(changes[0].value)
                entry["configured_bps_paper"] = scale.paper_rate_bps(float(changes[0].value))
                entry["mean_utilisation"] = float(util.mean())
                entry["peak_utilisation"] = float(util.max())
        by_link[link] = entry
    if not by_link:
        return {"links": {}}
    # The KV direction carries the most bytes; report it as the headline.
    main = max(by_link, key=lambda k: by_link[k]["bytes_wire"])
    m = by_link[main]
    offloaded = [r for r in records if r.outcome == "completed" and r.crossed_wan]
    rec_bytes = float(sum(r.kv_bytes_wire for r in offloaded))
    return {
        "link": main,
        "mean_bps_paper": m.get("mean_bps_paper"),
        "peak_bps_paper": m.get("peak_bps_paper"),
        "mean_bps_wire": m.get("mean_bps_wire"),
        "configured_bps_paper": m.get("configured_bps_paper"),
        "mean_utilisation": m.get("mean_utilisation"),
        "peak_utilisation": m.get("peak_utilisation"),
        "bytes_per_offloaded_request_paper": scale.paper_bytes(m["bytes_wire"]) / len(offloaded) if offloaded else None,
        "records_kv_bytes_wire": rec_bytes,
        "counters_over_records": m["bytes_wire"] / rec_bytes if rec_bytes else None,
        "links": by_link,
    }
