"""The router's `/metrics` under vLLM's names, types, labels and buckets (what load generators
and vLLM's own Grafana dashboard read), in wire seconds, which are paper seconds at speedup 1,
plus the testbed's own counters and gauges.

Parity is with vLLM v0.12's `PrometheusStatLogger` (`vllm/v1/metrics/loggers.py`): every series
carries `model_name` (the served model: the scenario's `model.name`) and `engine` ("router" here;
the node id on the nodes and on the decode nodes' KV usage the router re-exports). The router is
where a request is seen whole, so it holds the per-request series; the nodes export their
scheduler gauges (`testbed.live.prefill_node`, `testbed.live.decode_node`).

Left out, with no meaning in the testbed: `vllm:num_preemptions` (the mock decode never
preempts), `vllm:iteration_tokens_total`, `vllm:request_params_n` (n is always 1), the
multi-modal, LoRA, speculative-decoding and sleep-state series.
`vllm:time_per_output_token_seconds` is not exported: vLLM deprecated it in 0.11 for
`vllm:inter_token_latency_seconds` (the same per-token observations, exported here) and removes
it in 0.13; the per-request value the router used to put under that name is
`vllm:request_time_per_output_token_seconds`, as in vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from testbed.core.record import RequestRecord, StageTimes
from testbed.core.router.health import HealthBook
from testbed.core.router.request_ids import RequestIds
from testbed.core.schema.scaling import Scale
from testbed.live.prom import LABELS, ScrapeTimeMetrics

VLLM_VERSION = "0.12"  # whose names, labels and buckets these are
ENGINE = "router"
# Buckets of vLLM v0.12, vllm/v1/metrics/loggers.py.
TTFT_BUCKETS = (
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
)
TOKEN_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
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
)
REQUEST_LATENCY_BUCKETS = (
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
)
KV_GAUGE = "vllm:kv_cache_usage_perc"
TTFT_STAGES = ("queue", "prefill", "kv_transfer", "decode")


def buckets_1_2_5(max_value: int) -> tuple[float, ...]:
    """vLLM's `build_1_2_5_buckets`: 1, 2, 5, 10, 20, 50, ... up to `max_value` (the token-count
    histograms, up to the model's context length)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


class Labelled:
    """A labelled metric with the router's `model_name` and `engine` filled in: call sites name
    only their own labels (`.labels(cluster=...)`)."""

    def __init__(self, parent: Counter, fixed: dict[str, str]) -> None:
        self._parent, self._fixed = parent, fixed

    def labels(self, **kw: str) -> Counter:
        return self._parent.labels(**self._fixed, **kw)


@dataclass
class RouterMetrics:
    model_name: str
    ttft: Histogram
    itl: Histogram
    tpot: Histogram  # per request: (last token - first token) / (tokens - 1)
    e2e: Histogram
    queue: Histogram
    prefill: Histogram
    decode: Histogram
    inference: Histogram
    prompt_len: Histogram
    generation_len: Histogram
    max_generation: Histogram
    max_tokens: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    prefix_queries: Counter
    prefix_hits: Counter
    success: Counter  # labelled: model_name, engine, finished_reason
    stage: Histogram  # labelled: model_name, engine, stage
    failed: Labelled
    routed: Labelled
    kv_usage: Gauge  # labelled: model_name, engine (the decode node)
    gpu_cache_usage: Gauge
    awaiting_first: int = 0  # requests in flight with no first token yet (vLLM's "waiting")

    def node_kv_usage(self, node: str, value: float | None) -> None:
        """A decode node's KV usage as read before a scrape; None (unreachable) drops its series
        rather than leave it stale."""
        for g in (self.kv_usage, self.gpu_cache_usage):
            if value is None:
                try:
                    g.remove(self.model_name, node)
                except KeyError:
                    pass
            else:
                g.labels(self.model_name, node).set(value)


