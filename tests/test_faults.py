"""Fault injection: the schema and timeline, link and service-time effects, the RST planner and
its packets, the scheduler against a fake backend, the nodes' fault endpoint, the report's
Faults section, and node faults on the local backend end to end."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from matplotlib.figure import Figure

from testbed.config.scenarios import ScenarioError, load_scenario
from testbed.core.engine.prefill_queue import PrefillJob, PrefillQueue
from testbed.core.fault_timeline import SlowDown, fault_steps, fault_timeline, faulted_links
from testbed.core.record import RequestRecord, StageTimes
from testbed.core.schema.linkprofile import LinkParams
from testbed.core.schema.scenario import TcpResetFault
from testbed.deploy.fault_injection import FaultScheduler, FaultTarget
from testbed.metrics.fault_effects import draw_fault_bands, fault_effects, faults_section, load_faults
from testbed.metrics.records import write_records
from testbed.net.tcp_reset import ACK, RST, SYN, ResetPlanner, Segment, seq_after, seq_newest

HERE = Path(__file__).resolve().parent.parent
S, R = ("10.231.1.10", 40000), ("10.231.0.10", 9000)  # sender (remote DC), receiver (KV port)
RMAC0, RMAC1 = "02:00:00:00:00:00", "02:00:00:00:00:01"  # the router on dc0 (local), dc1 (remote)
SMAC, DMAC = "02:aa:00:00:00:01", "02:bb:00:00:00:01"


def _faulty(tmp_path: Path, faults: str, base: str = "paper-prfaas.yaml") -> Path:
    f = tmp_path / "faulty.yaml"
    f.write_text(f"extends: {HERE / 'scenarios' / base}\nname: faulty\nfaults:\n{faults}")
    return f


# ---------------------------------------------------------------- schema


@pytest.mark.pure
def test_shipped_fault_scenarios_load() -> None:
    kill = fault_timeline(load_scenario("faults/decode-kill"))
    assert [(e.kind, e.target, e.start_s, e.end_s) for e in kill] == [("kill", "pd-d0", 37.0, None)]
    pk = fault_timeline(load_scenario("faults/prefill-kill"))
    assert [(e.kind, e.node) for e in pk] == [("kill", "prfaas-p0")]
    wan = fault_timeline(load_scenario("faults/wan-outage-resets"))
    assert [(e.kind, e.start_s, e.end_s) for e in wan] == [("outage", 37.0, 67.0), ("tcp_reset", 37.0, 67.0)]
    assert set(wan[0].links) == {("dc-remote", "dc-local"), ("dc-local", "dc-remote")}


@pytest.mark.pure
@pytest.mark.parametrize(
    "fault, field, words",
    [
        ("{kind: kill, at_s: 1, node: pd-d9}", "faults.0.node", "no instance 'pd-d9'"),
        ("{kind: pause, at_s: 1, duration_s: 2, cluster: nope, role: decode, index: 0}", "faults.0.cluster", "nope-d0"),
        (
            "{kind: pause, at_s: 1, duration_s: 2, cluster: prfaas, role: decode, index: 0}",
            "faults.0.role",
            "prfaas-d0",
        ),
        (
            "{kind: slow, at_s: 1, duration_s: 2, factor: 3, cluster: pd, role: decode, index: 7}",
            "faults.0.index",
            "pd-d7",
        ),
        ("{kind: partition, at_s: 1, duration_s: 2, src: dc-remote, dst: dc-mars}", "faults.0.dst", "dc-mars"),
        ("{kind: outage, at_s: 1, duration_s: 2, between: [dc-local, dc-local]}", "faults.0.between", "two different"),
        ("{kind: kill, at_s: 1}", "faults.0.kill", "name the instance"),
        ("{kind: kill, at_s: 1, node: pd-d0, cluster: pd}", "faults.0.kill", "not both"),
        ("{kind: outage, at_s: 1, duration_s: 0}", "faults.0.outage.duration_s", "greater than 0"),
        ("{kind: slow, at_s: 1, duration_s: 1, factor: 0.5, node: pd-d0}", "faults.0.slow.factor", "greater than 1"),
        ("{kind: tcp_reset, at_s: 1, duration_s: 1, count: 0}", "faults.0.tcp_reset.count", ">= 1"),
        ("{kind: explode, at_s: 1}", "faults.0", "does not match"),
        # YAML reads .inf and .nan as floats: an endless outage or a fault that never starts.
        ("{kind: outage, at_s: 1, duration_s: .inf}", "faults.0.outage.duration_s", "finite number"),
        ("{kind: pause, at_s: .inf, duration_s: 2, node: pd-d0}", "faults.0.pause.at_s", "finite number"),
        ("{kind: restart, at_s: 1, down_s: .inf, node: pd-d0}", "faults.0.restart.down_s", "finite number"),
        ("{kind: rate_drop, at_s: 1, duration_s: .nan, factor: 0.5}", "faults.0.rate_drop.duration_s", "finite number"),
    ],
)
def test_bad_faults_fail_at_load_naming_the_field(tmp_path: Path, fault: str, field: str, words: str) -> None:
    f = _faulty(tmp_path, f"  - {{kind: kill, at_s: 0, node: pd-d1}}\n  - {fault}\n")  # the bad one is faults.1
    with pytest.raises(ScenarioError) as e:
        load_scenario(f)
    msg = str(e.value)
    assert str(f) in msg and f"field '{field.replace('faults.0', 'faults.1')}'" in msg and words in msg, msg


@pytest.mark.pure
def test_link_faults_need_two_datacenters(tmp_path: Path) -> None:
    f = _faulty(tmp_path, "  - {kind: tcp_reset, at_s: 1, duration_s: 1}\n", "paper-homogeneous.yaml")
    with pytest.raises(ScenarioError, match=r"field 'faults\.0\.kind'.*two datacenters"):
        load_scenario(f)


# ---------------------------------------------------------------- timeline and effects


@pytest.mark.pure
def test_timeline_sorted_with_ends_and_steps(tmp_path: Path) -> None:
    sc = load_scenario(
        _faulty(
            tmp_path,
            """\
  - {kind: outage, at_s: 20, duration_s: 5}
  - {kind: restart, at_s: 10, down_s: 4, cluster: pd, role: decode, index: 1}
  - {kind: pause, at_s: 10, duration_s: 10, node: pd-p0}
  - {kind: partition, at_s: 2, duration_s: 1, src: dc-local, dst: dc-remote}
  - {kind: kill, at_s: 25, node: prfaas-p1}
  - {kind: rate_drop, at_s: 3, duration_s: 2, factor: 0.25, between: [dc-remote, dc-local]}
