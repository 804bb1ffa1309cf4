"""Prefix caches and the control loop with the live services on loopback: cache hits shorten the
prefill and the KV shipped, a cross-cluster cache move puts real bytes on the wire before the
prefill, every control update is recorded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import creds
import pytest

from testbed.config.scenarios import load_scenario
from testbed.core.engine.kvsize import KVModel
from testbed.core.schema.scenario import Scenario
from testbed.deploy.inproc import InProcessBackend
from testbed.deploy.plan import loopback_deployment
from testbed.live.clock import now
from testbed.live.openai_api import block_hashes
from testbed.live.replayer import replay
from testbed.metrics.records import RecordWriter, read_records
from testbed.metrics.summary import summarize
from testbed.run.load import resolve
from testbed.traces.types import Trace, TraceRequest

pytestmark = pytest.mark.app
B = 512


def scenario(policy: dict[str, Any], pd_cache: str = "8TiB") -> Scenario:
    return load_scenario(
        "paper-prfaas",
        {
            "scale": {"speedup": 40, "byte_scale": 1024},
            "serving": {"stream_interval": 1},
            "policy": policy,
            "clusters": [
                {
                    "name": "prfaas",
                    "datacenter": "dc-remote",
                    "kind": "prfaas",
                    "hardware": "h200",
                    "prefill": 2,
                    "decode": 0,
                    "cache_bytes": "4TiB",
                },
                {
                    "name": "pd",
                    "datacenter": "dc-local",
                    "kind": "pd",
                    "hardware": "h20",
                    "prefill": 2,
                    "decode": 2,
                    "cache_bytes": pd_cache,
                },
            ],
        },
    )


async def run(sc: Scenario, trace: Trace, tmp: Path, turns: bool = False) -> list[Any]:
    """Replay `trace`; with `turns`, as a conversation: each request is sent once the one before it
    has finished (its arrival time is a lower bound), as a chat client does, so what a turn finds
    cached does not depend on how fast a busy machine served the turn before it."""
    (tmp / "timeseries").mkdir(parents=True, exist_ok=True)
    dep = loopback_deployment(resolve(sc), str(tmp))
    writer = RecordWriter(tmp / "records.csv")
    async with InProcessBackend(dep) as d:
        if turns:
            t0 = now()
            for r in trace:
                await replay(
                    Trace([r], source=trace.source),
                    d.router.url,
                    writer,
                    sc.scale.speedup,
                    sc.model.name,
                    t0=t0,
                    api_key=d.credentials.api_key,
                )
        else:
            await replay(trace, d.router.url, writer, sc.scale.speedup, sc.model.name, api_key=d.credentials.api_key)
    writer.close()
    (tmp / "run.json").write_text(
        json.dumps({"scale": {"speedup": sc.scale.speedup, "byte_scale": sc.scale.byte_scale}, "t0": None})
    )
    return sorted(read_records(tmp / "records.csv"), key=lambda r: (r.trace_index, r.request_id))


def conversation() -> Trace:
    """Turn 2 extends turn 1 (30K tokens) by 2K; turn 3 extends turn 2 by 30K."""
    t1 = tuple(range(59))  # ceil(30000 / 512)
    t2 = t1[:58] + tuple(range(100, 105))  # 58 full blocks shared, 32K tokens
    t3 = t2[:62] + tuple(range(200, 262))  # 62 full blocks shared, 62K tokens
    return Trace(
        [
            TraceRequest("t1", 0.0, 30000, 8, t1),
            TraceRequest("t2", 8.0, 32000, 8, t2),
            TraceRequest("t3", 16.0, 62000, 8, t3),
        ],
        source="conversation",
    )


async def test_cache_aware_reuses_the_pd_prefix_and_ships_only_what_decode_lacks(tmp_path: Path) -> None:
    sc = scenario({"cache_aware": True, "bandwidth_state": "scarce"})
    kv = KVModel.from_spec(sc.model)
    r1, r2, r3 = await run(sc, conversation(), tmp_path, turns=True)
    assert all(r.outcome == "completed" for r in (r1, r2, r3)), [r.reason for r in (r1, r2, r3)]
    # Turn 1: nothing cached, 30K > t: PrfaaS, the whole KV crosses.
    assert r1.prefill_cluster == "prfaas" and r1.cached_tokens == 0 and r1.crossed_wan
    assert r1.kv_bytes_wire == sum(kv.layer_bytes(30000, 0, 1024))
    # Turn 2: the PD pool got turn 1's KV with its transfer; 32000 - 29696 <= t: PD-P computes 2,304 tokens.
    assert r2.prefill_cluster == "pd" and r2.cached_tokens == 58 * B and not r2.crossed_wan
    assert r2.prefill_modelled < r1.prefill_modelled
    assert r2.kv_bytes_wire == sum(kv.layer_bytes(32000, 58 * B, 1024))
    # Turn 3: 62000 - 31744 > t: PrfaaS (it holds 58 blocks of its own); only KV past PD's 62 blocks crosses.
    assert r3.prefill_cluster == "prfaas" and r3.cached_tokens == 58 * B and r3.decode_cached_tokens == 62 * B
    assert r3.kv_bytes_wire == sum(kv.layer_bytes(62000, 62 * B, 1024))
    s = summarize(tmp_path)
    assert s.cache is not None and s.cache.requests_with_hit == 2 and s.cache.moves == 0


async def test_length_only_routing_ships_every_prompt_whole(tmp_path: Path) -> None:
    sc = scenario({"cache_aware": False})
    kv = KVModel.from_spec(sc.model)
    r1, r2, r3 = await run(sc, conversation(), tmp_path, turns=True)
    assert [r.prefill_cluster for r in (r1, r2, r3)] == ["prfaas"] * 3
    # PrfaaS reuses its own cache, but the decode side's is never consulted: all KV crosses.
    assert r2.cached_tokens == 58 * B and r2.decode_cached_tokens == 0
    assert r2.kv_bytes_wire == sum(kv.layer_bytes(32000, 0, 1024))


async def test_abundant_bandwidth_moves_the_longer_prefix_with_real_bytes(tmp_path: Path) -> None:
    # The PD pool is too small for turn 1's prefix with its state, so after turn 1 only PrfaaS
    # can serve the 58-block prefix: with abundant bandwidth turn 2 goes to PD-P and the cache moves.
    sc = scenario({"cache_aware": True, "bandwidth_state": "abundant"}, pd_cache="256MiB")
    kv = KVModel.from_spec(sc.model)
    r1, r2, _ = await run(sc, conversation(), tmp_path, turns=True)
    assert r2.outcome == "completed", r2.reason
    assert r2.prefill_cluster == "pd" and r2.cached_tokens == 58 * B
    assert r2.cache_move_tokens == 58 * B
    assert r2.cache_move_bytes_paper == kv.incremental(58 * B, 0)
    assert r2.cache_move_bytes_wire == round(kv.incremental(58 * B, 0) / 1024)  # the bytes that arrived
    # The move lands before the compute starts, and after the router asked for it.
    assert r2.times.cache_move_start <= r2.times.cache_move_end <= r2.times.prefill_start
    s = summarize(tmp_path)
    assert s.cache is not None and s.cache.moves == 1 and s.bytes.cache_move_wire == r2.cache_move_bytes_wire
    assert (s.bytes.wan_per_request_paper or 0) > 0


async def test_real_clients_hit_the_cache_by_prompt_content(tmp_path: Path) -> None:
    """No `testbed` extension: the prompt's own token ids give the block hashes, so a client that
    resends a conversation's history reuses it."""
    sc = scenario({"cache_aware": True, "bandwidth_state": "scarce"})
    dep = loopback_deployment(resolve(sc), str(tmp_path))
    history = list(range(3 * B))
    async with InProcessBackend(dep) as d, aiohttp.ClientSession(headers=creds.headers(dep)) as http:
        outs = []
        for prompt in (history, history + list(range(7, 7 + B))):
            async with http.post(
                f"{d.router.url}/v1/completions", json={"model": sc.model.name, "prompt": prompt, "max_tokens": 2}
            ) as r:
                outs.append(await r.json())
    assert outs[0]["testbed"]["cached_tokens"] == 0
    assert outs[1]["testbed"]["cached_tokens"] == 3 * B
    assert block_hashes(tuple(history), B)[:3] == block_hashes(tuple(history + [1]), B)[:3]
    assert block_hashes(b"x" * 4 * B, B) != block_hashes(b"y" * 4 * B, B)


async def test_control_loop_samples_and_status_endpoint(tmp_path: Path) -> None:
    sc = scenario({"bandwidth_aware": True, "control": {"interval_s": 0.4}})
    trace = Trace([TraceRequest(f"r{i}", 0.5 * i, 30000 if i % 2 else 8000, 8, ()) for i in range(12)], source="x")
    recs = await run(sc, trace, tmp_path)
    assert all(r.outcome == "completed" for r in recs)
    lines = [json.loads(x) for x in (tmp_path / "timeseries" / "router.jsonl").read_text().splitlines()]
    metrics = {x["metric"] for x in lines}
    assert {
        "wan_bandwidth_estimate_bps_paper",
        "wan_delivered_bps_paper",
        "planned_load",
        "bandwidth_abundant",
    } <= metrics
    delivered = [x["value"] for x in lines if x["metric"] == "wan_delivered_bps_paper"]
    assert max(delivered) > 0  # PrfaaS egress was seen through TCP_INFO
