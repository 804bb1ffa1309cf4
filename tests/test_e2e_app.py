"""End-to-end on loopback: router, prefill and decode nodes and the TCP KV layer, all in process."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import creds
import pytest
from prom_samples import value

from testbed.config.scenarios import load_scenario
from testbed.core.engine.kvsize import KVModel
from testbed.core.schema.scenario import Scenario
from testbed.deploy.inproc import InProcessBackend
from testbed.deploy.plan import loopback_deployment
from testbed.live.openai_api import TOKEN_TEXT
from testbed.live.replayer import replay
from testbed.metrics.records import RecordWriter, read_records
from testbed.run.load import resolve
from testbed.traces.loader import trace_from_workload
from testbed.traces.types import Trace

pytestmark = pytest.mark.app


def fast_scenario(requests: int = 24, output: int = 12, name: str = "paper-prfaas") -> Scenario:
    return load_scenario(
        name,
        {
            "scale": {"speedup": 40, "byte_scale": 1024},
            "workload": {"requests": requests, "rate": 4.0, "output_tokens": output, "seed": 3},
            "serving": {"stream_interval": 1},
        },
    )


async def _replay(
    sc: Scenario, trace: Trace, tmp: Path, break_decode: str | None = None, cancel_after_records: int | None = None
) -> list[Any]:
    dep = loopback_deployment(resolve(sc), str(tmp))
    writer = RecordWriter(tmp / "records.csv")
    skip = frozenset({break_decode}) if break_decode else frozenset()
    async with InProcessBackend(dep, skip) as d:
        task = asyncio.ensure_future(
            replay(trace, d.router.url, writer, sc.scale.speedup, sc.model.name, api_key=d.credentials.api_key)
        )
        if cancel_after_records is not None:
            # Stopped by the run's own progress, not by a wall-clock delay: on a fast host the
            # whole trace could finish before any fixed delay, and nothing would be interrupted.
            while writer.count < cancel_after_records and not task.done():
                await asyncio.sleep(0.005)
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    writer.close()
    return read_records(tmp / "records.csv")


async def test_replay_routes_and_accounts_every_request(tmp_path: Path) -> None:
    sc = fast_scenario()
    trace = trace_from_workload(sc.workload)
    recs = await _replay(sc, trace, tmp_path)
    assert sorted(r.request_id for r in recs) == sorted(t.request_id for t in trace)
    assert all(r.outcome == "completed" for r in recs), [r.reason for r in recs if r.outcome != "completed"]
    kv = KVModel.from_spec(sc.model)
    for r in recs:
        assert r.crossed_wan == (r.input_tokens > 19400)
        assert r.prefill_cluster == ("prfaas" if r.input_tokens > 19400 else "pd")
        assert r.kv_bytes_wire == sum(kv.layer_bytes(r.input_tokens, 0, 1024))
        assert r.tokens_received == 12
        # Stage order: a request's life is monotone in time.
        t = r.times
        seq = [
            t.arrival,
            t.routed,
            t.prefill_start,
            t.prefill_end,
            t.transfer_end,
            t.decode_admitted,
            t.first_token,
            t.last_token,
        ]
        assert seq == sorted(seq), (r.request_id, seq)
        assert r.times.transfer_start <= r.times.prefill_end  # layer-wise: KV leaves before compute ends
    assert (tmp_path / "decisions.jsonl").exists()
    assert (tmp_path / "timeseries" / "router.jsonl").exists()


async def test_a_dead_decode_node_is_taken_out_and_its_requests_retried_elsewhere(tmp_path: Path) -> None:
    sc = fast_scenario(requests=20)
    trace = trace_from_workload(sc.workload)
    recs = await _replay(sc, trace, tmp_path, break_decode="pd-d0")
    assert len(recs) == 20 and len({r.request_id for r in recs}) == 20
    # The health probe or the first refused connection takes pd-d0 out of routing; a request
    # routed there before that is retried once on another instance, so every request completes.
    assert all(r.outcome == "completed" for r in recs), [r.reason for r in recs if r.outcome != "completed"]
    assert all(r.decode_node != "pd-d0" for r in recs)
    retried = [r for r in recs if r.retries]
    assert all(r.retries == 1 and "decode node pd-d0" in r.retry_reason for r in retried)


async def test_interrupted_replay_keeps_every_request_once(tmp_path: Path) -> None:
    """Stopped once the first request has finished, while the others are in flight or not yet
    sent: every request is recorded once, the unfinished ones with why."""
    sc = fast_scenario(requests=40, output=200)
    trace = trace_from_workload(sc.workload)
    recs = await _replay(sc, trace, tmp_path, cancel_after_records=1)
    assert len(recs) == 40 and len({r.request_id for r in recs}) == 40
    assert any(r.outcome == "completed" for r in recs)
    reasons = {r.reason.split(":")[0] for r in recs if r.outcome == "failed"}
    assert reasons <= {"interrupted", "not sent"} and reasons


async def test_openai_client_streams_against_router(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    sc = fast_scenario()
    dep = loopback_deployment(resolve(sc), None)
    async with InProcessBackend(dep) as d:
        client = openai.AsyncOpenAI(base_url=f"{d.router.url}/v1", api_key=d.credentials.api_key)
        stream = await client.completions.create(
            model="kimi-linear-1t", prompt="hello " * 400, max_tokens=9, stream=True
        )
        text = ""
        async for ch in stream:
            text += ch.choices[0].text if ch.choices else ""
        assert text.count(TOKEN_TEXT) == 9
        chat = await client.chat.completions.create(
            model="kimi-linear-1t",
            messages=[{"role": "user", "content": "hi there"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts, usage = [], None
        async for ch in chat:
            if ch.choices and ch.choices[0].delta.content:
                parts.append(ch.choices[0].delta.content)
            if ch.usage:
                usage = ch.usage
        assert "".join(parts).count(TOKEN_TEXT) == 5 and usage is not None and usage.completion_tokens == 5
        full = await client.completions.create(
            model="m", prompt=[1, 2, 3] * 1000, max_tokens=3, extra_body={"testbed": {"input_tokens": 50000}}
        )
        assert full.usage is not None and full.usage.prompt_tokens == 50000 and full.usage.completion_tokens == 3
        models = await client.models.list()
        assert models.data[0].id == "kimi-linear-1t"
        await client.close()


async def test_router_metrics_and_bad_requests(tmp_path: Path) -> None:
    sc = fast_scenario()
    dep = loopback_deployment(resolve(sc), None)
    async with InProcessBackend(dep) as d, aiohttp.ClientSession(headers=creds.headers(dep)) as s:
        async with s.post(f"{d.router.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 200
        async with s.post(f"{d.router.url}/v1/completions", json={"prompt": "x", "max_tokens": -1}) as r:
            assert r.status == 400 and "max_tokens" in (await r.json())["error"]["message"]
        async with s.post(f"{d.router.url}/v1/completions", data=b"{not json") as r:
            assert r.status == 400
        async with s.get(f"{d.router.url}/metrics") as r:
            text = await r.text()
        router = {"model_name": sc.model.name, "engine": "router"}
        assert value(text, "vllm:time_to_first_token_seconds_count", **router) == 1
        assert value(text, "testbed_requests_routed_total", cluster="pd", **router) == 1
        node = d.nodes["pd-d0"].http.url
        async with s.get(f"{node}/metrics") as r:
            assert "vllm:kv_cache_usage_perc" in await r.text()


async def test_router_refuses_hostile_json_with_an_openai_400(tmp_path: Path) -> None:
    # A 100k-deep array raised RecursionError in the JSON parser and a lone surrogate (valid JSON
    # escape, invalid Unicode) raised UnicodeEncodeError hashing the prompt: both were 500s.
    sc = fast_scenario()
    dep = loopback_deployment(resolve(sc), None)
    deep_prompt = "[" * 200 + "1" + "]" * 200
    cases = [
        ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, "nested"),
        ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b', "max_tokens": 2}', "nested"),
        ("/v1/completions", f'{{"prompt": {deep_prompt}, "max_tokens": 2}}'.encode(), "nested"),
        ("/v1/completions", b'{"prompt": "a\\udc80b", "max_tokens": 2}', "surrogate"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
            "surrogate",
        ),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "testbed": {"request_id": "\\udfff"}}', "surrogate"),
        ("/v1/completions", b'{"\\udc80": 1, "prompt": "x", "max_tokens": 2}', "surrogate"),
        ("/v1/completions", b'{"prompt": "\xff", "max_tokens": 2}', "not JSON"),
    ]
    async with InProcessBackend(dep) as d, aiohttp.ClientSession(headers=creds.headers(dep)) as s:
        for path, raw, words in cases:
            async with s.post(d.router.url + path, data=raw, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400, (raw[:80], r.status, await r.text())
                err = (await r.json())["error"]
                assert words in err["message"] and err["type"] == "invalid_request_error", err
        # A surrogate pair is one valid character, and the router still serves.
        ok = b'{"prompt": "\\ud83d\\ude00 hi", "max_tokens": 2}'
        async with s.post(d.router.url + "/v1/completions", data=ok) as r:
            assert r.status == 200, await r.text()


async def test_nodes_reject_bad_requests_naming_the_field(tmp_path: Path) -> None:
    sc = fast_scenario()
    dep = loopback_deployment(resolve(sc), None)
    async with InProcessBackend(dep) as d, aiohttp.ClientSession(headers=creds.headers(dep)) as s:
        p, dn = d.nodes["pd-p0"].http.url, d.nodes["pd-d0"].http.url
        cases = [
            (
                f"{p}/prefill",
                {"request_id": "x", "transfer_id": 1, "input_tokens": 0, "cached_tokens": 0, "decode_node": "pd-d0"},
                "input_tokens",
            ),
            (
                f"{p}/prefill",
                {"request_id": "x", "transfer_id": 1, "input_tokens": 10, "cached_tokens": 0, "decode_node": "nope"},
                "decode_node",
            ),
            *(
                (
                    f"{p}/prefill",
                    {
                        "request_id": "x",
                        "transfer_id": 1,
                        "input_tokens": 10,
                        "cached_tokens": 0,
                        "decode_node": "pd-d0",
                        "prefix_after": bad,
                    },
                    "prefix_after",
                )
                for bad in (7, ["a"], None, "r" * 5000)
            ),
            (f"{dn}/decode", {"request_id": "", "transfer_id": 1}, "request_id"),
            (
                f"{dn}/decode",
                {"request_id": "y", "transfer_id": True, "input_tokens": 1, "output_tokens": 1, "kv_bytes_paper": 0},
                "transfer_id",
            ),
        ]
        for url, body, field in cases:
            async with s.post(url, json=body) as r:
                assert r.status == 400 and field in (await r.json())["error"]["message"], (url, body)
        async with s.post(f"{p}/prefill", data=b"[1, 2") as r:
            assert r.status == 400


async def test_a_rerun_into_the_same_directory_starts_from_a_clean_slate(tmp_path: Path) -> None:
    """Series and decisions are appended as they come: a second run into the same directory
    must not mix in the first run's (a user reruns `make replay`)."""
    from testbed.run.runner import run_replay_async

    sc = fast_scenario(requests=6)
    trace = trace_from_workload(sc.workload)
    (tmp_path / "mine.txt").write_text("not the testbed's")
    for _ in range(2):
        res = await run_replay_async(resolve(sc), trace, tmp_path, "inproc")
    t0 = json.loads((tmp_path / "run.json").read_text())["t0"]
    stamps = [json.loads(line)["ts"] for line in (tmp_path / "timeseries" / "router.jsonl").read_text().splitlines()]
    assert stamps and min(stamps) >= t0 - 1.0
    decisions = [line for line in (tmp_path / "decisions.jsonl").read_text().splitlines() if '"decision"' in line]
    assert len(decisions) == 6
    assert res.summary.requests.total == 6
    assert (tmp_path / "mine.txt").read_text() == "not the testbed's"


@pytest.mark.skipif(
    not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() != 0,
    reason="mounting a small tmpfs (a full disk) needs root",
)
async def test_a_full_disk_stops_every_service_and_says_so(tmp_path: Path) -> None:
    """A run whose directory fills up used to raise in its first teardown step and leave every
    service of the local backend running; now every step runs and the error is one line."""
    import os
    import subprocess

    from testbed.core.errors import UserError
    from testbed.run.runner import run_replay_async

    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(small)], check=True)
    try:
        sc = fast_scenario(requests=60)
        trace = trace_from_workload(sc.workload)
        with pytest.raises(UserError, match="could not be written"):
            await run_replay_async(resolve(sc), trace, small / "run", "local")
        # No service of the run is left: their command lines name the run directory.
        left = subprocess.run(["pgrep", "-f", str(small / "run")], capture_output=True, text=True)
        assert left.stdout.strip() == "", left.stdout
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
        assert os.path.ismount(str(small)) is False
