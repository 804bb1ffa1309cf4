"""Fault injection against the kernel: RSTs the injector crafts reset a live TCP connection at both
ends (also through an outage of the delay line), and replays on the netns backend with a WAN
outage plus resets, and with a decode instance killed, account for every request.

Every object is named `ptbt<random hex>-...` (or the run's own prefix) and removed in `finally`."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import math
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from replay_exit import RAN, until_valid

from testbed.core.schema.linkprofile import LinkParams
from testbed.net import plan as P
from testbed.net.delayline import control
from testbed.net.executor import Executor
from testbed.net.nsexec import nsexec_argv
from testbed.net.nsthread import NetnsLoop
from testbed.net.procs import ProcessGroup
from testbed.net.rst import injector_argv
from testbed.net.teardown import leftovers, teardown
from testbed.net.topology import Topology, build_topology
from testbed.net.wanrouter import start_delayline

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]

HERE = Path(__file__).resolve().parent.parent
LINK = LinkParams(
    rate_bps=200e6, delay_s=0.002, jitter_s=0.0, loss=0.0, loss_correlation=0.0, queue_bytes=512 * 1024, mtu=None
)
KV = 9000
FAST = [
    "--backend",
    "netns",
    "--set",
    "scale.speedup=10",
    "--set",
    "scale.byte_scale=1000",
    "--set",
    "workload.output_tokens=64",
    "--set",
    "serving.stream_interval=8",
]


@contextlib.contextmanager
def two_dcs(method: str, workdir: Path) -> Iterator[tuple[Topology, Path | None]]:
    """Host a0 in dc0, b0 in dc1, the WAN router between (with its delay line for "fallback")."""
    topo = build_topology(
        "ptbt" + secrets.token_hex(3),
        [("a0", "dc0"), ("b0", "dc1")],
        {("dc0", "dc1"): LINK, ("dc1", "dc0"): LINK},
        method,
    )  # type: ignore[arg-type]
    procs = ProcessGroup(workdir / "logs")
    try:
        with Executor() as ex:
            ex.apply(P.plan_up(topo))
        ctl = start_delayline(procs, topo, workdir, None) if method == "fallback" else None
        yield topo, ctl
    finally:
        procs.stop(last=("delayline",))
        teardown(topo.prefix + "-")
        assert leftovers(topo.prefix + "-") == []


async def _serve(host: str, errors: list[str], got: list[int]) -> asyncio.Server:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(1 << 16):
                got[0] += len(data)
            errors.append("eof")
        except OSError as e:
            errors.append(type(e).__name__)
        finally:
            w.close()

    return await asyncio.start_server(handle, host, KV)


async def _send(host: str, until: float) -> str:
    """Stream to host:KV until the connection breaks (the error's name) or `until`."""
    r, w = await asyncio.open_connection(host, KV)
    buf = bytes(1 << 14)
    try:
        while time.time() < until:
            w.write(buf)
            await asyncio.wait_for(w.drain(), max(until - time.time(), 0.01))
            await asyncio.sleep(0.005)
        return "no error"
    except OSError as e:
        return type(e).__name__
    except TimeoutError:
        return "stalled"
    finally:
        w.close()


@pytest.mark.parametrize("method, outage", [("none", False), ("fallback", True)], ids=["plain", "outage"])
def test_injected_rsts_reset_a_live_connection_at_both_ends(tmp_path: Path, method: str, outage: bool) -> None:
    with two_dcs(method, tmp_path) as (topo, ctl):
        a, b = topo.host("a0"), topo.host("b0")
        server_errors: list[str] = []
        received = [0]
        with NetnsLoop(b.netns) as sl, NetnsLoop(a.netns) as cl:
            srv = sl.run(_serve(b.ip, server_errors, received), timeout=5)
            try:
                until = time.time() + 30
                sending = cl.submit(_send(b.ip, until))
                deadline = time.time() + 10
                while received[0] < 1 << 20 and time.time() < deadline:  # established, streaming
                    time.sleep(0.05)
                assert received[0] >= 1 << 20 and not sending.done()
                if outage:
                    assert ctl is not None and control(ctl, {"op": "set", "direction": "*", "loss": 1.0})["ok"]
                    time.sleep(0.3)  # the sender is now retransmitting into the void
                start = time.time() + 0.2
                trace = tmp_path / "rst.jsonl"
                argv = nsexec_argv(
                    topo.wan_ns,
                    injector_argv([d.wan_ifname for d in topo.dcs], KV, start, start + 4, None, "both", trace=trace),
                )
                r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
                events = [json.loads(x) for x in r.stdout.splitlines()]
                assert r.returncode == 0, r.stderr[-2000:]
                assert [e["event"] for e in events] == ["armed", "open", "done"], events
                done = events[-1]
                assert done["connections_targeted"] == 1 and done["rsts_sent"] >= 2, (done, trace.read_text()[:3000])
                assert events[1]["qdisc_bypass"] is True
                # Both ends lost the connection to our RSTs, long before the sender's own deadline.
                assert sending.result(timeout=10) in ("ConnectionResetError", "BrokenPipeError")
                deadline = time.time() + 5
                while not server_errors and time.time() < deadline:
                    time.sleep(0.05)
                assert server_errors == ["ConnectionResetError"], json.dumps(done)
            finally:
                sl.run(_stop(srv), timeout=5)


async def _stop(srv: asyncio.Server) -> None:
    srv.close()
    await srv.wait_closed()


# ---------------------------------------------------------------- replays on the netns backend


def _scenario(tmp_path: Path, faults: str) -> Path:
    f = tmp_path / "faulty.yaml"
    f.write_text(f"extends: {HERE / 'scenarios' / 'paper-prfaas.yaml'}\nname: faulty\nfaults:\n{faults}")
    return f


def _replay(tmp_path: Path, scenario: Path, requests: int, rate: float, *more: str) -> tuple[Path, dict[str, Any]]:
    """The replay's run directory and summary; run again (at most three times in all, each after the
    host has eased) while the testbed marks it invalid, e.g. a fault step that took effect late."""
    out = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "testbed",
        "replay",
        "--scenario",
        str(scenario),
        "--requests",
        str(requests),
        "--rate",
        str(rate),
        "--out",
        str(out),
        "--json",
        *FAST,
        *more,
    ]
    r = until_valid(
        lambda a: subprocess.run(a, capture_output=True, text=True, timeout=400), lambda r: r.returncode, argv
    )
    assert r.returncode in RAN, r.stderr[-3000:]
    return out, json.loads(r.stdout)


