"""Per-instance KV throughput and cluster egress of model profiles (paper Table 3, section 2.3).

Phi_kv(l) = S_kv(l) / T_prefill(l) for one 8-GPU instance; a cluster of N GPUs that is always
busy prefilling requests of mean uncached length L_avg emits B_out = (N/P) * Phi_kv(L_avg)
(docs/paper.md, section 3.4). Everything is in paper units: bytes, seconds, bit/s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from testbed.core.engine.kvsize import KVModel
from testbed.core.engine.servicetime import PrefillTime
from testbed.core.schema.scenario import ModelProfile
from testbed.model.errors import ModelError
from testbed.model.paper_bandwidth import (
    CLAIMS,
    DATACENTER_ASSUMPTIONS,
    GPUS_PER_INSTANCE,
    KV_BYTES_PER_TOKEN,
    TABLE3_GBPS,
    TABLE3_TOKENS,
    Claim,
    table3_bps,
)

PROFILE_HARDWARE = "h200"  # Table 3's hardware; the profiles' curve is named for it


def rel_diff(ours: float, paper: float) -> float:
    return (ours - paper) / paper


@dataclass(frozen=True)
class ModelCurve:
    """A profile reduced to what the bandwidth figures need: S_kv(l) and T_prefill(l)."""

    name: str
    kv: KVModel
    prefill: PrefillTime

    @classmethod
    def from_profile(cls, name: str, profile: ModelProfile, hardware: str = PROFILE_HARDWARE) -> ModelCurve:
        if hardware not in profile.hardware:
            raise ModelError(f"model profile {name!r} has no {hardware!r} hardware, only {sorted(profile.hardware)}")
        return cls(name, KVModel.from_spec(profile.model), PrefillTime.from_spec(profile.hardware[hardware].prefill))

    def kv_bytes(self, tokens: int) -> int:
        return self.kv.total(tokens)

    def prefill_s(self, tokens: int) -> float:
        return self.prefill.uncached_time(tokens)

    def fixed_s(self) -> float:
        """Time per prefill at zero tokens: the explicit overhead plus the curve's own intercept."""
        return self.prefill.fixed_time()

    def phi_bps(self, tokens: int) -> float:
        return 8.0 * self.kv_bytes(tokens) / self.prefill_s(tokens)


def egress_bps(curve: ModelCurve, tokens: int, gpus: float) -> float:
    """B_out of `gpus` GPUs (in 8-GPU instances) all prefilling requests of `tokens` tokens."""
    return gpus / GPUS_PER_INSTANCE * curve.phi_bps(tokens)


@dataclass(frozen=True)
class PhiRow:
    model: str
    tokens: int
    kv_bytes: int
    prefill_s: float
    phi_bps: float
    paper_bps: float | None
    cluster_bps: float  # egress of the report's N GPUs at this length

    @property
    def diff(self) -> float | None:
        return None if self.paper_bps is None else rel_diff(self.phi_bps, self.paper_bps)


@dataclass(frozen=True)
class KVRow:
    model: str
    layers: int
    full_layers: int
    state_layers: int
    bytes_per_token: float
    state_bytes: int  # request-level state once the prompt fills every window
    paper_bytes_per_token: int | None

    @property
    def diff(self) -> float | None:
        p = self.paper_bytes_per_token
        return None if p is None else rel_diff(self.bytes_per_token, p)


@dataclass(frozen=True)
class ClaimRow:
    claim: Claim
    ours_bps: float

    @property
    def diff(self) -> float:
        return rel_diff(self.ours_bps, self.claim.paper_bps)

    def holds(self, tolerance: float = 0.10) -> bool:
        if self.claim.bound == "below":
            return self.ours_bps < self.claim.paper_bps
        return abs(self.diff) <= tolerance


def phi_rows(curves: Sequence[ModelCurve], lengths: Sequence[int], gpus: float) -> list[PhiRow]:
    return [
        PhiRow(c.name, n, c.kv_bytes(n), c.prefill_s(n), c.phi_bps(n), table3_bps(c.name, n), egress_bps(c, n, gpus))
        for c in curves
        for n in lengths
    ]


