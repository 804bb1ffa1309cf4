"""The paper's bandwidth figures, as data: Table 3 and the claims of section 2.3.

Source: Qin et al., "Prefill-as-a-Service: KVCache of Next-Generation Models Could Go
Cross-Datacenter", arXiv 2604.15039 (v2), as transcribed in docs/paper.md. Models are keyed by the
names of their profiles (scenarios/models/NAME.yaml). Gbps and Tbps are decimal (1e9, 1e12 bit/s):
Table 5's S_kv / T_prefill reproduces its Phi_kv column only that way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GPUS_PER_INSTANCE = 8  # every instance of Tables 3 and 5 is 8 GPUs

# Table 1: the models' names as the paper writes them.
MODEL_NAMES: dict[str, str] = {
    "kimi-linear": "Kimi Linear",
    "mimo-v2-flash": "MiMo-V2-Flash",
    "qwen3.5-397b": "Qwen3.5-397B",
    "ring-2.5-1t": "Ring-2.5-1T",
    "minimax-m2.5": "MiniMax-M2.5",
    "qwen3-235b": "Qwen3-235B",
}

# Table 3: Phi_kv of one 8xH200 instance (SGLang 0.5.9), Gbps, at 1K / 8K / 32K / 128K input tokens.
TABLE3_TOKENS: tuple[int, ...] = (1024, 8192, 32768, 131072)
TABLE3_GBPS: dict[str, tuple[float, ...]] = {
    "kimi-linear": (1.19, 2.29, 3.87, 4.88),
    "mimo-v2-flash": (0.82, 2.85, 4.66, 4.71),
    "qwen3.5-397b": (4.13, 6.28, 8.25, 7.47),
    "ring-2.5-1t": (7.27, 4.47, 2.59, 1.46),
    "minimax-m2.5": (4.94, 32.87, 59.93, 47.82),
    "qwen3-235b": (4.12, 22.42, 33.35, 21.50),
}

# Per-token full-attention KV that the paper pins down: MiniMax-M2.5 is dense GQA (Table 1),
# 62 x 8 KV heads x 128 x 2 x 2 bytes (docs/paper.md, derived from the paper's model). The hybrids'
# per-token bytes cannot be read off Table 3: it gives S_kv / T, never S_kv alone.
KV_BYTES_PER_TOKEN: dict[str, int] = {"minimax-m2.5": 253952}


def table3_bps(model: str, tokens: int) -> float | None:
    """Table 3's Phi_kv in bit/s, or None where the table has no entry."""
    row = TABLE3_GBPS.get(model)
    if row is None or tokens not in TABLE3_TOKENS:
        return None
    return row[TABLE3_TOKENS.index(tokens)] * 1e9


@dataclass(frozen=True)
class Claim:
    """One figure of section 2.3: PrfaaS egress B_out = (N/P) * Phi_kv(L_avg) of a cluster."""

    key: str
    label: str  # a few words for a table row
    text: str
    model: str
    tokens: int  # L_avg of the offloaded requests
    gpus: int  # N; P = GPUS_PER_INSTANCE
    paper_bps: float
    bound: Literal["about", "below"] = "about"  # "~X" or "under X"


# Section 2.3. The 10,000-GPU figure is stated after the Ring-2.5-1T 128K one without its own
# model or length; DATACENTER_ASSUMPTIONS gives the reading that reproduces it.
CLAIMS: tuple[Claim, ...] = (
    Claim(
        "minimax-512",
        "PrfaaS cluster",
        "512xH200 PrfaaS cluster, MiniMax-M2.5 at L_avg 32K: ~3.8 Tbps",
        "minimax-m2.5",
        32768,
        512,
        3.8e12,
    ),
    Claim(
        "qwen3-512",
        "PrfaaS cluster",
        "512xH200 PrfaaS cluster, Qwen3-235B at L_avg 32K: ~2.1 Tbps",
        "qwen3-235b",
        32768,
        512,
        2.1e12,
    ),
    Claim(
        "ring-512",
        "PrfaaS cluster",
        "512xH200 PrfaaS cluster, Ring-2.5-1T at L_avg 32K: ~170 Gbps",
        "ring-2.5-1t",
        32768,
        512,
        170e9,
    ),
    Claim(
        "ring-512-128k",
        "128K only",
        "the same, only 128K requests routed to PrfaaS: under 100 Gbps",
        "ring-2.5-1t",
        131072,
        512,
        100e9,
        "below",
    ),
    Claim("datacenter-10k", "datacenter", "a 10,000-GPU datacenter: ~1.8 Tbps", "ring-2.5-1t", 131072, 10000, 1.8e12),
    Claim(
        "dense-instance",
        "one instance",
        "a dense model at 32K: ~60 Gbps per 8-GPU instance (RDMA-class)",
        "minimax-m2.5",
        32768,
        GPUS_PER_INSTANCE,
        60e9,
    ),
)

DATACENTER_ASSUMPTIONS: tuple[str, ...] = (
    "Ring-2.5-1T with only 128K-token requests offloaded (L_avg = 128K), as in the sentence "
    "before it: that 512-GPU figure scaled by 10,000 / 512",
    "every one of the 10,000 GPUs is a PrfaaS prefill GPU: 1,250 8xH200 instances",
    "the offloaded requests are all of that cluster's work and every instance is always busy: "
    "B_out = (N/P) * Phi_kv(L_avg) with no idle time",
    "egress scales linearly with each share: half the GPUs prefilling, or busy half the time, halves it",
)