""",
        )
    )
    tl = fault_timeline(sc)
    assert [(e.index, e.kind, e.target, e.start_s, e.end_s) for e in tl] == [
        (3, "partition", "dc-local->dc-remote", 2.0, 3.0),
        (5, "rate_drop", "dc-remote<->dc-local", 3.0, 5.0),
        (1, "restart", "pd-d1", 10.0, 14.0),  # ties keep the file's order
        (2, "pause", "pd-p0", 10.0, 20.0),
        (0, "outage", "wan", 20.0, 25.0),
        (4, "kill", "prfaas-p1", 25.0, None),
    ]
    assert tl[0].links == (("dc-local", "dc-remote"),)
    steps = [(s.t_s, s.phase, s.event.index) for s in fault_steps(tl)]
    assert steps == sorted(steps, key=lambda x: (x[0], x[1] != "end", x[2]))
    # At 20 s the pause ends before the outage starts; at 25 the outage ends before the kill.
    assert steps[steps.index((20.0, "end", 2)) + 1] == (20.0, "start", 0)
    assert steps.index((25.0, "end", 0)) < steps.index((25.0, "start", 4))


def _params(rate: float = 1e9) -> LinkParams:
    return LinkParams(rate, 0.01, 0.0, 0.0, 0.0, 1 << 20, None)


@pytest.mark.pure
def test_faulted_links(tmp_path: Path) -> None:
    sc = load_scenario(
        _faulty(
            tmp_path,
            """\
  - {kind: outage, at_s: 1, duration_s: 5}
  - {kind: partition, at_s: 1, duration_s: 5, src: dc-local, dst: dc-remote}
  - {kind: rate_drop, at_s: 1, duration_s: 5, factor: 0.5}
  - {kind: tcp_reset, at_s: 1, duration_s: 5}
