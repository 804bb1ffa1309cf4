"""A real PD router in the router's place (`router.kind`, `--router`): what is refused before
anything starts, the standard requests the replayer sends through it, and a replay through
vllm-router on the local backend whose records come from the nodes' own logs."""

from __future__ import annotations

import csv
import importlib.util
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from quiet_host import wait_for_quiet_host
from replay_exit import RAN

from testbed.config.scenarios import ScenarioError, load_scenario
from testbed.core.errors import UserError
from testbed.core.schema.routers import ROUTERS
from testbed.deploy import registry
from testbed.live.openai_api import estimate_tokens
from testbed.live.replayer import standard_prompt
from testbed.metrics.verdict import EXIT_INVALID, EXIT_OK
from testbed.run.load import resolve
from testbed.traces.types import TraceRequest

VLLM_ROUTER = Path(sys.executable).parent / "vllm-router"
HAS_VLLM_ROUTER = VLLM_ROUTER.exists() or shutil.which("vllm-router") is not None
HAS_SGLANG_ROUTER = importlib.util.find_spec("sglang_router") is not None


@pytest.mark.pure
@pytest.mark.parametrize(
    ("router", "words"),
    [
        ({"kind": "vllm-router", "policy": "kv_aware"}, "'kv_aware' is refused: it routes on vLLM's KV-cache events"),
        ({"kind": "vllm-router", "policy": "least_busy"}, "vllm-router has no policy 'least_busy'"),
        ({"kind": "vllm-router", "decode_policy": "kv_aware"}, "router.decode_policy"),
        ({"kind": "sglang-router", "policy": "bucket"}, "prefill side only"),
        ({"kind": "testbed", "policy": "random"}, "for a foreign router"),
    ],
)
def test_routers_and_policies_that_cannot_run_are_refused_at_load(router: dict[str, str], words: str) -> None:
    with pytest.raises(ScenarioError) as e:
        load_scenario("paper-prfaas", {"router": router})
    assert words in str(e.value)


@pytest.mark.pure
def test_every_vllm_router_policy_runs_or_is_refused() -> None:
    _, policies = ROUTERS["vllm-router"]
    ran, refused = [], []
    for p in sorted(policies):
        try:
            load_scenario("paper-prfaas", {"router": {"kind": "vllm-router", "policy": p}})
            ran.append(p)
        except ScenarioError:
            refused.append(p)
    assert refused == ["kv_aware"] and len(ran) == 6


@pytest.mark.pure
def test_every_sglang_router_policy_runs_on_its_side() -> None:
    _, policies = ROUTERS["sglang-router"]
    for p in sorted(policies):
        side = "prefill_policy" if p == "bucket" else "policy"
        load_scenario("paper-prfaas", {"router": {"kind": "sglang-router", side: p}})


@pytest.mark.pure
def test_node_protocol_follows_the_router_and_must_match_it() -> None:
    assert load_scenario("paper-prfaas", {"router": {"kind": "vllm-router"}}).node_protocol == "vllm"
    assert load_scenario("paper-prfaas").node_protocol == "testbed"
    # The testbed's router speaks every protocol; a foreign router only its engine's.
    for proto in ("vllm", "sglang"):
        assert load_scenario("paper-prfaas", {"nodes": {"protocol": proto}}).node_protocol == proto
    with pytest.raises(ScenarioError, match="speaks the 'vllm' protocol"):
        load_scenario("paper-prfaas", {"router": {"kind": "vllm-router"}, "nodes": {"protocol": "sglang"}})


@pytest.mark.pure
def test_backends_without_a_foreign_router_refuse_it_before_starting() -> None:
    rs = resolve(load_scenario("paper-prfaas", {"router": {"kind": "vllm-router"}}))
    with pytest.raises(UserError, match="router.kind='vllm-router'.*backends that can: .*local"):
        registry.refuse_unhonoured("inproc", [rs])
    # Swarm would have to learn the router's address before its health check and scrape its
    # metrics over the overlay: not done, so refused by name.
    with pytest.raises(
        UserError, match="which the swarm backend cannot honour; backends that can: netns, compose, local"
    ):
        registry.refuse_unhonoured("swarm", [rs])
    for backend in ("local", "netns", "compose"):
        registry.refuse_unhonoured(backend, [rs])