def make_metrics(reg: CollectorRegistry, model_name: str, max_model_len: int) -> RouterMetrics:
    labels = list(LABELS)
    mine = (model_name, ENGINE)

    def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(*mine)

    def count(name: str, doc: str) -> Counter:
        return Counter(name, doc, labels, registry=reg).labels(*mine)

    tokens = buckets_1_2_5(max_model_len)
    fixed = dict(zip(LABELS, mine))
    return RouterMetrics(
        model_name=model_name,
        ttft=hist("vllm:time_to_first_token_seconds", "Time to first token at the router (wire seconds)", TTFT_BUCKETS),
        itl=hist(
            "vllm:inter_token_latency_seconds",
            "Time between output tokens at the router (wire seconds; a chunk of k tokens counts k gaps of its gap / k)",
            TOKEN_LATENCY_BUCKETS,
        ),
        tpot=hist(
            "vllm:request_time_per_output_token_seconds",
            "Per request: (last token - first token) / (output tokens - 1), wire seconds",
            TOKEN_LATENCY_BUCKETS,
        ),
        e2e=hist(
            "vllm:e2e_request_latency_seconds",
            "End-to-end latency at the router (wire seconds)",
            REQUEST_LATENCY_BUCKETS,
        ),
        queue=hist(
            "vllm:request_queue_time_seconds", "Router arrival to prefill start (wire seconds)", REQUEST_LATENCY_BUCKETS
        ),
        prefill=hist(
            "vllm:request_prefill_time_seconds",
            "Prefill start to first token, KV transfer tail included (wire seconds)",
            REQUEST_LATENCY_BUCKETS,
        ),
        decode=hist(
            "vllm:request_decode_time_seconds", "First token to last token (wire seconds)", REQUEST_LATENCY_BUCKETS
        ),
        inference=hist(
            "vllm:request_inference_time_seconds", "Prefill start to last token (wire seconds)", REQUEST_LATENCY_BUCKETS
        ),
        prompt_len=hist("vllm:request_prompt_tokens", "Prompt tokens per finished request", tokens),
        generation_len=hist("vllm:request_generation_tokens", "Output tokens per finished request", tokens),
        max_generation=hist(
            "vllm:request_max_num_generation_tokens",
            "Output tokens requested (max_tokens) per arriving request",
            tokens,
        ),
        max_tokens=hist("vllm:request_params_max_tokens", "The max_tokens parameter of finished requests", tokens),
        prompt_tokens=count("vllm:prompt_tokens", "Prompt tokens of requests that reached their first token"),
        generation_tokens=count("vllm:generation_tokens", "Output tokens relayed to clients"),
        prefix_queries=count(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the hybrid prefix cache pools at routing"
        ),
        prefix_hits=count("vllm:prefix_cache_hits", "Prompt tokens found cached at the prefill cluster chosen"),
        success=Counter("vllm:request_success", "Finished requests", [*labels, "finished_reason"], registry=reg),
        stage=Histogram(
            "testbed_ttft_stage_seconds",
            "TTFT broken into consecutive stages: queue (router arrival "
            "to prefill start), prefill, kv_transfer (prefill end to the decode node holding the KV), "
            "decode (to the first token at the router); wire seconds",
            [*labels, "stage"],
            buckets=TTFT_BUCKETS,
            registry=reg,
        ),
        failed=Labelled(
            Counter(
                "testbed_requests_failed",
                "Failed requests, by failure kind (label reason)",
                [*labels, "reason"],
                registry=reg,
            ),
            fixed,
        ),
        routed=Labelled(
            Counter(
                "testbed_requests_routed", "Requests routed, by prefill cluster", [*labels, "cluster"], registry=reg
            ),
            fixed,
        ),
        kv_usage=Gauge(
            KV_GAUGE,
            "KV memory in use per decode node, fraction (read from the node at scrape time)",
            labels,
            registry=reg,
        ),
        gpu_cache_usage=Gauge(
            "vllm:gpu_cache_usage_perc",
            "The same as vllm:kv_cache_usage_perc (vLLM's older name, removed in vLLM 0.10)",
            labels,
            registry=reg,
        ),
    )


def note_arrival(m: RouterMetrics, max_tokens: int) -> None:
    """A request admitted (routed, its reply opened): waiting until its first token."""
    m.awaiting_first += 1
    m.max_generation.observe(max_tokens)


def note_tokens(
    m: RouterMetrics, new: int, gap: float | None, ttft: float | None = None, prompt_tokens: int = 0
) -> None:
    """`new` tokens relayed: the first chunk (`ttft` given) or a later one `gap` after the last;
    per token, as vLLM observes it, a chunk of k tokens after a gap g is k gaps of g / k."""
    if ttft is not None:
        m.ttft.observe(ttft)
        m.awaiting_first -= 1
        m.prompt_tokens.inc(prompt_tokens)
    elif gap is not None and new > 0:
        for _ in range(new):
            m.itl.observe(gap / new)
    if new > 0:
        m.generation_tokens.inc(new)


def note_departure(m: RouterMetrics, had_first_token: bool) -> None:
    """A request left (finished, failed or abandoned)."""
    if not had_first_token:
        m.awaiting_first -= 1


