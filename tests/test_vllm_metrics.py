"""The services' `/metrics` against vLLM's own: names, types, label names and histogram buckets
as vLLM v0.12 exports them (`vllm/v1/metrics/loggers.py`, `PrometheusStatLogger`; the list
in vLLM's docs, "Production Metrics", is generated from it). Parsed as Prometheus parses it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import creds
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from testbed.config.scenarios import load_scenario
from testbed.core.record import RequestRecord
from testbed.core.router.health import HealthBook
from testbed.core.router.request_ids import RequestIds
from testbed.core.schema.scaling import Scale
from testbed.deploy.inproc import InProcessBackend
from testbed.deploy.plan import loopback_deployment
from testbed.live.router.vllm_metrics import (
    add_state_gauges,
    make_metrics,
    note_arrival,
    note_departure,
    note_prefix,
    note_tokens,
    observe_finished,
)
from testbed.run.load import resolve

# vLLM v0.12's buckets, copied from its source rather than from the module under test.
TTFT = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
PER_TOKEN = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
MAX_MODEL_LEN = 1000
TOKENS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]  # build_1_2_5_buckets(max_model_len)
LABELS = {"model_name", "engine"}

# name: (type, extra label names, buckets or None)
VLLM_ROUTER: dict[str, tuple[str, set[str], list[float] | None]] = {
    "vllm:num_requests_running": ("gauge", set(), None),
    "vllm:num_requests_waiting": ("gauge", set(), None),
    "vllm:kv_cache_usage_perc": ("gauge", set(), None),
    "vllm:prefix_cache_queries": ("counter", set(), None),
    "vllm:prefix_cache_hits": ("counter", set(), None),
    "vllm:prompt_tokens": ("counter", set(), None),
    "vllm:generation_tokens": ("counter", set(), None),
    "vllm:request_success": ("counter", {"finished_reason"}, None),
    "vllm:request_prompt_tokens": ("histogram", set(), TOKENS),
    "vllm:request_generation_tokens": ("histogram", set(), TOKENS),
    "vllm:request_max_num_generation_tokens": ("histogram", set(), TOKENS),
    "vllm:request_params_max_tokens": ("histogram", set(), TOKENS),
    "vllm:time_to_first_token_seconds": ("histogram", set(), TTFT),
    "vllm:inter_token_latency_seconds": ("histogram", set(), PER_TOKEN),
    "vllm:request_time_per_output_token_seconds": ("histogram", set(), PER_TOKEN),
    "vllm:e2e_request_latency_seconds": ("histogram", set(), REQUEST),
    "vllm:request_queue_time_seconds": ("histogram", set(), REQUEST),
    "vllm:request_inference_time_seconds": ("histogram", set(), REQUEST),
    "vllm:request_prefill_time_seconds": ("histogram", set(), REQUEST),
    "vllm:request_decode_time_seconds": ("histogram", set(), REQUEST),
}
VLLM_PREFILL = {k: VLLM_ROUTER[k] for k in ("vllm:num_requests_running", "vllm:num_requests_waiting")}
VLLM_DECODE = {
    k: VLLM_ROUTER[k] for k in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
}
# Monotonic counts are counters; the testbed's gauges stay gauges.
TESTBED_ROUTER = {
    "testbed_requests_routed": "counter",
    "testbed_requests_failed": "counter",
    "testbed_cache_moves": "counter",
    "testbed_requests_retried": "counter",
    "testbed_request_ids_renamed": "counter",
    "testbed_routing_threshold_tokens": "gauge",
    "testbed_instances_down": "gauge",
    "testbed_wan_link_capacity_bits_per_second": "gauge",
    "testbed_ttft_stage_seconds": "histogram",
}
TESTBED_PREFILL = {
    "testbed_kv_bytes_sent": "counter",
    "testbed_prefills_completed": "counter",
    "testbed_prefills_failed": "counter",
    "testbed_prefill_passes": "counter",
    "testbed_prefill_pass_tokens": "counter",
    "testbed_prefill_pass_chunks": "counter",
    "testbed_kv_backlog_bytes": "gauge",
    "testbed_slowdown_factor": "gauge",
}
TESTBED_DECODE = {
    "testbed_kv_bytes_received": "counter",
    "testbed_decode_steps": "counter",
    "testbed_decode_completed": "counter",
    "testbed_slowdown_factor": "gauge",
}


def _families(text: str) -> dict[str, tuple[str, list[tuple[str, dict[str, str], float]]]]:
    return {
        f.name: (f.type, [(s.name, s.labels, s.value) for s in f.samples]) for f in text_string_to_metric_families(text)
    }


def check_exposition(
    text: str,
    vllm: dict[str, tuple[str, set[str], list[float] | None]],
    testbed: dict[str, str],
    model: str,
    engines: set[str],
) -> None:
    fams = _families(text)
    for name, (kind, extra, buckets) in vllm.items():
        assert name in fams, f"{name} missing"
        got_kind, samples = fams[name]
        assert got_kind == kind, f"{name}: {got_kind}, vLLM has {kind}"
        assert samples, f"{name}: no samples"
        for sname, labels, _ in samples:
            if sname.endswith("_created"):
                continue
            assert set(labels) - {"le"} == LABELS | extra, f"{sname}: labels {sorted(labels)}"
            assert labels["model_name"] == model and labels["engine"] in engines, labels
        if buckets is not None:
            les = sorted({float(lab["le"]) for s, lab, _ in samples if s.endswith("_bucket")})
            assert les == [*buckets, math.inf], f"{name}: buckets {les}"
    for name, kind in testbed.items():
        assert name in fams and fams[name][0] == kind, f"{name}: {fams.get(name, ('missing',))[0]}, want {kind}"
        for _, labels, _ in fams[name][1]:
            assert labels.get("model_name") == model and labels.get("engine") in engines, f"{name}: {labels}"
    assert "vllm:time_per_output_token_seconds" not in fams, "deprecated in vLLM 0.11, removed in 0.13"


@dataclass
class FakeRouter:
    inflight: int = 0
    threshold: float | None = 19400.0
    cache_moves: int = 2
    retries: int = 1
    health: HealthBook = field(default_factory=lambda: HealthBook(()))
    ids: RequestIds = field(default_factory=RequestIds)
    bandwidth_bps: float | None = None


@pytest.mark.pure
def test_router_exposition_matches_vllm() -> None:
    reg = CollectorRegistry()
    m = make_metrics(reg, "m1", MAX_MODEL_LEN)
    st = FakeRouter()
    add_state_gauges(reg, st, m, Scale(2.0, 4.0), 8e9)
    # Two requests in flight, one of which has had its first token.
    for _ in range(2):
        st.inflight += 1
        note_arrival(m, 5)
        note_prefix(m, 100, 60)
    note_tokens(m, 1, None, ttft=0.2, prompt_tokens=100)
    note_tokens(m, 3, gap=0.03)
    m.node_kv_usage("d0", 0.25)
    m.routed.labels(cluster="pd").inc()
    m.failed.labels(reason="x").inc()
    rec = RequestRecord("r", 0, 100, 5)
    rec.times.router_arrival, rec.times.prefill_start, rec.times.prefill_end, rec.times.transfer_end = (
        0,
        0.05,
        0.1,
        0.15,
    )
    observe_finished(m, rec, 0.0, 0.2, 4, 0.5)
    text = generate_latest(reg).decode()
    check_exposition(text, VLLM_ROUTER, TESTBED_ROUTER, "m1", {"router", "d0"})

    fams = _families(text)

    def val(name: str, sample: str | None = None, **labels: str) -> float:
        return next(v for s, lab, v in fams[name][1] if s == (sample or name) and labels.items() <= lab.items())

    assert val("vllm:num_requests_waiting") == 1 and val("vllm:num_requests_running") == 1
    assert val("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 200
    assert val("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 120
    assert val("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 100
    assert val("vllm:generation_tokens", "vllm:generation_tokens_total") == 4
    assert val("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 3
    assert val(
        "vllm:request_time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds_sum"
    ) == pytest.approx(0.1)
    assert val("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 1
    assert val("vllm:kv_cache_usage_perc", engine="d0") == 0.25
    assert val("testbed_cache_moves", "testbed_cache_moves_total") == 2
    assert val("testbed_wan_link_capacity_bits_per_second") == 4e9  # 8 Gbit/s / byte_scale 4 x speedup 2
    # TTFT's stages add up to it.
    stages = {
        lab["stage"]: v for s, lab, v in fams["testbed_ttft_stage_seconds"][1] if s == "testbed_ttft_stage_seconds_sum"
    }
    assert stages == pytest.approx({"queue": 0.05, "prefill": 0.05, "kv_transfer": 0.05, "decode": 0.05})
    note_departure(m, had_first_token=False)
    st.inflight -= 1
    after = _families(generate_latest(reg).decode())
    assert [v for s, _, v in after["vllm:num_requests_waiting"][1]] == [0]


@pytest.mark.app
async def test_node_expositions_match_vllm(tmp_path: Path) -> None:
    sc = load_scenario("paper-prfaas", {"scale": {"speedup": 40, "byte_scale": 1024}})
    dep = loopback_deployment(resolve(sc), None)
    async with InProcessBackend(dep) as d, aiohttp.ClientSession(headers=creds.headers(dep)) as s:
        async with s.post(f"{d.router.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 200
        for nid, node in d.nodes.items():
            async with s.get(f"{node.http.url}/metrics") as r:
                text = await r.text()
            if node.role == "prefill":
                check_exposition(text, VLLM_PREFILL, TESTBED_PREFILL, sc.model.name, {nid})
            else:
                check_exposition(text, VLLM_DECODE, TESTBED_DECODE, sc.model.name, {nid})
