"""Paper units <-> wire units (DESIGN: time and byte scaling)."""

from __future__ import annotations

from dataclasses import dataclass

from testbed.core.schema.scenario import ScaleSpec


@dataclass(frozen=True)
class Scale:
    """Durations divide by `speedup`; KV bytes divide by `byte_scale`; link rates
    divide by byte_scale and multiply by speedup, so transfer times scale like service times."""

    speedup: float = 1.0
    byte_scale: float = 1.0

    @classmethod
    def from_spec(cls, spec: ScaleSpec) -> Scale:
        return cls(spec.speedup, spec.byte_scale)

    def wire_seconds(self, paper_s: float) -> float:
        return paper_s / self.speedup

    def paper_seconds(self, wire_s: float) -> float:
        return wire_s * self.speedup

    def wire_bytes(self, paper_bytes: float) -> int:
        return max(round(paper_bytes / self.byte_scale), 0)

    def paper_bytes(self, wire_bytes: float) -> float:
        return wire_bytes * self.byte_scale

    def wire_rate_bps(self, paper_bps: float) -> float:
        return paper_bps / self.byte_scale * self.speedup

    def paper_rate_bps(self, wire_bps: float) -> float:
        return wire_bps * self.byte_scale / self.speedup
