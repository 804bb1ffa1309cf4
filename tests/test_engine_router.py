"""The testbed's router over the engines' PD protocols asks the nodes as the real routers do: the
client requests vllm-router 0.1.17 and sglang-router 0.3.2 passed on (tests/fixtures/routers)
are sent through the testbed's router in front of mock nodes that record what they receive; what
the router changes in each request, per stage, must be what the real router changed, field for
field. The one addition is the decode's stream with usage in every chunk (vLLM's and SGLang's
`stream_options.continuous_usage_stats`), how the router counts tokens."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from testbed.config.scenarios import load_scenario
from testbed.deploy.inproc import make_service_app
from testbed.deploy.plan import loopback_deployment
from testbed.live.deployment import Deployment
from testbed.live.router.engines import DECODE_STREAM
from testbed.run.load import resolve

pytestmark = pytest.mark.app

FIXTURES = Path(__file__).parent / "fixtures" / "routers"
ENGINE_ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate")


def deployment(tmp_path: Path, protocol: str) -> Deployment:
    sc = load_scenario(
        "paper-prfaas",
        {"scale": {"speedup": 40, "byte_scale": 1024}, "nodes": {"protocol": protocol}},
    )
    return loopback_deployment(resolve(sc), str(tmp_path))


def recorded(name: str) -> list[dict[str, Any]]:
    return [e for e in json.loads((FIXTURES / f"{name}.json").read_text()) if e.get("phase") == "request"]


def recorder(node: str, role: str, seen: list[dict[str, Any]]) -> Callable[..., Awaitable[web.StreamResponse]]:
    """What a node receives on its engine routes, and its JSON answer (a fake at the app's edge)."""

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method != "POST" or request.path not in ENGINE_ROUTES:
            passed: web.StreamResponse = await handler(request)
            return passed
        e: dict[str, Any] = {
            "node": node,
            "role": role,
            "path": request.path,
            "headers": {k.lower(): v for k, v in request.headers.items()},
        }
        e["body"] = await request.json()
        seen.append(e)
        resp: web.StreamResponse = await handler(request)
        if isinstance(resp, web.Response) and resp.body is not None and resp.content_type == "application/json":
            e["answer"] = json.loads(bytes(resp.body))  # type: ignore[arg-type]
        return resp

    return record


async def serve(dep: Deployment, seen: list[dict[str, Any]]) -> list[web.AppRunner]:
    runners = []
    order = sorted(dep.nodes, key=lambda n: dep.nodes[n].role != "decode") + ["router"]
    for nid in order:
        app = make_service_app(dep, nid)
        if nid != "router":
            app.middlewares.insert(0, recorder(nid, dep.nodes[nid].role, seen))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        runners.append(runner)
        ep = dep.router if nid == "router" else dep.nodes[nid].http
        for host in dep.http_binds(nid):
            await web.TCPSite(runner, host, ep.port).start()
    return runners


def changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What a router did to a request: fields added or changed (value), removed (None)."""
    out = {k: v for k, v in after.items() if before.get(k, object()) != v}
    return out | {k: None for k in before if k not in after}


def client_body(dec: dict[str, Any], protocol: str) -> dict[str, Any]:
    """The client's request a real router passed on: its decode stage less the protocol's fields."""
    drop = {"kv_transfer_params"} if protocol == "vllm" else {"bootstrap_host", "bootstrap_port", "bootstrap_room"}
    return {k: v for k, v in dec["body"].items() if k not in drop}


async def through_router(dep: Deployment, path: str, body: dict[str, Any]) -> None:
    hdrs = {"Authorization": f"Bearer {dep.credentials.api_key}"}
    async with aiohttp.ClientSession() as s, s.post(dep.router.url + path, json=body, headers=hdrs) as r:
        text = await r.text()
        assert r.status == 200, text
        assert "error" not in text, text


def pairs(rec: list[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> list[dict[str, dict[str, Any]]]:
    by: dict[Any, dict[str, dict[str, Any]]] = {}
    for e in rec:
        by.setdefault(key(e), {})[e["worker"] if "worker" in e else e["role"]] = e
    return list(by.values())


async def test_the_router_asks_vllm_nodes_as_vllm_router_does(tmp_path: Path) -> None:
    dep = deployment(tmp_path, "vllm")
    seen: list[dict[str, Any]] = []
    real = pairs(recorded("vllm-router"), lambda e: e["headers"]["X-Request-ID"])
    runners = await serve(dep, seen)
    try:
        for pair in real:
            client = client_body(pair["decode"], "vllm")
            seen.clear()
            await through_router(dep, pair["decode"]["path"], client)
            ours = pairs(seen, lambda e: e["headers"].get("x-request-id"))
            assert len(ours) == 1 and set(ours[0]) == {"prefill", "decode"}, seen
            pre, dec = ours[0]["prefill"], ours[0]["decode"]
            assert pre["path"] == dec["path"] == pair["prefill"]["path"]
            # Stage 1: exactly vllm-router's changes (max_tokens 1, min_tokens 1, unstreamed, the
            # transfer parameters asking for a remote decode).
            assert changes(client, pre["body"]) == changes(client, pair["prefill"]["body"])
            # Stage 2: the prefill's kv_transfer_params verbatim, and the decode streamed with usage.
            ktp = pre["answer"]["kv_transfer_params"]
            assert changes(client, pair["decode"]["body"]).keys() == {"kv_transfer_params"}
            ours_dec = changes(client, dec["body"])
            assert ours_dec.pop("kv_transfer_params") == ktp
            assert ours_dec == {k: v for k, v in DECODE_STREAM.items() if client.get(k) != v}
            for e in (pre, dec):
                assert e["headers"]["content-type"].startswith("application/json")
            assert pre["headers"]["x-request-id"] == dec["headers"]["x-request-id"]
            assert pre["node"] != dec["node"]
    finally:
        for r in reversed(runners):
            await r.cleanup()


async def test_the_router_asks_sglang_nodes_as_sglang_router_does(tmp_path: Path) -> None:
    dep = deployment(tmp_path, "sglang")
    seen: list[dict[str, Any]] = []
    # SGLang's native /generate is not a route of the testbed's router (its clients speak OpenAI's).
    real = pairs(recorded("sglang-router"), lambda e: e["body"]["bootstrap_room"])
    real = [p for p in real if p["decode"]["path"] != "/generate"]
    assert len(real) == 3
    runners = await serve(dep, seen)
    try:
        for pair in real:
            assert pair["prefill"]["body"] == pair["decode"]["body"]  # the same request to both
            client = client_body(pair["decode"], "sglang")
            seen.clear()
            await through_router(dep, pair["decode"]["path"], client)
            ours = pairs(seen, lambda e: e["body"].get("bootstrap_room"))
            assert len(ours) == 1 and set(ours[0]) == {"prefill", "decode"}, seen
            pre, dec = ours[0]["prefill"], ours[0]["decode"]
            assert pre["path"] == dec["path"] == pair["decode"]["path"]
            assert pre["body"] == dec["body"]
            mine = changes(client, dec["body"])
            stream = {k: mine.pop(k) for k in DECODE_STREAM if k in mine}
            assert stream == {k: v for k, v in DECODE_STREAM.items() if client.get(k) != v}
            assert mine.keys() == changes(client, pair["decode"]["body"]).keys()
            p = dep.nodes[pre["node"]].http
            assert (mine["bootstrap_host"], mine["bootstrap_port"]) == (p.host, p.port)
            assert isinstance(mine["bootstrap_room"], int) and 0 <= mine["bootstrap_room"] < 1 << 64
    finally:
        for r in reversed(runners):
            await r.cleanup()