def note_prefix(m: RouterMetrics, input_tokens: int, cached_tokens: int) -> None:
    """A routing decision's lookup in the prefix cache pools (a retry looks up again, as a
    rescheduled request does in vLLM)."""
    m.prefix_queries.inc(input_tokens)
    m.prefix_hits.inc(cached_tokens)


def observe_stages(m: RouterMetrics, times: StageTimes, first: float, end: float) -> None:
    """vLLM's phases: queued until the prefill starts, prefill until the first token, then decode
    (the KV transfer tail and the decode admission count as prefill, as they delay the first token);
    and TTFT's stages, consecutive so they add up to it."""
    for hist, a, b in (
        (m.queue, times.router_arrival, times.prefill_start),
        (m.prefill, times.prefill_start, first),
        (m.decode, first, end),
        (m.inference, times.prefill_start, end),
    ):
        if math.isfinite(a) and math.isfinite(b):
            hist.observe(max(b - a, 0.0))
    kv_end = max(times.prefill_end, times.transfer_end) if math.isfinite(times.transfer_end) else times.prefill_end
    edges = (times.router_arrival, times.prefill_start, times.prefill_end, kv_end, first)
    for stage, a, b in zip(TTFT_STAGES, edges, edges[1:]):
        if math.isfinite(a) and math.isfinite(b):
            m.stage.labels(m.model_name, ENGINE, stage).observe(max(b - a, 0.0))


def observe_finished(
    m: RouterMetrics, rec: RequestRecord, arrival: float, first: float | None, sent: int, end: float
) -> None:
    """A completed request: end to end, per output token after the first, token counts and vLLM's
    phases. The mock nodes always produce `max_tokens` tokens, so every finish is "length"."""
    m.success.labels(m.model_name, ENGINE, "length").inc()
    m.e2e.observe(end - arrival)
    m.prompt_len.observe(rec.input_tokens)
    m.generation_len.observe(sent)
    m.max_tokens.observe(rec.output_tokens)
    if first is not None and sent > 1:
        m.tpot.observe((end - first) / (sent - 1))
    if first is not None:
        observe_stages(m, rec.times, first, end)


class Gauged(Protocol):
    """The router state the scrape-time series read."""

    @property
    def inflight(self) -> int: ...
    @property
    def threshold(self) -> float | None: ...
    @property
    def cache_moves(self) -> int: ...
    @property
    def retries(self) -> int: ...
    @property
    def health(self) -> HealthBook: ...
    @property
    def ids(self) -> RequestIds: ...
    @property
    def bandwidth_bps(self) -> float | None: ...


def add_state_gauges(reg: CollectorRegistry, st: Gauged, m: RouterMetrics, scale: Scale, link_paper_bps: float) -> None:
    """The series read from the router's state at scrape time. Monotonic counts are counters
    (`_total`); before they were gauges under the names without the suffix, which are gone (one
    name cannot be both a counter and a gauge in one exposition)."""
    ScrapeTimeMetrics({"model_name": m.model_name, "engine": ENGINE}).gauge(
        "vllm:num_requests_running",
        "Requests in flight at the router past their first token",
        lambda: st.inflight - m.awaiting_first,
    ).gauge(
        "vllm:num_requests_waiting",
        "Requests in flight at the router without a first token yet (queued, prefilling or moving KV)",
        lambda: m.awaiting_first,
    ).gauge("testbed_requests_in_flight", "Requests in flight at the router", lambda: st.inflight).gauge(
        "testbed_routing_threshold_tokens",
        "Length threshold in force (tokens, -1 if none)",
        lambda: -1 if st.threshold is None else st.threshold,
    ).gauge("testbed_instances_down", "Instances taken out of routing", lambda: len(st.health.down())).gauge(
        "testbed_wan_link_capacity_bits_per_second",
        "The inter-datacenter link's configured rate (wire bit/s, the unit of rate(testbed_kv_bytes_sent_total) * 8)",
        lambda: scale.wire_rate_bps(link_paper_bps),
    ).gauge(
        "testbed_wan_bandwidth_estimate_bits_per_second",
        "The control loop's estimate of the WAN's bandwidth (wire bit/s; absent without the loop)",
        lambda: None if st.bandwidth_bps is None else scale.wire_rate_bps(st.bandwidth_bps),
    ).counter("testbed_cache_moves", "Cross-cluster cache moves started", lambda: st.cache_moves).counter(
        "testbed_requests_retried", "Requests routed again after a failed attempt", lambda: st.retries
    ).counter(
        "testbed_request_ids_renamed",
        "Requests whose own id was in use or recorded, renamed id~dupN",
        lambda: st.ids.renamed,
    ).register(reg)
