"""A complete, valid `Summary` for tests that need one by hand (regress, plan, fidelity gates):
every section the model requires, with plausible figures; override any figure by its path. And
`alike`, for summaries whose floats may differ in their last bits (sums taken in another order)."""

from __future__ import annotations

import copy
import math
from typing import Any

from testbed.metrics.artefacts import Summary

_STATS = {"n": 40, "mean": 2.5, "p50": 2.3, "p90": 4.1, "p99": 5.1}
_BREAKDOWN = {
    "routing": 0.01,
    "prefill_queue": 0.2,
    "prefill_compute": 2.0,
    "transfer_tail": 0.05,
    "decode_queue": 0.01,
    "first_step": 0.05,
    "other": 0.18,
}
_FIGURES: dict[str, Any] = {
    "schema_version": 6,
    "schema": 2,
    "run": {
        "name": "ci",
        "scenario": "paper-prfaas",
        "policy": "prfaas",
        "threshold": 19400.0,
        "speedup": 10.0,
        "byte_scale": 256.0,
        "shaping_method": "none",
        "offered_rate_rps": 1.6,
        "slo_ttft_s": 10.0,
        "slo_tpot_s": 0.025,
        "duration_s_paper": 32.0,
        "interrupted": False,
    },
    "requests": {"total": 40, "completed": 40, "failed": 0, "pending": 0, "failure_reasons": {}},
    "throughput": {
        "completed_rps_paper": 1.25,
        "completed_rps_wire": 12.5,
        "output_tokens_per_s_paper": 80.0,
        "output_tokens_per_s_wire": 800.0,
        "goodput_rps_paper": 1.2,
        "goodput_rps_wire": 12.0,
        "slo_met": 38,
        "slo_attainment": 0.95,
    },
    "ttft_s": _STATS,
    "ttft_breakdown_s": _BREAKDOWN,
    "tpot_s": {"n": 40, "mean": 0.025, "p50": 0.025, "p90": 0.026, "p99": 0.027},
    "offload": {"ratio": 0.475, "requests": 19},
    "bytes": {
        "kv_total_paper": 4e10,
        "kv_total_wire": 1.5625e8,
        "kv_per_request_paper": 1e9,
        "kv_per_request_wire": 3.90625e6,
        "wan_total_paper": 3e10,
        "wan_total_wire": 1.171875e8,
        "wan_per_offloaded_request_paper": 1.58e9,
        "wan_per_offloaded_request_wire": 6.17e6,
        "cache_move_paper": 0.0,
        "cache_move_wire": 0.0,
        "wan_per_request_paper": 7.5e8,
        "wan_per_request_wire": 2.93e6,
    },
    "wan_egress": {
        "bytes_paper": 3e10,
        "bytes_wire": 1.171875e8,
        "mean_Bps_paper": 5.7e8,
        "peak_Bps_paper": 1.4e9,
        "mean_Bps_wire": 2.2e7,
        "peak_Bps_wire": 5.5e7,
    },
    "links": {
        "prfaas-p0{dest=127.0.0.1:4000}": {
            "metric": "kv_bytes_sent",
            "wan": True,
            "bytes_paper": 3e10,
            "bytes_wire": 1.171875e8,
            "mean_Bps_paper": 1.0e8,
            "peak_Bps_paper": 1.4e9,
            "mean_Bps_wire": 3.9e6,
            "peak_Bps_wire": 5.5e7,
        }
    },
    "fidelity": {
        "n": 40,
        "prefill_abs_err_median_s": 0.001,
        "prefill_rel_err_median": 0.002,
        "bounds": {"prefill_rel_err_median": 0.03},
    },
    "validity": {"valid": True, "reasons": []},
    "wire": {
        "duration_s": 3.2,
        "ttft_s": {k: (v if k == "n" else v / 10) for k, v in _STATS.items()},
        "ttft_breakdown_s": {k: v / 10 for k, v in _BREAKDOWN.items()},
        "tpot_s": {"n": 40, "mean": 0.0025, "p50": 0.0025, "p90": 0.0026, "p99": 0.0027},
    },
    "timeseries": {"samples": 0, "metrics": []},
}


def summary_figures(**over: Any) -> dict[str, Any]:
    """The JSON content; `over` sets figures by path with `__` between parts
    (`ttft_s__mean=3.0`), or whole sections (`validity={...}`)."""
    s = copy.deepcopy(_FIGURES)
    for key, value in over.items():
        node = s
        parts = key.split("__")
        for p in parts[:-1]:
            node = node[p]
        node[parts[-1]] = value
    return s


def make_summary(**over: Any) -> Summary:
    """`summary_figures(**over)` validated as the model."""
    return Summary.model_validate(summary_figures(**over))


def alike(a: Any, b: Any, where: str = "") -> list[str]:
    """Where `a` and `b` differ: keys, lengths, values (floats to 1e-9 relative, the rest exactly)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a.keys() ^ b.keys())}"]
        return [p for k in a for p in alike(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} against {len(b)} entries"]
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in alike(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return [] if math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) else [f"{where}: {a!r} against {b!r}"]
    return [] if a == b and type(a) is type(b) else [f"{where}: {a!r} against {b!r}"]