""",
        )
    )
    out_, part, drop, rst = fault_timeline(sc)
    fwd, back = ("dc-remote", "dc-local"), ("dc-local", "dc-remote")
    base = {fwd: _params(), back: _params(2e9)}
    assert faulted_links(base, []) == base
    assert faulted_links(base, [rst]) == base  # resets act on connections, not on shaping
    p = faulted_links(base, [part])
    assert p[back].loss == 1.0 and p[fwd] == base[fwd]
    both = faulted_links(base, [drop, out_])
    assert both[fwd].rate_bps == 0.5e9 and both[back].rate_bps == 1e9
    assert both[fwd].loss == both[back].loss == 1.0
    assert base[fwd].loss == 0.0  # the base is left alone


@pytest.mark.pure
def test_slowdown_and_a_slowed_prefill_queue() -> None:
    s = SlowDown()
    assert s.at(5.0) == 1.0
    s.set(3.0, until=10.0)
    assert s.at(9.99) == 3.0 and s.at(10.0) == 1.0
    s.set(2.0, None)
    assert s.at(1e12) == 2.0
    with pytest.raises(ValueError):
        s.set(0.0, None)
    q = PrefillQueue()
    q.push(PrefillJob("a", 100, 0, 2.0), 0.0)
    job = q.start_next(1.0, slow=3.0)
    assert job is not None and job.duration == 6.0 and q.backlog(1.0) == 6.0


# ---------------------------------------------------------------- the RST planner


def _seg(
    src: tuple[str, int], dst: tuple[str, int], seq: int, ack: int, flags: int = ACK, n: int = 0, outgoing: bool = False
) -> Segment:
    """A segment seen at the router, arriving (from `src`) or leaving (toward `dst`)."""
    return Segment(outgoing, src, dst, seq, ack, flags, n)


@pytest.mark.pure
def test_sequence_space_wraps() -> None:
    assert seq_after(5, (1 << 32) - 5) and not seq_after((1 << 32) - 5, 5)
    assert seq_newest(None, 7) == 7 and seq_newest((1 << 32) - 1, 3) == 3


@pytest.mark.pure
def test_planner_resets_both_ends_with_their_own_numbers() -> None:
    p = ResetPlanner(9000)
    # The sender's segment arriving: its ack is its rcv_nxt, an exact RST to the sender; the
    # receiver holds at least up to its seq (a guess, until better is known).
    out = p.observe(_seg(S, R, 1000, 5000, n=1460), 0.0)
    assert [(r.to, r.dst, r.src, r.seq, r.exact) for r in out] == [
        ("receiver", R, S, 1000, False),
        ("sender", S, R, 5000, True),
    ]
    # The same segment leaving toward the receiver: the receiver will hold up to 2460.
    out = p.observe(_seg(S, R, 1000, 5000, n=1460, outgoing=True), 0.01)
    assert [(r.to, r.dst, r.src, r.seq, r.exact) for r in out] == [("receiver", R, S, 2460, False)]
    # The receiver's (challenge) ACK says 2460 exactly: same number, not repeated this soon.
    assert p.observe(_seg(R, S, 5000, 2460), 0.02) == []
    # ... but repeated once the receiver is still talking a while later, now marked exact.
    again = p.observe(_seg(R, S, 5000, 2460), 0.2)
    assert [(r.to, r.seq, r.exact) for r in again] == [("receiver", 2460, True)]
    # A new number (the receiver got more data) gets a new RST at once.
    assert [(r.to, r.seq) for r in p.observe(_seg(R, S, 5000, 4000), 0.21)] == [("receiver", 4000)]
    # An RST arriving from the receiver afterwards: its socket is gone.
    p.observe(_seg(R, S, 5000, 0, flags=RST), 0.3)
    s = p.summary()
    assert s["connections_seen"] == s["connections_targeted"] == 1
    assert s["rsts_sent"] == 5 and s["rsts_exact"] == 3 and s["ends_answered"] == 1


@pytest.mark.pure
def test_planner_guesses_a_silent_receiver_from_the_retransmissions() -> None:
    # An outage: only the sender's retransmissions reach the router, never the receiver.
    p = ResetPlanner(9000)
    out = p.observe(_seg(S, R, 7000, 300, n=1000), 0.0)
    assert [(r.to, r.seq, r.exact) for r in out] == [("receiver", 7000, False), ("sender", 300, True)]
    # Its challenge ACK (arriving, before the outage drops it) gives the exact number.
    out = p.observe(_seg(R, S, 300, 9000), 0.01)
    assert [(r.to, r.seq, r.exact) for r in out] == [("receiver", 9000, True)]


@pytest.mark.pure
def test_planner_counts_connections_and_picks_ends() -> None:
    p = ResetPlanner(9000, count=1, ends="receiver")
    other = (S[0], 40001)
    out = p.observe(_seg(S, R, 10, 20, n=100, outgoing=True), 0.0)
    assert [(r.to, r.seq) for r in out] == [("receiver", 110)]
    assert p.observe(_seg(other, R, 7, 9, n=100, outgoing=True), 0.0) == []  # the count is spent
    assert p.observe(_seg(S, R, 110, 20, n=100), 0.5) == []  # the sender is never a target
    assert p.summary()["connections_targeted"] == 1 and p.summary()["connections_seen"] == 2


@pytest.mark.pure
def test_planner_waits_for_an_established_connection_and_ignores_other_ports() -> None:
    p = ResetPlanner(9000)
    assert p.observe(_seg(S, R, 100, 0, flags=SYN), 0.0) == []
    assert p.observe(_seg(R, S, 500, 101, flags=SYN | ACK), 0.0) == []
    assert p.observe(_seg((S[0], 1), (R[0], 8000), 1, 1, n=10), 0.0) == []
    # The handshake taught both ends' numbers: the first ACK gets an exact RST to each.
    assert [(r.to, r.seq, r.exact) for r in p.observe(_seg(S, R, 101, 501), 0.1)] == [
        ("receiver", 101, True),
        ("sender", 501, True),
    ]
    assert p.summary()["connections_seen"] == 1


@pytest.mark.pure
def test_planner_caps_rsts_per_end() -> None:
    p = ResetPlanner(9000, ends="sender", max_per_end=3, min_gap_s=0.0)
    sent = sum(len(p.observe(_seg(S, R, 1, 1000 + i), float(i))) for i in range(10))
    assert sent == 3


# ---------------------------------------------------------------- packets (scapy)


def _bpf(prog: list[tuple[int, int, int, int]], pkt: bytes) -> int:
    """A classic-BPF interpreter for the instructions kv_filter uses; the accepted length."""
    a = x = pc = 0
    while True:
        code, jt, jf, k = prog[pc]
        pc += 1
        if code == 0x28:
            a = int.from_bytes(pkt[k : k + 2], "big")
        elif code == 0x30:
            a = pkt[k]
        elif code == 0x48:
            a = int.from_bytes(pkt[x + k : x + k + 2], "big")
        elif code == 0xB1:
            x = 4 * (pkt[k] & 0xF)
        elif code == 0x15:
            pc += jt if a == k else jf
        elif code == 0x45:
            pc += jt if a & k else jf
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"opcode {code:#x}")


@pytest.mark.pure
def test_kv_filter_keeps_headers_of_kv_segments_only() -> None:
    from scapy.layers.inet import IP, TCP, UDP
    from scapy.layers.l2 import ARP, Ether

    from testbed.net.rst import SNAPLEN, kv_filter

    prog = kv_filter(9000)
    e = Ether(src=SMAC, dst=RMAC1)
    assert _bpf(prog, bytes(e / IP(src=S[0], dst=R[0]) / TCP(sport=S[1], dport=9000) / (b"x" * 3000))) == SNAPLEN
    assert _bpf(prog, bytes(e / IP(src=R[0], dst=S[0], options=b"\x01" * 8) / TCP(sport=9000, dport=S[1]))) == SNAPLEN
    assert _bpf(prog, bytes(e / IP() / TCP(sport=8000, dport=41000))) == 0
    assert _bpf(prog, bytes(e / IP() / UDP(sport=9000, dport=9000))) == 0
    assert _bpf(prog, bytes(e / IP(frag=10) / TCP(sport=9000, dport=9000))) == 0
    assert _bpf(prog, bytes(e / ARP())) == 0


@pytest.mark.pure
def test_crafted_rst_is_what_the_planner_asked_and_checksums() -> None:
    from scapy.layers.inet import IP, TCP
    from scapy.layers.l2 import Ether

    from testbed.net.rst import craft, segment_of

    r = ResetPlanner(9000).observe(_seg(S, R, 1000, 5000, n=1460), 0.0)[-1]
    assert r.to == "sender"
    frame = Ether(craft(r, RMAC1, SMAC))
    ip, tcp = frame[IP], frame[TCP]
    assert (frame.src, frame.dst, ip.src, ip.dst, tcp.sport, tcp.dport) == (RMAC1, SMAC, R[0], S[0], R[1], S[1])
    assert tcp.flags == "R" and tcp.seq == 5000
    ref = IP(bytes(ip))
    del ref.chksum, ref[TCP].chksum
    rebuilt = IP(bytes(ref))
    assert (rebuilt.chksum, rebuilt[TCP].chksum) == (ip.chksum, tcp.chksum)
    # Read back as the sniffer would, on the interface it leaves by.
    got = segment_of(frame, RMAC1)
    assert got is not None and got[1] == SMAC
    assert got[0].outgoing and got[0].flags & RST and got[0].payload_len == 0
    # A truncated capture of a full segment still gives its payload length (from IP).
    big = Ether(src=SMAC, dst=RMAC1) / IP(src=S[0], dst=R[0]) / TCP(sport=S[1], dport=9000, seq=7) / (b"x" * 1000)
    got = segment_of(Ether(bytes(big)[:80]), RMAC1)
    assert got is not None and got[1] == SMAC
    assert not got[0].outgoing and got[0].payload_len == 1000 and got[0].seq == 7


# ---------------------------------------------------------------- the scheduler


class FakeNodes:
    def __init__(self, log: list[tuple[str, str, float]]) -> None:
        self.log = log

    async def _do(self, what: str, node: str) -> dict[str, Any]:
        self.log.append((what, node, time.time()))
        return {"did": what}

    async def kill(self, node: str) -> dict[str, Any]:
        return await self._do("kill", node)

    async def pause(self, node: str) -> dict[str, Any]:
        return await self._do("pause", node)

    async def resume(self, node: str) -> dict[str, Any]:
        return await self._do("resume", node)

    async def start(self, node: str) -> dict[str, Any]:
        return await self._do("start", node)

    async def slow(self, node: str, factor: float, until: float | None) -> dict[str, Any]:
        return await self._do(f"slow {factor:g} {'until' if until else 'cleared'}", node)


class FakeLinks:
    def __init__(self, log: list[tuple[str, str, float]]) -> None:
        self.log = log

    async def set_link_faults(self, active: list[Any]) -> dict[str, Any]:
        self.log.append(("links", ",".join(e.kind for e in active), time.time()))
        return {"active": len(active)}


class FakeResets:
    async def inject(
        self, spec: TcpResetFault, start: float, end: float, on_open: Callable[[dict[str, Any]], None]
    ) -> dict[str, Any]:
        await asyncio.sleep(max(start - time.time(), 0))
        on_open({"event": "open", "t": time.time()})
        await asyncio.sleep(max(end - time.time(), 0))
        return {"event": "done", "t": time.time(), "rsts_sent": 2, "connections_targeted": 1, "connections_seen": 3}


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.app
async def test_scheduler_runs_each_fault_on_time_and_logs_it(tmp_path: Path) -> None:
    sc = load_scenario(
        _faulty(
            tmp_path,
            """\
  - {kind: kill, at_s: 4, node: pd-d0}
  - {kind: pause, at_s: 2, duration_s: 4, node: pd-d1}
  - {kind: restart, at_s: 2, down_s: 2, node: pd-d2}
  - {kind: slow, at_s: 1, duration_s: 2, factor: 3, node: pd-p0}
  - {kind: outage, at_s: 3, duration_s: 3}
  - {kind: rate_drop, at_s: 4, duration_s: 1, factor: 0.5}
  - {kind: tcp_reset, at_s: 3, duration_s: 1}