def kv_rows(curves: Sequence[ModelCurve]) -> list[KVRow]:
    return [
        KVRow(
            c.name,
            c.kv.layers,
            c.kv.kinds.count("full"),
            c.kv.kinds.count("linear"),
            c.kv.full_bytes_per_token,
            c.kv.max_state_bytes,
            KV_BYTES_PER_TOKEN.get(c.name),
        )
        for c in curves
    ]


def claim_rows(curves: Mapping[str, ModelCurve]) -> list[ClaimRow]:
    """The section 2.3 claims whose model is among `curves`, at the paper's own cluster sizes."""
    return [ClaimRow(cl, egress_bps(curves[cl.model], cl.tokens, cl.gpus)) for cl in CLAIMS if cl.model in curves]


def datacenter_candidates(
    gpus: int = 10000, target_bps: float = 1.8e12, tolerance: float = 0.10
) -> list[tuple[str, int, float]]:
    """Every (model, length) of Table 3 whose all-prefill cluster of `gpus` GPUs lands within
    `tolerance` of `target_bps`: the readings of an unattributed cluster figure that fit."""
    out = []
    for model, row in TABLE3_GBPS.items():
        for tokens, gbps in zip(TABLE3_TOKENS, row):
            bps = gpus / GPUS_PER_INSTANCE * gbps * 1e9
            if abs(rel_diff(bps, target_bps)) <= tolerance:
                out.append((model, tokens, bps))
    return out


@dataclass(frozen=True)
class FixedRow:
    """One profile's fixed time per prefill and its length-dependent part T(l) - fixed."""

    model: str
    fixed_s: float
    overhead_s: float
    length_s: dict[int, float]  # tokens -> T(tokens) - fixed_s


def fixed_rows(curves: Sequence[ModelCurve], lengths: Sequence[int]) -> list[FixedRow]:
    return [
        FixedRow(c.name, c.fixed_s(), c.prefill.overhead_s, {n: c.prefill_s(n) - c.fixed_s() for n in lengths})
        for c in curves
    ]


@dataclass(frozen=True)
class BandwidthReport:
    gpus: float
    phi: list[PhiRow]
    kv: list[KVRow]
    claims: list[ClaimRow]
    datacenter_candidates: list[tuple[str, int, float]]
    fixed: list[FixedRow]

    @property
    def instances(self) -> float:
        return self.gpus / GPUS_PER_INSTANCE

    def to_dict(self) -> dict[str, object]:
        return {
            "gpus": self.gpus,
            "gpus_per_instance": GPUS_PER_INSTANCE,
            "instances": self.instances,
            "phi": [{**asdict(r), "diff": r.diff} for r in self.phi],
            "kv": [{**asdict(r), "diff": r.diff} for r in self.kv],
            "claims": [
                {**asdict(r.claim), "ours_bps": r.ours_bps, "diff": r.diff, "holds": r.holds()} for r in self.claims
            ],
            "fixed": [asdict(r) for r in self.fixed],
            "datacenter": {
                "assumptions": list(DATACENTER_ASSUMPTIONS),
                "table3_readings_within_10pct": [
                    {"model": m, "tokens": n, "bps": b} for m, n, b in self.datacenter_candidates
                ],
            },
        }


def report(curves: Sequence[ModelCurve], lengths: Sequence[int] = TABLE3_TOKENS, gpus: float = 512) -> BandwidthReport:
    if gpus <= 0:
        raise ModelError("gpus must be > 0")
    if any(n <= 0 for n in lengths):
        raise ModelError("lengths must be > 0 tokens")
    by_name = {c.name: c for c in curves}
    return BandwidthReport(
        gpus,
        phi_rows(curves, lengths, gpus),
        kv_rows(curves),
        claim_rows(by_name),
        datacenter_candidates(),
        fixed_rows(curves, lengths),
    )