def _records(out: Path) -> list[dict[str, str]]:
    with (out / "records.csv").open() as fh:
        return list(csv.DictReader(fh))


def _faults(out: Path) -> dict[tuple[int, str], dict[str, Any]]:
    lines = [json.loads(x) for x in (out / "faults.jsonl").read_text().splitlines()]
    return {(x["fault"], x["phase"]): x for x in lines}


def _f(x: str) -> float:
    return float(x) if x else math.nan


def test_replay_through_a_wan_outage_with_resets(tmp_path: Path) -> None:
    # Speedup 10: requests leave from 5 paper s after t0 (0.5 s wire) until ~35 s; the outage and
    # the reset window cover 20-30 s.
    sc = _scenario(
        tmp_path, "  - {kind: outage, at_s: 20, duration_s: 10}\n  - {kind: tcp_reset, at_s: 20, duration_s: 10}\n"
    )
    out, s = _replay(tmp_path, sc, 60, 2)  # the run ends by itself (the call would time out)
    rows = _records(out)
    assert len(rows) == 60 and len({r["request_id"] for r in rows}) == 60
    assert all(r["outcome"] in ("completed", "failed") for r in rows)
    assert s["requests"]["completed"] + s["requests"]["failed"] == 60
    # Every failure names its kind; a KV transfer between two instances names neither.
    failed = [r for r in rows if r["outcome"] == "failed"]
    assert all(r["failure_kind"] for r in failed), [(r["request_id"], r["reason"]) for r in failed]
    assert all(r["failure_node"] == "" for r in failed if r["failure_kind"] == "kv_transfer_failed")
    print(
        f"outage with resets (netns): {len(failed)} failed, by kind "
        f"{sorted((k, sum(r['failure_kind'] == k for r in failed)) for k in {r['failure_kind'] for r in failed})}"
    )
    f = _faults(out)
    assert set(f) == {(0, "start"), (0, "end"), (1, "start"), (1, "end")}
    assert all(x["outcome"] == "ok" for x in f.values()), {k: (x["t"], x["outcome"]) for k, x in f.items()}
    assert f[(0, "start")]["t"] == pytest.approx(20, abs=1.0) and f[(0, "end")]["t"] == pytest.approx(30, abs=1.0)
    assert f[(0, "start")]["detail"]["links"]["dc-remote->dc-local"]["loss"] == 1.0
    assert f[(0, "end")]["detail"]["links"]["dc-remote->dc-local"]["loss"] == 0.0
    rst = f[(1, "end")]["detail"]
    assert rst["connections_seen"] >= 1 and rst["rsts_sent"] >= 1, rst
    # Nothing crossed the WAN while it was out (the first 50 ms wire let queued packets drain).
    t0 = json.loads((out / "run.json").read_text())["t0"]
    w0, w1 = f[(0, "start")]["t_wire"] + 0.05, f[(0, "end")]["t_wire"]
    kv_bytes = [
        (p["ts"] - t0, p["value"])
        for p in map(json.loads, (out / "timeseries" / "wan.jsonl").open())
        if p["metric"] == "link_bytes" and p["labels"]["link"] == "dc-remote->dc-local"
    ]
    inside = [v for t, v in kv_bytes if w0 <= t <= w1]
    assert len(inside) >= 5 and inside[-1] - inside[0] < 20_000, inside
    assert "## Faults" in (out / "report.md").read_text()


