"""The mock nodes speak vLLM's PD protocol (`nodes.protocol: vllm`) as the real router calls it:
the requests vllm-router 0.1.17 sent two stand-in workers were recorded
(tools/record_router_requests.py -> tests/fixtures/routers/vllm-router.json) and are replayed
here against a mock prefill and decode pair; every field the router reads must be answered as
vLLM's NixlConnector answers it, and every transfer must start after its prefill has ended."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from testbed.config.scenarios import load_scenario
from testbed.deploy.inproc import InProcessBackend
from testbed.deploy.plan import loopback_deployment
from testbed.live.deployment import Deployment
from testbed.run.load import resolve

pytestmark = pytest.mark.app

FIXTURES = Path(__file__).parent / "fixtures" / "routers"
# What vLLM's NixlConnector puts in a prefill's answer, and the type of each (vllm-router copies
# the object verbatim into the decode request; the decode engine reads these).
NIXL_PREFILL_ANSWER = {
    "do_remote_prefill": bool,
    "do_remote_decode": bool,
    "remote_engine_id": str,
    "remote_block_ids": list,
    "remote_request_id": str,
    "remote_host": str,
    "remote_port": int,
    "tp_size": int,
}
# Headers the router sends that a worker sees (the rest are transport: host, length, encoding).
KEPT_HEADERS = ("Content-Type", "Authorization", "X-Request-ID", "Accept")


def vllm_deployment(tmp_path: Path, hold_s: float = 480.0, router: str = "vllm-router") -> Deployment:
    sc = load_scenario(
        "paper-prfaas",
        {
            "scale": {"speedup": 40, "byte_scale": 1024},
            "workload": {"requests": 4, "rate": 4.0, "output_tokens": 4, "seed": 3},
            "router": {"kind": router},
            "nodes": {"kv_hold_timeout_s": hold_s},
        },
    )
    return loopback_deployment(resolve(sc), str(tmp_path))


def recorded(name: str) -> list[dict[str, Any]]:
    return [e for e in json.loads((FIXTURES / f"{name}.json").read_text()) if e["phase"] != "client"]


def stages(tmp_path: Path) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for f in sorted((tmp_path / "stages").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            d = json.loads(line)
            out.setdefault(d["request_id"], []).append(d)
    return out


async def _sse(r: aiohttp.ClientResponse) -> list[Any]:
    events: list[Any] = []
    async for raw in r.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.parametrize("fixture", ["vllm-router", "vllm-router-power_of_two"])
async def test_vllm_router_requests_replayed_against_the_mock_nodes(tmp_path: Path, fixture: str) -> None:
    dep = vllm_deployment(tmp_path)
    p, d = dep.nodes["pd-p0"].http.url, dep.nodes["pd-d0"].http.url
    rec = recorded(fixture)
    async with InProcessBackend(dep, skip=frozenset({"router"})), aiohttp.ClientSession() as s:
        # Start-up: /health, /metrics (and /get_load for power_of_two) on every worker.
        for e in (e for e in rec if e["phase"] == "startup"):
            async with s.request(e["method"], (p if e["worker"] == "prefill" else d) + e["path"]) as r:
                assert r.status == 200, (e["path"], await r.text())
                if e["path"] == "/get_load":
                    assert set((await r.json())[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
        # Per request: stage 1 to the prefill, its kv_transfer_params copied into stage 2.
        reqs = [e for e in rec if e["phase"] == "request"]
        assert [e["worker"] for e in reqs] == ["prefill", "decode"] * (len(reqs) // 2)
        rids = []
        for pre, dec in zip(reqs[::2], reqs[1::2], strict=True):
            hdrs = {k: v for k, v in pre["headers"].items() if k in KEPT_HEADERS}
            assert hdrs["X-Request-ID"] == dec["headers"]["X-Request-ID"]
            rids.append(hdrs["X-Request-ID"])
            async with s.post(p + pre["path"], json=pre["body"], headers=hdrs) as r:
                assert r.status == 200, await r.text()
                ans = await r.json()
            ktp = ans["kv_transfer_params"]
            assert set(ktp) == set(NIXL_PREFILL_ANSWER), ktp
            for k, t in NIXL_PREFILL_ANSWER.items():
                assert isinstance(ktp[k], t), (k, ktp[k])
            assert ktp["do_remote_prefill"] is True and ktp["do_remote_decode"] is False
            assert (ktp["remote_host"], ktp["remote_port"]) == (
                dep.nodes["pd-p0"].http.host,
                dep.nodes["pd-p0"].http.port,
            )
            assert ans["choices"][0]["finish_reason"] == "length" and ans["usage"]["completion_tokens"] == 1
            body = dict(dec["body"], kv_transfer_params=ktp)
            async with s.post(d + dec["path"], json=body, headers=hdrs) as r:
                assert r.status == 200, await r.text()
                want = dec["body"]["max_tokens"]
                if dec["body"].get("stream"):
                    assert r.headers["Content-Type"].startswith("text/event-stream")
                    evs = await _sse(r)
                    assert evs[-1] == "[DONE]"
                    chunks = evs[:-1]
                    chat = dec["path"].endswith("/chat/completions")
                    assert {c["object"] for c in chunks} == {"chat.completion.chunk" if chat else "text_completion"}
                    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
                    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
                else:
                    out = await r.json()
                    assert out["object"] == "text_completion" and out["usage"]["completion_tokens"] == want
    st = stages(tmp_path)
    for rid in rids:
        by = {x["stage"]: x for x in st[rid]}
        assert set(by) == {"prefill", "kv_pull", "decode"}, st[rid]
        pre, pull, dec = by["prefill"], by["kv_pull"], by["decode"]
        # vLLM's discipline: the KV moves only after the prefill has ended, and arrives whole.
        assert pre["prefill_start"] <= pre["prefill_end"] <= dec["kv_pull_sent"] <= pull["transfer_start"]
        assert (
            pull["transfer_start"] <= dec["transfer_first_received"] <= dec["transfer_end"] <= dec["decode_first_token"]
        )
        assert dec["kv_bytes_received"] == pull["kv_bytes_wire"] == pre["kv_bytes_held"] > 0
        assert dec["decode_first_token"] <= dec["decode_last_token"] and dec["output_tokens"] > 0


async def test_held_kv_is_freed_after_the_hold_timeout_and_a_late_pull_fails(tmp_path: Path) -> None:
    dep = vllm_deployment(tmp_path, hold_s=0.2)
    p, d = dep.nodes["pd-p0"].http.url, dep.nodes["pd-d0"].http.url
    pre = next(e for e in recorded("vllm-router") if e["phase"] == "request" and e["worker"] == "prefill")
    async with InProcessBackend(dep, skip=frozenset({"router"})), aiohttp.ClientSession() as s:
        async with s.post(p + pre["path"], json=pre["body"], headers={"X-Request-ID": "late"}) as r:
            ktp = (await r.json())["kv_transfer_params"]
        async with s.get(p + "/metrics") as r:
            assert "testbed_kv_held_bytes" in await r.text()
        await asyncio.sleep(0.6)
        body = {"model": "m", "prompt": "hello world", "max_tokens": 2, "kv_transfer_params": ktp}
        async with s.post(d + "/v1/completions", json=body, headers={"X-Request-ID": "late"}) as r:
            assert r.status >= 500
            assert "no KV held" in (await r.json())["error"]["message"]
    assert any(x["stage"] == "kv_expired" for x in stages(tmp_path)["late"])


async def test_requests_the_pair_cannot_serve_are_refused_saying_why(tmp_path: Path) -> None:
    dep = vllm_deployment(tmp_path)
    p, d = dep.nodes["pd-p0"].http.url, dep.nodes["pd-d0"].http.url
    plain = {"model": "m", "prompt": "hi", "max_tokens": 2}
    async with InProcessBackend(dep, skip=frozenset({"router"})), aiohttp.ClientSession() as s:
        for url, words in ((p, "do_remote_decode"), (d, "do_remote_prefill")):
            async with s.post(url + "/v1/completions", json=plain) as r:
                assert r.status == 400 and words in (await r.json())["error"]["message"]
        # A wrong key is refused; an empty Bearer (what vllm-router sends) passes on to the handler.
        async with s.post(p + "/v1/completions", json=plain, headers={"Authorization": "Bearer nope"}) as r:
            assert r.status == 401
        # The testbed's own routes still need the run secret.
        async with s.post(p + "/testbed/kv/pull", json={}) as r:
            assert r.status == 403
        # The testbed router's hints name their field when they are not what it writes.
        remote = {**plain, "kv_transfer_params": {"do_remote_decode": True}}
        for hint, field in (
            ({"cached_tokens": -1}, "testbed.cached_tokens"),
            ({"prefix_after": 5}, "testbed.prefix_after"),
            ({"prefix_after": "x" * 5000}, "testbed.prefix_after"),
        ):
            body = {**remote, "testbed": {"input_tokens": 100, "output_tokens": 2, **hint}}
            async with s.post(p + "/v1/completions", json=body) as r:
                assert r.status == 400 and field in (await r.json())["error"]["message"], (hint, await r.text())


async def test_sglang_router_requests_replayed_against_the_mock_nodes(tmp_path: Path) -> None:
    """sglang-router posts each request to a prefill and a decode node at once with a bootstrap
    room; the decode registers with the prefill's bootstrap service and the prefill pushes."""
    dep = vllm_deployment(tmp_path, router="sglang-router")
    pn = dep.nodes["pd-p0"].http
    p, d = pn.url, dep.nodes["pd-d0"].http.url
    rec = recorded("sglang-router")
    async with InProcessBackend(dep, skip=frozenset({"router"})), aiohttp.ClientSession() as s:
        for e in (e for e in rec if e["phase"] == "startup"):
            # The deployment starts the router without --api-key: it sends workers no key.
            async with s.request(e["method"], (p if e["worker"] == "prefill" else d) + e["path"]) as r:
                assert r.status == 200, (e["path"], await r.text())
                if e["path"] == "/server_info":
                    assert (await r.json())["disaggregation_mode"] == e["worker"]
        rooms: dict[int, dict[str, dict[str, Any]]] = {}
        for e in (e for e in rec if e["phase"] == "request"):
            rooms.setdefault(e["body"]["bootstrap_room"], {})[e["worker"]] = e
        assert rooms and all(set(v) == {"prefill", "decode"} for v in rooms.values())

        async def post(url: str, e: dict[str, Any]) -> tuple[int, str, str]:
            # As the deployment's router would send it: the bootstrap port is the prefill's HTTP port.
            body = dict(e["body"], bootstrap_host=pn.host, bootstrap_port=pn.port)
            hdrs = {k: v for k, v in e["headers"].items() if k in ("Content-Type", "Accept")}
            async with s.post(url + e["path"], json=body, headers=hdrs) as r:
                return r.status, r.headers.get("Content-Type", ""), await r.text()

        for room, pair in rooms.items():
            (ps, _, ptxt), (ds, dtype, dtxt) = await asyncio.gather(post(p, pair["prefill"]), post(d, pair["decode"]))
            assert ps == 200 and ds == 200, (ptxt, dtxt)
            dec = pair["decode"]
            stream = dec["body"].get("stream")
            if stream:
                assert dtype.startswith("text/event-stream") and dtxt.rstrip().endswith("data: [DONE]")
                last = json.loads(dtxt.rstrip().split("\n\n")[-2][len("data: ") :])
            else:
                last = json.loads(dtxt)
            if dec["path"] == "/generate":
                assert last["meta_info"]["finish_reason"]["type"] == "length"
                assert last["meta_info"]["completion_tokens"] == dec["body"]["sampling_params"]["max_new_tokens"]
                assert last["meta_info"]["id"] == f"room-{room}"
            else:
                assert last["choices"][0]["finish_reason"] == "length" and last["id"] == f"room-{room}"
    st = stages(tmp_path)
    for room in rooms:
        by = {x["stage"]: x for x in st[f"room-{room}"]}
        pre, dec = by["prefill"], by["decode"]
        # SGLang's discipline: the decode registered first, the KV is pushed as layers are computed.
        assert dec["registered"] <= pre["prefill_start"] <= pre["transfer_start"] <= pre["prefill_end"]
        assert pre["transfer_start"] <= dec["transfer_first_received"] <= dec["transfer_end"]
        assert dec["kv_bytes_received"] == pre["kv_bytes_wire"] > 0
