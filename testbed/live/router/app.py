"""The router's aiohttp application: its routes, and a lifecycle that opens the pooled session
to the nodes, builds the state, registers the scrape-time gauges and runs the loops."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from testbed.live.auth import api_key_middleware, run_secret_middleware
from testbed.live.common import REGISTRY_KEY, SCRAPE_KEY, ServiceConfig, add_common_routes
from testbed.live.held import HELD_KEY, HOLD_PATH, HeldRecords, hold_records_path, post_hold
from testbed.live.router.handler import (
    chat_completions,
    completions,
    info,
    model,
    models,
    openai_errors,
    responses,
    version,
)
from testbed.live.router.loops import start_loops
from testbed.live.router.probes import refresh_kv_usage
from testbed.live.router.state import STATE, new_state
from testbed.live.router.vllm_metrics import add_state_gauges, make_metrics
from testbed.metrics.series_format import SeriesWriter


def _control(path: str) -> bool:
    """The router's routes for the deployment's own runner: the hold's t0, a swarm run's files."""
    return path == HOLD_PATH or path.startswith("/testbed/files")


def make_app(cfg: ServiceConfig) -> web.Application:
    sc = cfg.deployment.scenario
    creds = cfg.deployment.credentials
    # The key guards the OpenAI routes (/v1/...), as vLLM's --api-key does; the run secret the
    # hold's t0; /health, /metrics, /version and /testbed/info stay open.
    guards = [api_key_middleware(creds.api_key), run_secret_middleware(creds.run_secret, guarded=_control)]
    app = web.Application(client_max_size=sc.serving.max_body_bytes, middlewares=[*guards, openai_errors])
    reg = CollectorRegistry()
    app[REGISTRY_KEY] = reg
    metrics = make_metrics(reg, sc.model.name, sc.model.max_context_tokens)
    held_path = hold_records_path(cfg.deployment.extra, cfg.deployment.run_dir)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        # One pooled session to every node; no per-host cap (open-loop load is unbounded).
        # The run secret on every call: the nodes serve their deployment's router only.
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
            headers=creds.runner_headers(),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
        rd = cfg.deployment.run_dir
        decisions = SeriesWriter(Path(rd) / "decisions.jsonl" if rd else None, "router")
        st = new_state(cfg, session, metrics, decisions, HeldRecords(held_path) if held_path is not None else None)
        app[STATE] = st
        if st.held is not None:
            app[HELD_KEY] = st.held
        add_state_gauges(reg, st, metrics, cfg.scale, cfg.deployment.inter_dc.rate)
        series = SeriesWriter(cfg.series_path(), "router")
        tasks = start_loops(st, series, decisions)
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await session.close()
        series.close()
        decisions.close()
        if st.held is not None:
            st.held.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{id:.+}", model)
    app.router.add_get("/testbed/info", info)
    app.router.add_get("/version", version)
    if held_path is not None:
        app.router.add_post(HOLD_PATH, post_hold)
    app[SCRAPE_KEY] = refresh_kv_usage
    add_common_routes(app)
    return app