""",
        )
    )
    calls: list[tuple[str, str, float]] = []
    speedup = 10.0  # 1 paper s = 100 ms wire
    t0 = time.time() + 0.05
    target = FaultTarget("fake", FakeNodes(calls), FakeLinks(calls), FakeResets())
    sched = FaultScheduler(fault_timeline(sc), target, t0, speedup, tmp_path / "faults.jsonl")
    late = 0.0  # the event loop's worst lateness meanwhile (wire s): what a busy host adds to any timer

    async def probe() -> None:
        nonlocal late
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.002)
            late = max(late, time.monotonic() - t - 0.002)

    watch = asyncio.create_task(probe())
    sched.start()
    await sched.wait()
    await sched.stop()
    watch.cancel()
    slack = 0.4 + late * speedup  # paper s: 40 ms wire of scheduling noise, plus what the host held back
    got = sorted(((what, who, (t - t0) * speedup) for what, who, t in calls), key=lambda c: c[2])
    want = [
        ("slow 3 until", "pd-p0", 1),
        ("pause", "pd-d1", 2),
        ("kill", "pd-d2", 2),
        ("slow 1 cleared", "pd-p0", 3),
        ("links", "outage", 3),
        ("kill", "pd-d0", 4),
        ("start", "pd-d2", 4),
        ("links", "outage,rate_drop", 4),
        ("links", "outage", 5),
        ("resume", "pd-d1", 6),
        ("links", "", 6),
    ]
    assert len(got) == len(want), got
    for what, who, at in want:
        match = next((g for g in got if g[:2] == (what, who) and abs(g[2] - at) <= slack), None)
        assert match is not None, (what, who, at, got, slack)
        got.remove(match)
    lines = _lines(tmp_path / "faults.jsonl")
    assert all(x["outcome"] == "ok" for x in lines)
    by = {(x["fault"], x["phase"]): x for x in lines}
    assert len(by) == len(lines) == 13  # a start per fault, an end for all but the kill
    assert by[(0, "start")]["target"] == "pd-d0" and by[(0, "start")]["at_s"] == 4
    assert by[(6, "start")]["kind"] == "tcp_reset" and by[(6, "end")]["detail"]["rsts_sent"] == 2
    for x in lines:  # executed on time (paper seconds after t0), within scheduling noise
        assert x["t"] == pytest.approx(x["at_s"], abs=slack), (x, slack)


@pytest.mark.app
async def test_scheduler_logs_unsupported_skipped_and_resumes_a_paused_node_at_stop(tmp_path: Path) -> None:
    sc = load_scenario(
        _faulty(
            tmp_path,
            """\
  - {kind: pause, at_s: 0, duration_s: 1000, node: pd-d1}
  - {kind: kill, at_s: 1000, node: pd-d0}
  - {kind: outage, at_s: 0, duration_s: 1}
  - {kind: tcp_reset, at_s: 0, duration_s: 1}
