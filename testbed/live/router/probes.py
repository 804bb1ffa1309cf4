"""What the router reads from its instances besides requests: active health probes, and each
decode node's KV-cache usage from the node's own `/metrics` when the router's is scraped."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from testbed.core.router.health import PROBE_INTERVAL_S, PROBE_TIMEOUT_S, Outcome
from testbed.live.clock import now
from testbed.live.router.state import STATE, RouterState, outcome_of
from testbed.live.router.vllm_metrics import KV_GAUGE

SCRAPE_TIMEOUT_S = 1.0  # a decode node's /metrics, read when the router's is scraped


async def _node_kv_usage(st: RouterState, node: str) -> float | None:
    url = f"{st.cfg.deployment.nodes[node].http.url}/metrics"
    try:
        async with st.session.get(url, timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    for fam in text_string_to_metric_families(text):
        if fam.name == KV_GAUGE:
            return next((float(smp.value) for smp in fam.samples), None)
    return None


async def refresh_kv_usage(app: web.Application) -> None:
    """Before a scrape: every decode node's KV usage as the router's gauges."""
    st = app[STATE]
    m = st.metrics
    decode = sorted(k for k, n in st.cfg.deployment.nodes.items() if n.role == "decode")
    values = await asyncio.gather(*(_node_kv_usage(st, n) for n in decode))
    for node, v in zip(decode, values):
        m.node_kv_usage(node, v)


async def _probe(st: RouterState, node: str) -> None:
    ep = st.cfg.deployment.nodes[node].http
    try:
        async with st.session.get(f"{ep.url}/health", timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as r:
            outcome: Outcome = "ok" if r.status == 200 else "failed"
            why = f"health probe answered {r.status}"
    except aiohttp.ClientError as e:
        outcome, why = outcome_of(e), f"health probe: {type(e).__name__}: {e}"
    except TimeoutError:
        outcome, why = "failed", f"health probe: no answer within {PROBE_TIMEOUT_S:g} s"
    st.note_health(node, outcome, now(), why, probe=True)


async def probe_forever(st: RouterState) -> None:
    """Active health checks: a killed instance is seen even when no request goes there, a paused
    one (it accepts connections but never answers) only this way, and a recovered one comes back."""
    # Each probe is its own task: waiting for a round to end let one paused node (every probe of
    # it runs into the timeout) hold back the next probe of every node, so a pause took three
    # timeouts (~6.75 s) to be seen and a kill elsewhere as long. Now a paused node is probed every
    # interval, and it is marked down one timeout after its failures began.
    running: set[asyncio.Task[None]] = set()
    try:
        while True:
            for n in st.health.due_probes(now()):
                t = asyncio.create_task(_probe(st, n))
                running.add(t)
                t.add_done_callback(running.discard)
            await asyncio.sleep(PROBE_INTERVAL_S / 4)
    finally:
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
