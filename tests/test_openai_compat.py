"""What vLLM-compatible load generators look at: generated text that tokenizes to
`completion_tokens`, usage with cached tokens, ignore_eos / min_tokens, /version, max_model_len,
vLLM's /metrics names; and the records a held deployment's router writes itself."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

import aiohttp
import creds
import pytest
from hf_tokenizer import byte_level_bpe, english_corpus, save_hf, sentencepiece_bpe, wordpiece
from prom_samples import value

from testbed.config.scenarios import load_scenario
from testbed.core.schema.scenario import Scenario
from testbed.deploy.inproc import InProcessBackend
from testbed.deploy.plan import loopback_deployment
from testbed.live.held import HOLD_KEY, HOLD_PATH
from testbed.live.openai_api import (
    MAX_BODY_DEPTH,
    TOKEN_TEXT,
    Limits,
    RequestError,
    load_body,
    parse,
    usage,
    usage_chunk,
)
from testbed.metrics.records import read_records
from testbed.net.forward import NetnsForwarder
from testbed.run.hold import chunking_note, with_hold_speedup, with_hold_streaming
from testbed.run.load import resolve


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    lines = english_corpus()
    assert len(lines) > 200  # the README is there: a real corpus, not a stub
    return lines


@pytest.mark.pure
@pytest.mark.parametrize("build", [byte_level_bpe, sentencepiece_bpe, wordpiece])
def test_generated_text_tokenizes_to_completion_tokens(corpus: list[str], build: Any) -> None:
    tok = build(corpus)
    for n in (1, 2, 7, 40, 512):
        got = len(tok.encode(TOKEN_TEXT * n).ids)
        assert got == n, (build.__name__, n, got)
    # Streamed in pieces, the same text: a client that tokenizes the joined deltas counts the same.
    assert len(tok.encode("".join(TOKEN_TEXT * k for k in (1, 8, 8, 3))).ids) == 20


@pytest.mark.pure
def test_the_hf_layout_loads_with_transformers_and_counts_the_same(corpus: list[str], tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    d = save_hf(byte_level_bpe(corpus), tmp_path / "tok")
    t = transformers.AutoTokenizer.from_pretrained(str(d))
    assert len(t.encode(TOKEN_TEXT * 40, add_special_tokens=False)) == 40


@pytest.mark.pure
def test_ignore_eos_and_min_tokens_are_accepted_and_checked() -> None:
    base = {"prompt": "x" * 40, "max_tokens": 8}
    req = parse({**base, "ignore_eos": True, "min_tokens": 8}, "completions")
    assert req.output_tokens == 8
    assert parse({**base, "min_tokens": None, "ignore_eos": "false"}, "completions").output_tokens == 8
    for bad, field in (
        ({"min_tokens": 9}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": True}, "min_tokens"),
        ({"ignore_eos": "maybe"}, "ignore_eos"),
    ):
        with pytest.raises(RequestError, match=field):
            parse({**base, **bad}, "completions", Limits())


@pytest.mark.pure
def test_usage_reports_cached_tokens_as_vllm_does() -> None:
    req = parse({"prompt": [1] * 100, "max_tokens": 4}, "completions")
    assert usage(req, 4, 64) == {
        "prompt_tokens": 100,
        "completion_tokens": 4,
        "total_tokens": 104,
        "prompt_tokens_details": {"cached_tokens": 64},
    }
    assert usage_chunk(req, "c", "m", 4)["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


@pytest.mark.pure
def test_a_hold_runs_at_speedup_1_unless_the_user_sets_it() -> None:
    assert with_hold_speedup([]) == ["scale.speedup=1"]
    assert with_hold_speedup(["policy.threshold=3"]) == ["scale.speedup=1", "policy.threshold=3"]
    assert with_hold_speedup(["scale.speedup=4"]) == ["scale.speedup=4"]
    assert with_hold_speedup(["scale={speedup: 2, byte_scale: 64}"]) == ["scale={speedup: 2, byte_scale: 64}"]


@pytest.mark.pure
def test_a_hold_streams_per_token_unless_the_user_sets_the_chunking() -> None:
    assert with_hold_streaming(["scale.speedup=1"]) == ["serving.stream_interval=1", "scale.speedup=1"]
    assert with_hold_streaming(["serving.stream_interval=8"]) == ["serving.stream_interval=8"]
    assert with_hold_streaming(["serving={stream_interval: 4}"]) == ["serving={stream_interval: 4}"]
    from testbed.config.overrides import overrides_for

    assert load_scenario("paper-prfaas").serving.stream_interval == 8
    sets = with_hold_streaming(with_hold_speedup([]))
    assert load_scenario("paper-prfaas", overrides_for("paper-prfaas", sets)).serving.stream_interval == 1
    assert "1 token per SSE chunk" in chunking_note(1)
    assert "8 tokens per SSE chunk" in chunking_note(8) and "stream_interval=1" in chunking_note(8)


def _held_scenario() -> Scenario:
    return load_scenario(
        "paper-prfaas", {"scale": {"speedup": 40, "byte_scale": 1024}, "serving": {"stream_interval": 2}}
    )


async def _sse(
    s: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    out = []
    async with s.post(url, json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.strip()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                out.append(json.loads(line[5:]))
    return out


@pytest.mark.app
async def test_a_held_router_records_every_request_and_answers_like_vllm(tmp_path: Path) -> None:
    sc = _held_scenario()
    dep = loopback_deployment(resolve(sc), str(tmp_path))
    dep.extra[HOLD_KEY] = {"records": "records.csv"}
    (tmp_path / "timeseries").mkdir()
    async with InProcessBackend(dep) as d, aiohttp.ClientSession(headers=creds.headers(dep)) as s:
        url = d.router.url
        async with s.post(url + HOLD_PATH, json={"t0": "soon"}) as r:
            assert r.status == 400
        t0 = time.time()
        async with s.post(url + HOLD_PATH, json={"t0": t0}) as r:
            assert r.status == 200
        prompt = "a long shared system prompt " * 600
        chat = {
            "model": "m",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "min_tokens": 6,
        }
        first = await _sse(s, f"{url}/v1/chat/completions", chat, {"X-Request-Id": "client-1"})
        second = await _sse(s, f"{url}/v1/chat/completions", chat, {"X-Request-Id": "client-2"})
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in second if c.get("choices"))
        assert text == TOKEN_TEXT * 6
        u1, u2 = first[-1]["usage"], second[-1]["usage"]
        assert u1["prompt_tokens_details"]["cached_tokens"] == 0
        # The same prompt again: its full blocks are served from the prefill cluster's cache.
        assert u2["prompt_tokens_details"]["cached_tokens"] > 0.8 * u2["prompt_tokens"]
        assert second[-2]["testbed"]["cached_tokens"] == u2["prompt_tokens_details"]["cached_tokens"]
        async with s.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "min_tokens": 3}) as r:
            assert r.status == 400
        async with s.post(f"{url}/v1/completions", json={"prompt": [5] * 300, "max_tokens": 3}) as r:
            assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 3
        async with s.get(f"{url}/version") as r:
            assert r.status == 200 and "version" in await r.json()
        async with s.get(f"{url}/v1/models") as r:
            assert (await r.json())["data"][0]["max_model_len"] == sc.model.max_context_tokens
        async with s.get(f"{url}/metrics") as r:
            metrics = await r.text()
    model = sc.model.name
    for name, n in (
        ("vllm:time_to_first_token_seconds_count", 3),
        ("vllm:e2e_request_latency_seconds_count", 3),
        ("vllm:request_queue_time_seconds_count", 3),
        ("vllm:request_prefill_time_seconds_count", 3),
        ("vllm:request_decode_time_seconds_count", 3),
        ("vllm:inter_token_latency_seconds_count", 12),
    ):
        assert value(metrics, name, model_name=model, engine="router") == n, name
    decode_nodes = [k for k, n in dep.nodes.items() if n.role == "decode"]
    for node in decode_nodes:
        assert value(metrics, "vllm:kv_cache_usage_perc", model_name=model, engine=node) is not None
        assert value(metrics, "vllm:gpu_cache_usage_perc", model_name=model, engine=node) is not None

    recs = {r.request_id: r for r in read_records(tmp_path / "records.csv")}
    assert len(recs) == 4
    c1, c2 = recs["client-1"], recs["client-2"]
    assert c1.outcome == c2.outcome == "completed" and c2.tokens_received == 6
    assert c2.cached_tokens == u2["prompt_tokens_details"]["cached_tokens"]
    for r in (c1, c2):
        t = r.times
        assert 0 <= t.arrival <= t.routed <= t.prefill_start <= t.first_token <= t.last_token < 60, r
    bad = [r for r in recs.values() if r.outcome == "failed"]
    assert len(bad) == 1 and "min_tokens" in bad[0].reason and math.isnan(bad[0].times.routed)


@pytest.mark.app
async def test_a_client_that_leaves_is_recorded_as_failed(tmp_path: Path) -> None:
    sc = load_scenario("paper-prfaas", {"scale": {"speedup": 4, "byte_scale": 1024}})
    dep = loopback_deployment(resolve(sc), str(tmp_path))
    dep.extra[HOLD_KEY] = {"records": "records.csv"}
    (tmp_path / "timeseries").mkdir()
    async with InProcessBackend(dep) as d:
        async with aiohttp.ClientSession(headers=creds.headers(dep)) as s:
            body = {"prompt": "x" * 4000, "max_tokens": 400, "stream": True}
            async with s.post(f"{d.router.url}/v1/completions", json=body) as r:
                await r.content.readline()  # the first token's chunk, then away
        await asyncio.sleep(0.5)
    # No t0 ever came: the router's start is the base, and the record is still written.
    recs = read_records(tmp_path / "records.csv")
    assert len(recs) == 1 and recs[0].outcome == "failed" and "disconnected" in recs[0].reason
    assert 0 <= recs[0].times.arrival < recs[0].times.first_token


@pytest.mark.app
async def test_the_forwarder_relays_streams_and_half_closes() -> None:
    from aiohttp import web

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        body = await request.read()
        for i in range(3):
            await resp.write(b"%d:" % i + body + b"\n")
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/s", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    fwd = NetnsForwarder("", ("127.0.0.1", port))
    host, fport = await fwd.start()
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(2):  # a kept-alive connection carries a second request
                async with s.post(f"http://{host}:{fport}/s", data=b"x" * 200_000) as r:
                    lines = (await r.read()).splitlines()
                assert [ln[:2] for ln in lines] == [b"0:", b"1:", b"2:"] and len(lines[2]) == 200_002

        # A client that half-closes after its request still gets the whole answer: the EOF is
        # passed on, and the target's reply comes back after it.
        async def echo_after_eof(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.write((await r.read())[::-1])
            await w.drain()
            w.close()

        echo = await asyncio.start_server(echo_after_eof, "127.0.0.1", 0)
        efwd = NetnsForwarder("", ("127.0.0.1", echo.sockets[0].getsockname()[1]))
        ehost, eport = await efwd.start()
        reader, writer = await asyncio.open_connection(ehost, eport)
        writer.write(b"abc" * 50_000)
        writer.write_eof()
        assert await reader.read() == b"cba" * 50_000
        writer.close()
        await efwd.close()
        echo.close()
        dead = NetnsForwarder("", ("127.0.0.1", 1))
        dhost, dport = await dead.start()
        reader, writer = await asyncio.open_connection(dhost, dport)
        assert await reader.read() == b""  # nothing listens there: the client's connection is closed
        writer.close()
        await dead.close()
        assert fwd.connections == 1  # both requests went over one relayed connection
    finally:
        await fwd.close()
        await runner.cleanup()


@pytest.mark.pure
def test_a_client_id_in_the_body_is_cut_like_the_headers() -> None:
    # A 200 kB id in `testbed.request_id` used to be kept whole: 25 of 4 MiB grew the router by
    # 130 MB, and one such id in records.csv made the held run's summary fail.
    req = parse({"prompt": [1] * 10, "max_tokens": 4, "testbed": {"request_id": "x" * 200_000}}, "completions")
    assert req.client_request_id == "x" * 128
    assert (
        parse({"prompt": [1] * 10, "max_tokens": 4, "testbed": {"request_id": ""}}, "completions").client_request_id
        is None
    )


@pytest.mark.pure
def test_a_body_nests_at_most_max_body_depth_and_holds_only_valid_unicode() -> None:
    assert load_body("[" * MAX_BODY_DEPTH + "]" * MAX_BODY_DEPTH) is not None
    assert load_body('{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}  # a surrogate pair is one character
    for bad, words in (
        ("[" * (MAX_BODY_DEPTH + 1) + "]" * (MAX_BODY_DEPTH + 1), "nested"),
        ('{"a": ' * 100_000 + "1" + "}" * 100_000, "nested"),
        ('["\\udc80"]', "lone surrogate"),
        ('{"\\ud800x": 1}', "lone surrogate"),
        ("{nope", "not JSON"),
    ):
        with pytest.raises(RequestError, match=words):
            load_body(bad)


@pytest.mark.app
async def test_the_router_answers_even_its_own_bugs_and_size_limits_with_openai_error_bodies(
    aiohttp_client: Any,
) -> None:
    from aiohttp import web

    from testbed.live.router.handler import openai_errors

    async def broken(request: web.Request) -> web.Response:
        raise RuntimeError("a bug")

    async def sized(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({})

    app = web.Application(middlewares=[openai_errors], client_max_size=1024)
    app.router.add_post("/broken", broken)
    app.router.add_post("/sized", sized)
    client = await aiohttp_client(app)
    for path, data, status in (("/broken", b"{}", 500), ("/sized", b"x" * 4096, 413)):
        r = await client.post(path, data=data)
        assert r.status == status and r.content_type == "application/json"
        assert set((await r.json())["error"]) == {"message", "type", "param", "code"}
