"""The bar for the metrics: a held deployment (local backend, small) scraped by the real
Prometheus with the generated config lights up every panel of vLLM's reference Grafana dashboard
and of the testbed's own (examples/observability/grafana/testbed.json), each query evaluated
through Prometheus's HTTP API as Grafana would send it."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from testbed.deploy.prometheus import find_binary
from testbed.run.hold import HoldInfo, hold_async
from testbed.run.load import load

pytestmark = [
    pytest.mark.observability,
    pytest.mark.skipif(
        find_binary() is None, reason="no `prometheus` binary on PATH (Debian: apt-get install prometheus)"
    ),
]

DASHBOARD = Path(__file__).resolve().parents[1] / "examples" / "observability" / "grafana" / "testbed.json"
RATE_INTERVAL = "5s"  # Grafana's $__rate_interval at a 1 s scrape interval and a short range

# The reference: vLLM's examples/observability/prometheus_grafana/grafana.json (vllm-project/vllm
# at 4b5c627c23e6690b8987100d1cbf78e34ac14bf9, the V1 metric names of vLLM 0.11/0.12): its
# panels and every target's expression, `$model_name` as its template variable selects it
# (`label_values(model_name)`).
_SEL = '{model_name="$model_name"}'


def _quantiles(metric: str) -> list[str]:
    return [
        f"histogram_quantile({q}, sum by(le) (rate(vllm:{metric}_bucket{_SEL}[$__rate_interval])))"
        for q in ("0.99", "0.95", "0.9", "0.5")
    ]


def _mean(metric: str) -> str:
    return f"rate(vllm:{metric}_sum{_SEL}[$__rate_interval])\n/\nrate(vllm:{metric}_count{_SEL}[$__rate_interval])"


VLLM_REFERENCE_PANELS: dict[str, list[str]] = {
    "E2E Request Latency": [*_quantiles("e2e_request_latency_seconds"), _mean("e2e_request_latency_seconds")],
    "Token Throughput": [
        f"rate(vllm:prompt_tokens_total{_SEL}[$__rate_interval])",
        f"rate(vllm:generation_tokens_total{_SEL}[$__rate_interval])",
    ],
    "Inter Token Latency": [*_quantiles("inter_token_latency_seconds"), _mean("inter_token_latency_seconds")],
    "Scheduler State": [f"vllm:num_requests_running{_SEL}", f"vllm:num_requests_waiting{_SEL}"],
    "Time To First Token Latency": [*_quantiles("time_to_first_token_seconds"), _mean("time_to_first_token_seconds")],
    "Cache Utilization": [f"vllm:kv_cache_usage_perc{_SEL}"],
    "Request Prompt Length": [f"sum by(le) (increase(vllm:request_prompt_tokens_bucket{_SEL}[$__rate_interval]))"],
    "Request Generation Length": [
        f"sum by(le) (increase(vllm:request_generation_tokens_bucket{_SEL}[$__rate_interval]))"
    ],
    "Finish Reason": [f"sum by(finished_reason) (increase(vllm:request_success_total{_SEL}[$__rate_interval]))"],
    "Queue Time": [f"rate(vllm:request_queue_time_seconds_sum{_SEL}[$__rate_interval])"],
    "Requests Prefill and Decode Time": [
        f"rate(vllm:request_prefill_time_seconds_sum{_SEL}[$__rate_interval])",
        f"rate(vllm:request_decode_time_seconds_sum{_SEL}[$__rate_interval])",
    ],
    "Max Generation Token in Sequence Group": [
        f"rate(vllm:request_max_num_generation_tokens_sum{_SEL}[$__rate_interval])"
    ],
}

SMALL = {
    "scale": {"speedup": 4, "byte_scale": 1024},
    "clusters": [
        {
            "name": "prfaas",
            "datacenter": "dc-remote",
            "kind": "prfaas",
            "hardware": "h200",
            "prefill": 1,
            "decode": 0,
            "cache_bytes": "4TiB",
        },
        {
            "name": "pd",
            "datacenter": "dc-local",
            "kind": "pd",
            "hardware": "h20",
            "prefill": 1,
            "decode": 1,
            "cache_bytes": "8TiB",
        },
    ],
}


def _free_port() -> int:
    """A free port below the kernel's ephemeral range: a port the kernel handed out and this test
    released could be handed again to the deployment's services (they take theirs the same way)
    or to an outgoing connection before Prometheus binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in range(max(1024, low - 12_000), low):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below the ephemeral range (which starts at {low})")


