"""The router under failures and hostile requests: a decode node dying mid-stream, limits,
deadlines, clients that leave, request bodies of every shape."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import creds
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed.config.scenarios import load_scenario
from testbed.core.schema.scenario import Scenario
from testbed.deploy.inproc import InProcessBackend
from testbed.deploy.plan import loopback_deployment
from testbed.live.openai_api import Limits, RequestError, parse
from testbed.run.load import resolve

app = pytest.mark.app
pure = pytest.mark.pure


def _scenario(**serving: Any) -> Scenario:
    return load_scenario(
        "paper-homogeneous",
        {
            "scale": {"speedup": 40, "byte_scale": 1024},
            "clusters": [
                {"name": "pd", "datacenter": "local", "kind": "pd", "hardware": "h20", "prefill": 1, "decode": 1}
            ],
            "serving": {"stream_interval": 1, **serving},
        },
    )


async def _sse(resp: aiohttp.ClientResponse) -> list[Any]:
    events: list[Any] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@app
async def test_a_decode_node_dying_mid_stream_ends_the_stream_with_an_error_event_and_the_story() -> None:
    sc = _scenario()
    dep = loopback_deployment(resolve(sc), None)
    be = InProcessBackend(dep)
    async with be, aiohttp.ClientSession(headers=creds.headers(dep)) as s:
        body = {"prompt": "x", "max_tokens": 400, "stream": True, "testbed": {"input_tokens": 2000}}
        async with s.post(f"{dep.router.url}/v1/completions", json=body) as r:
            first = await r.content.readline()  # the first token chunk is out
            assert first.startswith(b"data: ")
            await be.stop_service("pd-d0")
            events = await _sse(r)
    assert events[-1] == "[DONE]"
    err = events[-2]
    assert "error" in err and "pd-d0" in err["error"]["message"]
    rec = err["testbed"]
    assert rec["outcome"] == "failed" and rec["decode_node"] == "pd-d0" and rec["prefill_node"] == "pd-p0"
    assert rec["prefill_end"] is not None and rec["decode_first_token"] is not None
    assert (rec["failure_kind"], rec["failure_node"]) == ("decode_node_down", "pd-d0")  # as data


@app
async def test_limits_deadline_and_request_shapes() -> None:
    sc = _scenario(deadline_s=2.0, deadline_floor_wire_s=0.01, max_output_tokens=1500)
    sc = sc.model_copy(update={"model": sc.model.model_copy(update={"max_context_tokens": 100_000})})
    dep = loopback_deployment(resolve(sc), None)
    async with InProcessBackend(dep), aiohttp.ClientSession(headers=creds.headers(dep)) as s:
        url = f"{dep.router.url}/v1/completions"
        async with s.post(url, json={"prompt": "x", "testbed": {"input_tokens": 10**15}}) as r:
            assert r.status == 400 and "maximum context length is 100000" in (await r.json())["error"]["message"]
        async with s.post(url, json={"prompt": "x", "max_tokens": 1501}) as r:
            assert r.status == 400 and "[1, 1500]" in (await r.text())
        # 2 s paper of deadline: 400 tokens of 25 ms each cannot finish in it.
        async with s.post(url, json={"prompt": "x", "max_tokens": 400, "stream": "false"}) as r:
            assert r.status == 502
            got = await r.json()
            assert "deadline exceeded" in got["error"]["message"] and "object" not in got
            assert (got["testbed"]["failure_kind"], got["testbed"]["failure_node"]) == ("deadline_exceeded", "")
        chat = f"{dep.router.url}/v1/chat/completions"
        msgs = [{"role": "assistant", "content": None}, {"role": "user", "content": "hi"}]
        async with s.post(chat, json={"messages": msgs, "max_tokens": 2}) as r:
            assert r.status == 200, await r.text()


@app
async def test_a_client_that_leaves_cancels_its_prefill_on_the_node() -> None:
    sc = _scenario()
    dep = loopback_deployment(resolve(sc), None)
    async with InProcessBackend(dep), aiohttp.ClientSession(headers=creds.headers(dep)) as s:
        url = f"{dep.router.url}/v1/completions"
        # ~100K tokens: a long prefill; the client leaves while it runs.
        task = asyncio.create_task(
            s.post(url, json={"prompt": "x", "max_tokens": 4, "testbed": {"input_tokens": 100_000}})
        )
        await asyncio.sleep(0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.3)
        async with s.get(f"{dep.nodes['pd-p0'].http.url}/status") as r:
            status = await r.json()
        assert status["queue_depth"] == 0 and status["running"] == 0, status
        # The node is free for the next request at once.
        async with s.post(url, json={"prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 200


@pure
@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=5),
        max_leaves=20,
    ),
    st.sampled_from(["completions", "chat"]),
)
def test_any_json_body_parses_or_is_a_request_error(body: Any, kind: str) -> None:
    for b in (
        body,
        {"prompt": body, "max_tokens": body},
        {"messages": body, "stream": body},
        {"prompt": "x", "testbed": body},
        {"messages": [{"role": "user", "content": body}]},
    ):
        try:
            req = parse(b, kind, Limits(1 << 20, 65536))
        except RequestError:
            continue
        assert 1 <= req.output_tokens <= 65536 and req.input_tokens + req.output_tokens <= 1 << 20
