"""How far a run's WAN interface counters may exceed the KV bytes its records say crossed,
from what the run measured rather than a fixed margin.

The counters see every byte on the wire: IP, TCP and Ethernet headers on each segment (at a
1,500-byte MTU, 1,514 bytes for 1,448 of payload: +4.6%), the KV frames' own headers, and what
was sent twice: segments TCP retransmitted and transfers resumed after a lost connection. The
first two are fixed by the MTU and the frame format; the last depends on the host, and a busy
one (a delay line that falls behind and drops from its queue) retransmits more. Its allowance is
what the prefill nodes' samples say was sent twice: `tcp_total_retrans` (segments, per connection,
a full segment each) and `kv_bytes_resent`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from testbed.metrics.timeseries import load_timeseries

MSS = 1448                    # TCP payload of a full segment at a 1,500-byte MTU, timestamps on
HEADERS = 1.05                # (1500 + 14) / 1448 = 1.046, with the KV frames' headers under 0.4%


def resent_bytes(run_dir: Path) -> float:
    """Bytes the run's senders put on the wire a second time (wire units)."""
    last: dict[tuple[str, str, tuple[tuple[str, str], ...]], float] = {}
    for p in load_timeseries(run_dir):
        if p.metric in ("tcp_total_retrans", "kv_bytes_resent"):
            last[(p.source, p.metric, tuple(sorted(p.labels.items())))] = p.value
    return sum(v * MSS if k[1] == "tcp_total_retrans" else v for k, v in last.items())


def counters_bound(run_dir: Path, summary: dict[str, Any]) -> float:
    """The largest `counters_over_records` this run can show with nothing on the wire but its KV."""
    kv = summary["wan_link"]["records_kv_bytes_wire"]
    return HEADERS * (1.0 + resent_bytes(run_dir) / kv)