""",
        )
    )
    calls: list[tuple[str, str, float]] = []
    sched = FaultScheduler(
        fault_timeline(sc), FaultTarget("plain", FakeNodes(calls)), time.time(), 100.0, tmp_path / "faults.jsonl"
    )
    sched.start()
    await asyncio.sleep(0.1)
    await sched.stop()
    by = {(x["fault"], x["phase"]): x for x in _lines(tmp_path / "faults.jsonl")}
    assert by[(0, "start")]["outcome"] == "ok"
    assert by[(0, "end")]["outcome"].startswith("skipped") and by[(0, "end")]["detail"]["cut_short"]
    assert by[(1, "start")]["outcome"].startswith("skipped")
    assert by[(2, "start")]["outcome"].startswith("unsupported") and by[(2, "end")]["outcome"].startswith("unsupported")
    assert by[(3, "start")]["outcome"].startswith("unsupported")
    assert [c[0] for c in calls] == ["pause", "resume"]


# ---------------------------------------------------------------- the nodes' fault endpoint


@pytest.mark.app
async def test_nodes_take_a_slowdown_over_http(tmp_path: Path, aiohttp_client: Any) -> None:
    from testbed.deploy.plan import loopback_deployment
    from testbed.live import decode_node, prefill_node
    from testbed.live.common import SLOW_KEY, ServiceConfig
    from testbed.run.load import resolve

    dep = loopback_deployment(resolve(load_scenario("paper-prfaas")), None)
    secret = dep.credentials.runner_headers()
    for node, mod in (("pd-d0", decode_node), ("pd-p0", prefill_node)):
        app = mod.make_app(ServiceConfig(dep, node))
        client = await aiohttp_client(app, headers=secret)
        until = time.time() + 60
        r = await client.post("/testbed/fault", json={"slow": 4, "until_s": until})
        assert r.status == 200 and (await r.json())["slow"] == 4
        assert app[SLOW_KEY].at(time.time()) == 4 and app[SLOW_KEY].at(until + 1) == 1
        assert app[mod.STATE].loop.slow is app[SLOW_KEY]  # the one the service loop reads
        for bad in (
            {"slow": 0},
            {"slow": "x"},
            {"slow": 2, "until_s": "soon"},
            [1],
            {"slow": math.inf},
            {"slow": math.nan},
            {"slow": 2, "until_s": math.inf},
            {"slow": -2},
            {"slow": 2, "until_s": -1},
            {"slow": 2, "until_s": math.nan},
            {"slow": 1e308},
            {"slow": 1001},
            {"slow": 1e-9},
        ):
            r = await client.post("/testbed/fault", json=bad)
            assert r.status == 400, bad
            if isinstance(bad, dict):
                field = "until_s" if "until_s" in bad else "slow"
                assert f"field '{field}'" in (await r.json())["error"]["message"], bad
        r = await client.post("/testbed/fault", json={"slow": 1})
        assert r.status == 200 and app[SLOW_KEY].at(time.time()) == 1


@pytest.mark.app
async def test_the_fault_route_refuses_a_caller_without_the_run_secret(aiohttp_client: Any) -> None:
    """Anyone on the host reaches a local node's port: only the deployment's runner may slow it."""
    from testbed.deploy.plan import loopback_deployment
    from testbed.live import decode_node, prefill_node
    from testbed.live.common import SLOW_KEY, ServiceConfig
    from testbed.live.credentials import SECRET_HEADER
    from testbed.run.load import resolve

    dep = loopback_deployment(resolve(load_scenario("paper-prfaas")), None)
    other = loopback_deployment(resolve(load_scenario("paper-prfaas")), None)  # another run's secret
    for node, mod in (("pd-d0", decode_node), ("pd-p0", prefill_node)):
        app = mod.make_app(ServiceConfig(dep, node))
        client = await aiohttp_client(app)
        for headers in (
            {},
            {SECRET_HEADER: ""},
            {SECRET_HEADER: "x"},
            other.credentials.runner_headers(),
            dep.credentials.client_headers(),
        ):  # the API key is no run secret
            r = await client.post("/testbed/fault", json={"slow": 1000}, headers=headers)
            assert r.status == 403 and SECRET_HEADER in (await r.json())["error"]["message"], headers
            assert app[SLOW_KEY].at(time.time()) == 1
        for path in ("/prefill", "/decode", "/status", "/cache/send"):  # the nodes' work too
            r = await client.post(path, json={}) if path != "/status" else await client.get(path)
            assert r.status in (403, 405), path
        for path in ("/health", "/metrics"):  # open, as on real engines
            assert (await client.get(path)).status == 200


@pytest.mark.app
async def test_slowed_decode_steps_take_k_times_longer(tmp_path: Path) -> None:
    from testbed.core.engine.decode_batch import DecodeBatch, DecodeSeq
    from testbed.core.engine.decode_loop import DecodeLoop
    from testbed.core.engine.servicetime import DecodeStepTime
    from testbed.live.decode_node import DecodeState, _batch_loop

    sc = load_scenario("paper-prfaas")
    spec = sc.hardware["h20"].decode
    assert spec is not None

    async def run(factor: float) -> float:
        batch = DecodeBatch(DecodeStepTime.from_spec(spec), spec.bs_max, spec.kv_capacity_bytes, time_scale=5.0)
        st = DecodeState(None, DecodeLoop(batch), None, None, 1)  # type: ignore[arg-type]
        st.slow.set(factor, None)
        st.streams["a"] = asyncio.Queue()
        batch.submit(DecodeSeq("a", 10, 20, 1))
        t = time.time()
        task = asyncio.create_task(_batch_loop(st))
        while (await st.streams["a"].get())["event"] != "done":
            pass
        task.cancel()
        return time.time() - t

    plain, slowed = await run(1.0), await run(3.0)
    assert plain == pytest.approx(20 * spec.base_s / 5, rel=0.3)
    assert slowed == pytest.approx(3 * plain, rel=0.2)


# ---------------------------------------------------------------- the report


def _rec(i: int, node: str, arrival: float, end: float | None, crossed: bool = False, **kw: Any) -> RequestRecord:
    r = RequestRecord(
        f"r{i}",
        i,
        1000,
        10,
        decode_node=node,
        times=StageTimes(arrival=arrival, routed=arrival + 0.01),
        prefill_node="pd-p0" if not crossed else "prfaas-p0",
        crossed_wan=crossed,
        outcome="completed" if end is not None else "failed",
    )
    if end is not None:
        r.times.first_token, r.times.last_token = arrival + 0.1, end
    for k, v in kw.items():
        setattr(r, k, v)
    return r


@pytest.mark.pure
def test_fault_effects_and_the_faults_section(tmp_path: Path) -> None:
    # Wire seconds; speedup 10. A kill of pd-d0 at 1.0 wire (10 paper), an outage 2.0-3.0 wire.
    lines = [
        {"t": 10.0, "fault": 0, "kind": "kill", "phase": "start", "target": "pd-d0", "outcome": "ok", "detail": {}},
        {"t": 20.0, "fault": 1, "kind": "outage", "phase": "start", "target": "wan", "outcome": "ok", "detail": {}},
        {"t": 30.0, "fault": 1, "kind": "outage", "phase": "end", "target": "wan", "outcome": "ok", "detail": {}},
        {"t": 25.0, "fault": 2, "kind": "tcp_reset", "phase": "start", "target": "wan", "outcome": "unsupported: no"},
    ]
    (tmp_path / "faults.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    recs = [
        _rec(0, "pd-d0", 0.5, 0.9),  # done before the kill: not affected
        _rec(1, "pd-d0", 0.8, None),  # in flight at the kill, failed
        _rec(2, "pd-d0", 1.5, None),  # routed to the dead node afterwards, failed
        _rec(3, "pd-d1", 1.2, 1.6),  # the first completion elsewhere: first token at 1.3
        _rec(4, "pd-d1", 1.9, 2.4, crossed=True),  # crossed during the outage
        _rec(5, "pd-d1", 2.5, None, crossed=True),  # crossed, failed
        _rec(6, "pd-d1", 2.5, 2.9),  # local: untouched by the outage
        _rec(7, "pd-d1", 3.2, 3.7, crossed=True),  # after the outage: first token at 3.3
    ]
    write_records(tmp_path / "records.csv", recs)
    eff = fault_effects(tmp_path, recs, 10.0)
    assert [(e["affected"], e["failed"], e["retried"]) for e in eff] == [(2, 2, 0), (2, 1, 0), (0, 0, 0)]
    assert eff[0]["recover_s"] == pytest.approx(3.0) and eff[1]["recover_s"] == pytest.approx(3.0)
    assert eff[2]["start_s"] is None and eff[2]["outcome"].startswith("unsupported")
    # Retries, where the records carry them, count the affected requests retried at least once.
    with_retries = [replace(r) for r in recs]
    for r, n in zip(with_retries, [0, 2, 0, 0, 1, 0, 0, 0]):
        r.retries = n
    assert [e["retried"] for e in fault_effects(tmp_path, with_retries, 10.0)] == [1, 1, 0]
    md = "\n".join(faults_section(tmp_path, recs, 10.0))
    assert md.startswith("## Faults") and "| #0 kill | pd-d0 | 10.0 / end of run | 2 | 2 | 0 | 3.0 | ok |" in md
    assert "| #2 tcp_reset | wan | not reached |" in md
    fig = Figure()
    ax = fig.add_subplot()
    ax.plot([0, 40], [0, 1])
    draw_fault_bands([ax], load_faults(tmp_path))
    assert len(ax.patches) == 1 and len(ax.lines) == 2  # the outage's band, the kill's line
    assert faults_section(tmp_path / "nowhere", recs, 10.0) == []


# ---------------------------------------------------------------- node faults end to end (local backend)


@pytest.mark.app
async def test_local_backend_kills_pauses_and_restarts_node_processes(tmp_path: Path) -> None:
    from testbed.metrics.records import read_records
    from testbed.run.load import resolve
    from testbed.run.runner import run_replay_async
    from testbed.traces.loader import trace_from_workload

    # Speedup 10: the first request leaves 0.5 s wire (5 paper s) after t0, the last at ~65 paper s.
    # The restart comes first, so the new process is up (its imports take seconds on a busy
    # machine) well before the end.
    sc = load_scenario(
        _faulty(
            tmp_path,
            """\
  - {kind: kill, at_s: 45, node: pd-d0}
  - {kind: pause, at_s: 20, duration_s: 10, node: pd-d1}
  - {kind: restart, at_s: 0, node: pd-d2}
