"""A client that reuses a request id (the X-Request-Id header or `testbed.request_id`) gets a
suffixed id, so nodes never see two requests under one id and a held router's records have one
row per request: the id book (pure), and a real client against the in-process router (app)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import creds
import pytest
from prom_samples import value

from testbed.config.overrides import overrides_for
from testbed.core.router.request_ids import RequestIds
from testbed.deploy.inproc import InProcessBackend
from testbed.deploy.plan import loopback_deployment
from testbed.live.held import HOLD_KEY, HOLD_PATH
from testbed.metrics.records import read_records
from testbed.run.load import load


@pytest.mark.pure
def test_a_taken_id_gets_the_first_free_dup_suffix() -> None:
    ids = RequestIds()
    assert ids.claim("a") == "a"
    assert ids.claim("a") == "a~dup1"  # "a" in flight
    ids.release("a")
    assert ids.claim("a") == "a~dup2"  # "a" finished, still recorded; a~dup1 in flight
    assert ids.claim("a~dup3") == "a~dup3"  # a client's own id that looks like a suffix
    assert ids.claim("a") == "a~dup4"  # ... is skipped, not handed out twice
    assert ids.claim("a~dup1") == "a~dup1~dup1"
    assert ids.renamed == 4 and ids.in_flight == 5
    for rid in ("a~dup1", "a~dup2", "a~dup3", "a~dup4", "a~dup1~dup1"):
        ids.release(rid)
    assert ids.in_flight == 0
    with pytest.raises(KeyError, match="not in flight"):
        ids.release("a")


@pytest.mark.pure
def test_finished_ids_are_forgotten_oldest_first_past_the_window() -> None:
    ids = RequestIds(remember=2)
    for rid in ("x", "y", "z"):
        ids.release(ids.claim(rid))
    assert not ids.taken("x") and ids.taken("y") and ids.taken("z")
    assert ids.claim("x") == "x" and ids.claim("y") == "y~dup1"
    # In flight is never forgotten, however many finish meanwhile.
    live = ids.claim("live")
    for i in range(10):
        ids.release(ids.claim(f"n{i}"))
    assert ids.claim("live") == "live~dup1" and live == "live"
    with pytest.raises(ValueError):
        RequestIds(remember=-1)


async def _stream(s: aiohttp.ClientSession, url: str, rid: str, max_tokens: int, via: str) -> dict[str, Any]:
    """One streaming completion; the `testbed` record its final chunk carries."""
    body: dict[str, Any] = {"prompt": [7] * 3000, "max_tokens": max_tokens, "stream": True}
    headers = {}
    if via == "header":
        headers["X-Request-Id"] = rid
    else:
        body["testbed"] = {"request_id": rid}
    ext: dict[str, Any] = {}
    text = ""
    async with s.post(f"{url}/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            obj = json.loads(line[5:])
            assert "error" not in obj, obj
            text += "".join(c.get("text", "") for c in obj.get("choices", []))
            ext = obj.get("testbed", ext)
    return {"text": text, **ext}


@pytest.mark.app
async def test_a_reused_request_id_does_not_collide_in_flight_or_in_the_records(tmp_path: Path) -> None:
    # One decode node: requests under one id would meet there (it keeps its streams by id).
    sets = ["scale.speedup=20", "scale.byte_scale=1024", "serving.stream_interval=2", "clusters.1.decode=1"]
    dep = loopback_deployment(load("paper-prfaas", overrides_for("paper-prfaas", sets)), str(tmp_path))
    dep.extra[HOLD_KEY] = {"records": "records.csv"}
    (tmp_path / "timeseries").mkdir()
    async with InProcessBackend(dep) as d, aiohttp.ClientSession(headers=creds.headers(dep)) as s:
        url = d.router.url
        async with s.post(url + HOLD_PATH, json={"t0": time.time()}) as r:
            assert r.status == 200
        # Three at once under one id, by header and by the extension field: all in flight together.
        same = await asyncio.wait_for(
            asyncio.gather(*(_stream(s, url, "bench-1", 24, via) for via in ("header", "header", "body"))), 20
        )
        # The id again once they have finished: it is recorded, so still taken.
        later = await _stream(s, url, "bench-1", 4, "header")
        async with s.get(f"{url}/metrics") as r:
            metrics = await r.text()
    for x in (*same, later):
        assert x["outcome"] == "completed", x
    assert [len(x["text"]) for x in same] == [len(" the") * 24] * 3
    assert sorted(x["request_id"] for x in same) == ["bench-1", "bench-1~dup1", "bench-1~dup2"]
    assert later["request_id"] == "bench-1~dup3"
    assert value(metrics, "testbed_request_ids_renamed_total", engine="router") == 3

    recs = read_records(tmp_path / "records.csv")
    assert sorted(r.request_id for r in recs) == ["bench-1", "bench-1~dup1", "bench-1~dup2", "bench-1~dup3"]
    assert all(r.outcome == "completed" and r.tokens_received == r.output_tokens for r in recs)
    # Every routing decision names a different request.
    decided = [
        json.loads(line)["labels"]["request_id"]
        for line in (tmp_path / "decisions.jsonl").read_text().splitlines()
        if json.loads(line)["metric"] == "decision"
    ]
    assert sorted(decided) == sorted(r.request_id for r in recs)