def test_replay_with_a_decode_instance_killed(tmp_path: Path) -> None:
    # Outputs long enough that streams are under way at the kill (those fail) besides ones
    # without a token yet (those are retried).
    out, s = _replay(
        tmp_path,
        _scenario(tmp_path, "  - {kind: kill, at_s: 20, node: pd-d0}\n"),
        60,
        2,
        "--set",
        "workload.output_tokens=512",
    )
    rows = _records(out)
    assert len(rows) == 60 and len({r["request_id"] for r in rows}) == 60
    assert all(r["outcome"] in ("completed", "failed") for r in rows)
    f = _faults(out)
    kill = f[(0, "start")]
    assert kill["outcome"] == "ok" and kill["detail"]["signal"] == "SIGKILL" and kill["detail"]["returncode"] == -9
    assert kill["t"] == pytest.approx(20, abs=1.0)
    # No token came from the killed instance after the kill; every request elsewhere completed. A
    # token sent just before the kill still reaches the client as late as this run delivered any
    # (node's first-token stamp to the client's, its most on a loaded host), plus 50 ms.
    delivery = [_f(r["first_token"]) - _f(r["decode_first_token"]) for r in rows if r["outcome"] == "completed"]
    late = max([d for d in delivery if d == d], default=0.0)
    on_it = [r for r in rows if r["decode_node"] == "pd-d0"]
    assert on_it and all(_f(r["last_token"]) <= kill["t_wire"] + late + 0.05 for r in on_it if r["last_token"]), late
    assert all(r["outcome"] == "failed" for r in on_it if _f(r["routed"]) > kill["t_wire"])
    elsewhere = [r for r in rows if r["decode_node"] and r["decode_node"] != "pd-d0"]
    assert elsewhere and all(r["outcome"] == "completed" for r in elsewhere), [
        (r["request_id"], r["reason"]) for r in elsewhere if r["outcome"] != "completed"
    ]
    assert s["requests"]["failed"] == sum(r["outcome"] == "failed" for r in rows)
    # What failed, as data: every failed request names the kind and the killed instance, and each
    # retried one the instance its first attempt failed at; the summary counts them alike.
    failed = [r for r in rows if r["outcome"] == "failed"]
    assert failed and all((r["failure_kind"], r["failure_node"]) == ("decode_node_down", "pd-d0") for r in failed), [
        (r["request_id"], r["failure_kind"], r["failure_node"], r["reason"]) for r in failed
    ]
    retried = [r for r in rows if r["retries"] != "0"]
    assert all((r["retry_kind"], r["retry_node"]) == ("decode_node_down", "pd-d0") for r in retried), [
        (r["request_id"], r["retry_kind"], r["retry_node"], r["retry_reason"]) for r in retried
    ]
    assert s["requests"]["failure_kinds"] == {"decode_node_down": len(failed)}
    assert s["requests"]["failure_nodes"] == {"pd-d0": len(failed)}
    print(
        f"decode kill (netns): {len(rows)} records, {len(failed)} failed, {len(retried)} retried; failed by "
        f"(kind, node): {sorted({(r['failure_kind'], r['failure_node']) for r in failed})}"
    )
