"""How far a replay has got: the tally the replayer keeps and a run's progress callback reads
(its own module, so a simulated run reads it without the replayer's HTTP client)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReplayStats:
    sent: int = 0
    completed: int = 0
    failed: int = 0
    total: int = 0
