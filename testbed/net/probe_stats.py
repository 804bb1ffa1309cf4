"""What a stream of numbered UDP probes says about a link (pure): loss, the lag-1 correlation of
losses, reordering, and the one-way delay and its spread (sender and receiver share one clock:
the namespaces of one kernel)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ProbeStats:
    sent: int
    received: int  # distinct sequence numbers that arrived
    loss: float | None  # fraction of `sent` that never arrived
    loss_correlation: float | None  # lag-1, Gilbert-style: (P(lost | previous lost) - p) / (1 - p)
    reordered: float | None  # fraction of arrivals below the highest sequence seen before
    delay_median_s: float | None  # one-way
    delay_sd_s: float | None  # one-way jitter


def loss_correlation(lost: Sequence[bool]) -> float | None:
    """Lag-1 correlation of a loss sequence as the delay line's Gilbert chain defines it: with
    P(drop | previous dropped) = c + (1 - c) p, c = (P(L|L) - p) / (1 - p). None without a loss
    (or with nothing but losses): no conditional to estimate."""
    n = len(lost)
    if n < 2:
        return None
    p = sum(lost) / n
    after_loss = [lost[i] for i in range(1, n) if lost[i - 1]]
    if not after_loss or p >= 1.0:
        return None
    return (sum(after_loss) / len(after_loss) - p) / (1.0 - p)


def reordered_fraction(seqs: Sequence[int]) -> float | None:
    """Arrivals whose sequence number is below one that arrived earlier (RFC 4737's reordered)."""
    if not seqs:
        return None
    high, late = -1, 0
    for s in seqs:
        if s < high:
            late += 1
        else:
            high = s
    return late / len(seqs)


def probe_stats(sent: int, arrivals: Sequence[tuple[int, float]]) -> ProbeStats:
    """`arrivals`: (sequence, one-way delay in s) in arrival order; duplicates count once."""
    seen: set[int] = set()
    order: list[int] = []
    delays: list[float] = []
    for seq, d in arrivals:
        if seq in seen or not 0 <= seq < sent:
            continue
        seen.add(seq)
        order.append(seq)
        if math.isfinite(d):
            delays.append(d)
    lost = [i not in seen for i in range(sent)]
    return ProbeStats(
        sent=sent,
        received=len(seen),
        loss=sum(lost) / sent if sent else None,
        loss_correlation=loss_correlation(lost),
        reordered=reordered_fraction(order),
        delay_median_s=statistics.median(delays) if delays else None,
        delay_sd_s=statistics.pstdev(delays) if len(delays) > 1 else None,
    )