@pytest.mark.pure
def test_standard_prompts_have_the_trace_length_and_share_prefixes_exactly_where_hashes_do() -> None:
    bt = 16
    a = TraceRequest("a", 0.0, 40, 4, (7, 8, 9))
    b = TraceRequest("b", 0.0, 37, 4, (7, 8, 5))
    c = TraceRequest("c", 0.0, 10, 4, ())
    pa, pb, pc = (standard_prompt(t, bt) for t in (a, b, c))
    assert [estimate_tokens(p) for p in (pa, pb, pc)] == [40, 37, 10]
    block = bt * 4  # bytes of one block of 16 tokens
    assert pa[: 2 * block] == pb[: 2 * block]  # hashes 7, 8 in both
    assert pa[2 * block : 3 * block] != pb[2 * block : 2 * block + 5 * 4]  # 9 against 5
    assert pc[:4] not in (pa[:4], pb[:4]) or pc[:40] != pa[:40]
    assert standard_prompt(a, bt) == pa  # deterministic


@pytest.mark.app
@pytest.mark.parametrize(
    "router",
    [
        pytest.param(
            "vllm-router",
            marks=pytest.mark.skipif(not HAS_VLLM_ROUTER, reason="vllm-router not installed (routers extra)"),
        ),
        pytest.param(
            "sglang-router",
            marks=pytest.mark.skipif(not HAS_SGLANG_ROUTER, reason="sglang-router not installed (routers extra)"),
        ),
    ],
)
@pytest.mark.parametrize("scheduler", ["fcfs", "vllm"])
def test_a_replay_through_a_real_router_has_its_records_from_the_nodes(
    tmp_path: Path, router: str, scheduler: str
) -> None:
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "testbed", "replay", "--scenario", "paper-prfaas", "--router", router]
    argv += ["--router-policy", "round_robin", "--backend", "local", "--requests", "16", "--out", str(out)]
    argv += ["--set", "scale.speedup=40", "--set", "scale.byte_scale=1024", "--set", "workload.output_tokens=16"]
    # The nodes behind the router batch and chunk their prefills as vLLM does, or run one at a time.
    argv += [f"--set=hardware.{hw}.scheduler.kind={scheduler}" for hw in ("h20", "h200")]
    # Run again only when the testbed marks the run invalid (a loaded host's timers late past the
    # run's own bound), each time once the host has eased.
    for _ in range(3):
        r = subprocess.run([*argv, "--overwrite"], capture_output=True, text=True, timeout=300)
        if r.returncode != EXIT_INVALID:
            break
        wait_for_quiet_host()
    assert r.returncode in RAN, r.stderr[-2000:]
    rows = list(csv.DictReader((out / "records.csv").open()))
    assert len(rows) == 16 and all(x["outcome"] == "completed" for x in rows), [x["reason"] for x in rows]
    stamps = ("prefill_queued", "prefill_start", "prefill_end", "transfer_start", "transfer_end", "decode_admitted")
    stamps += ("decode_first_token", "decode_last_token", "first_token", "last_token")
    for x in rows:
        t = {k: float(x[k]) for k in stamps}
        assert not any(math.isnan(v) for v in t.values()), x
        if router == "vllm-router":  # pulled: each transfer starts only once its prefill has ended
            assert t["prefill_start"] <= t["prefill_end"] <= t["transfer_start"] <= t["transfer_end"]
        else:  # pushed as computed, to a decode node registered before
            assert t["prefill_start"] <= t["transfer_start"] <= t["prefill_end"] <= t["transfer_end"]
        assert t["transfer_end"] <= t["decode_admitted"] <= t["decode_first_token"] <= t["first_token"]
        assert int(x["kv_bytes_wire"]) > 0 and x["prefill_node"] and x["decode_node"]
        assert x["crossed_wan"] == ("1" if x["prefill_cluster"] == "prfaas" else "0")
    # round_robin reaches the remote cluster. Over which of the prefill nodes it spreads is the
    # router's own view of their health: on a host too loaded to time the run (the testbed marked
    # it invalid) sglang-router has set all but one or two aside, and only the pd ones now and then.
    if r.returncode == EXIT_OK:
        assert "prfaas" in {x["prefill_cluster"] for x in rows}
    # The router's own Prometheus metrics, scraped at the end of the replay.
    prom = (out / "router-metrics.prom").read_text()
    assert any(line and not line.startswith("#") for line in prom.splitlines()), prom[:300]