async def _drive(s: aiohttp.ClientSession, url: str) -> None:
    """A few waves of requests, each with one past the threshold (prefilled in the PrfaaS cluster)
    and a repeated prompt (a prefix cache hit)."""

    async def one(tokens: int, hashes: list[int]) -> None:
        body = {"prompt": "x", "max_tokens": 6, "testbed": {"input_tokens": tokens, "hash_ids": hashes}}
        async with s.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()

    for wave in range(3):
        await asyncio.gather(
            one(30000, [100 + wave]), one(2000, [1, 2, 3]), one(1500, [10 * wave + 7]), one(800, [1, 2])
        )
        await asyncio.sleep(0.5)


async def _range(s: aiohttp.ClientSession, prom: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": "1"}
    async with s.get(f"{prom}/api/v1/query_range", params=params) as r:
        body = await r.json()
    assert body["status"] == "success", (expr, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def _has_data(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(v)) for series in result for _, v in series["values"])


def _grafana(expr: str, model: str) -> str:
    return expr.replace("$model_name", model).replace("$__rate_interval", RATE_INTERVAL)


async def test_vllm_and_testbed_dashboards_return_data(tmp_path: Path) -> None:
    rs = load("paper-prfaas", SMALL)
    listen = f"127.0.0.1:{_free_port()}"
    stop, ready = asyncio.Event(), asyncio.Event()
    infos: list[HoldInfo] = []

    def on_ready(info: HoldInfo) -> None:
        infos.append(info)
        ready.set()

    hold = asyncio.create_task(hold_async(rs, tmp_path / "run", "local", stop, on_ready, prometheus=listen))
    try:
        await asyncio.wait_for(
            asyncio.wait({hold, asyncio.ensure_future(ready.wait())}, return_when=asyncio.FIRST_COMPLETED), 60
        )
        if hold.done():
            hold.result()
        info = infos[0]
        assert info.prometheus == f"http://{listen}"
        auth = {"Authorization": f"Bearer {info.api_key}"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), headers=auth) as s:
            start = time.time()
            await _drive(s, info.url)
            await asyncio.sleep(3)  # a few scrapes after the last request
            end = time.time()
            prom = info.prometheus
            async with s.get(f"{prom}/api/v1/targets") as r:
                targets = (await r.json())["data"]["activeTargets"]
            assert len(targets) == 1 + len(rs.spec.clusters) + 1, targets  # router, 3 nodes
            assert all(t["health"] == "up" for t in targets), targets
            async with s.get(f"{prom}/api/v1/label/model_name/values") as r:
                models = (await r.json())["data"]
            assert models == [rs.spec.model.name]
            model = models[0]

            dash = json.loads(DASHBOARD.read_text())
            queries = [(f"vLLM {title}", expr) for title, exprs in VLLM_REFERENCE_PANELS.items() for expr in exprs]
            queries += [(f"testbed {panel['title']}", t["expr"]) for panel in dash["panels"] for t in panel["targets"]]
            results = await asyncio.gather(*(_range(s, prom, _grafana(e, model), start, end) for _, e in queries))
            empty = [f"{where}: {e}" for (where, e), res in zip(queries, results) if not _has_data(res)]
            for ann in dash["annotations"]["list"]:
                if "expr" in ann:  # faults: data only while one is in force, but the query must evaluate
                    await _range(s, prom, _grafana(ann["expr"], model), start, end)
            assert not empty, "\n".join(empty)
            # Something crossed the WAN and something hit the prefix cache: the panels show more than zeros.
            wan = await _range(
                s,
                prom,
                _grafana('sum(increase(testbed_kv_bytes_sent_total{cluster_kind="prfaas"}[1m]))', model),
                end - 1,
                end,
            )
            assert float(wan[0]["values"][-1][1]) > 0
    finally:
        stop.set()
        await asyncio.wait_for(hold, 60)
    assert (tmp_path / "run" / "prometheus" / "targets.json").exists()