""",
        ),
        {
            "scale": {"speedup": 10, "byte_scale": 1024},
            "serving": {"stream_interval": 4},
            "workload": {"requests": 60, "rate": 1.0, "output_tokens": 32, "seed": 5},
        },
    )
    out = tmp_path / "run"
    res = await run_replay_async(resolve(sc), trace_from_workload(sc.workload), out, backend="local")
    recs = read_records(out / "records.csv")
    assert len(recs) == 60 and len({r.request_id for r in recs}) == 60
    by = {(x["fault"], x["phase"]): x for x in _lines(out / "faults.jsonl")}
    kill = by[(0, "start")]
    assert kill["outcome"] == "ok" and kill["detail"]["returncode"] == -9
    assert kill["t"] == pytest.approx(45, abs=1.0)
    kill_wire = kill["t_wire"]
    # Nothing came out of the killed node after the kill.
    assert all(
        r.times.last_token <= kill_wire + 0.05
        for r in recs
        if r.decode_node == "pd-d0" and not math.isnan(r.times.last_token)
    )
    assert by[(1, "start")]["outcome"] == by[(1, "end")]["outcome"] == "ok"
    restarted = by[(2, "end")]
    assert restarted["outcome"] == "ok" and restarted["detail"]["healthy_after_s_wire"] > 0
    up = restarted["t_wire"]  # logged once it answered /health
    assert [r for r in recs if r.decode_node == "pd-d2" and r.times.routed > up and r.outcome == "completed"]
    # The paused node's requests waited for it (no token while it was stopped) and then finished.
    p0, p1 = by[(1, "start")]["t_wire"], by[(1, "end")]["t_wire"]
    on_paused = [r for r in recs if r.decode_node == "pd-d1" and r.times.arrival < p1 and r.times.last_token > p0]
    assert on_paused and all(r.outcome == "completed" for r in on_paused)
    assert not [r for r in on_paused if p0 + 0.05 < r.times.first_token < p1]
    assert "## Faults" in (out / "report.md").read_text()
    assert res.summary.requests.total == 60


# ---------------------------------------------------------------- container faults (engine interface)


class FakeEngine:
    """A ContainerEngine that records the calls (the compose backend's real one talks to Docker)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def kill(self, service: str) -> None:
        self.calls.append(("kill", service))

    def pause(self, service: str) -> None:
        self.calls.append(("pause", service))

    def unpause(self, service: str) -> None:
        self.calls.append(("unpause", service))

    def start(self, service: str) -> None:
        self.calls.append(("start", service))


@pytest.mark.app
async def test_container_nodes_drive_the_engine_and_the_node_endpoint(aiohttp_client: Any) -> None:
    from testbed.deploy.container_faults import ContainerNodes
    from testbed.deploy.plan import loopback_deployment
    from testbed.live import decode_node
    from testbed.live.common import SLOW_KEY, ServiceConfig
    from testbed.run.load import resolve

    dep = loopback_deployment(resolve(load_scenario("paper-prfaas")), None)
    app = decode_node.make_app(ServiceConfig(dep, "pd-d0"))
    client = await aiohttp_client(app)
    engine = FakeEngine()
    nodes = ContainerNodes(
        engine, {"pd-d0": str(client.make_url("")).rstrip("/")}, headers=dep.credentials.runner_headers()
    )
    await nodes.kill("pd-d0")
    await nodes.pause("pd-d0")
    await nodes.resume("pd-d0")
    up = await nodes.start("pd-d0")  # the (fake) container is up at once: /health answers
    assert engine.calls == [("kill", "pd-d0"), ("pause", "pd-d0"), ("unpause", "pd-d0"), ("start", "pd-d0")]
    assert up["healthy_after_s_wire"] >= 0
    got = await nodes.slow("pd-d0", 5.0, time.time() + 30)
    assert got["slow"] == 5.0 and app[SLOW_KEY].at(time.time()) == 5.0


@pytest.mark.pure
def test_a_prefill_kill_counts_the_prefills_it_caught_and_the_retries_away_from_it(tmp_path: Path) -> None:
    # A kill of prfaas-p0 at 1.0 wire (10 paper). Seen in a netns run: the request caught mid-prefill
    # was retried on prfaas-p3, so its record names p3; it was counted neither affected nor retried.
    (tmp_path / "faults.jsonl").write_text(
        json.dumps({"t": 10.0, "fault": 0, "kind": "kill", "phase": "start", "target": "prfaas-p0", "outcome": "ok"})
        + "\n"
    )

    def pre(i: int, node: str, arrival: float, prefill_end: float, **kw: Any) -> RequestRecord:
        r = _rec(i, "pd-d0", arrival, arrival + 2.0, crossed=True, prefill_node=node, **kw)
        r.times.prefill_end = prefill_end
        return r

    # Where the first attempt failed is the record's `retry_node`; the reason text is for people
    # (these name no node: the count does not come from them).
    down = {"retries": 1, "retry_kind": "prefill_node_down", "retry_reason": "the instance broke off"}
    recs = [
        pre(0, "prfaas-p0", 0.2, 0.6),  # prefill done before the kill, decoding after it: untouched
        pre(1, "prfaas-p3", 0.8, 1.4, retry_node="prfaas-p0", **down),
        pre(2, "prfaas-p3", 1.05, 1.5, retry_node="prfaas-p0", **down),
        pre(3, "prfaas-p1", 0.9, 1.3, retry_node="prfaas-p1", **down),
    ]
    eff = fault_effects(tmp_path, recs, 10.0)
    assert [(e["affected"], e["failed"], e["retried"]) for e in eff] == [(2, 0, 2)]


@pytest.mark.pure
def test_the_faults_section_says_what_connection_losses_cost(tmp_path: Path) -> None:
    from testbed.metrics.series_format import SeriesPoint

    (tmp_path / "faults.jsonl").write_text(
        json.dumps({"t": 10.0, "fault": 0, "kind": "outage", "phase": "start", "target": "wan", "outcome": "ok"}) + "\n"
    )
    recs = [_rec(0, "pd-d0", 0.5, 2.0, crossed=True), _rec(1, "pd-d0", 0.9, None, crossed=True)]
    samples = [
        SeriesPoint(t, src, m, v)
        for src in ("prfaas-p0", "prfaas-p1")
        for t, (m, v) in [
            (0.0, ("kv_resumes", 0.0)),
            (5.0, ("kv_resumes", 2.0)),
            (0.0, ("kv_bytes_resent", 0.0)),
            (5.0, ("kv_bytes_resent", 1500.0)),
            (0.0, ("kv_transfers_failed", 0.0)),
            (5.0, ("kv_transfers_failed", 1.0 if src == "prfaas-p1" else 0.0)),
        ]
    ]
    md = "\n".join(faults_section(tmp_path, recs, 10.0, samples))
    assert (
        "4 connection losses resumed from the last acknowledged chunk (3,000 wire bytes sent again), 1 transfers failed"
    ) in md and "1 of 2 requests whose KV crossed the WAN completed" in md
    assert "connection losses" not in "\n".join(faults_section(tmp_path, recs, 10.0))  # no counters: no line
