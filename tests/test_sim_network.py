"""The simulator's flow-level link model: max-min sharing, rate schedules, streams that keep up
or fall behind, per-connection limits and loss."""

from __future__ import annotations

import math

import pytest

from testbed.core.schema.linkprofile import LinkChange, LinkProfile, TcpSettings
from testbed.core.schema.scenario import TransferSpec
from testbed.sim.events import EventLoop
from testbed.sim.net_links import Path
from testbed.sim.network import Network
from testbed.sim.tcp import TcpModel

pytestmark = pytest.mark.pure

GIB = 1 << 30
BIG_WINDOWS = TcpSettings(rmem_max=GIB, wmem_max=GIB)
NODES = {"s1": "a", "s2": "a", "r1": "b", "r2": "b"}


def _net(wan: LinkProfile | None = None, transfer: TransferSpec = TransferSpec()) -> Network:
    wan = wan or LinkProfile(name="wan", rate=8e9, delay=0.01, tcp=BIG_WINDOWS)
    lan = LinkProfile(name="lan", rate=400e9, delay=0.0, tcp=BIG_WINDOWS)
    return Network(EventLoop(), NODES, lan, wan, transfer, 1.0)


def _done_at(net: Network, p: Path, times: dict[str, float], key: str) -> None:
    net.mark(p, net.position(p), lambda _, t: times.__setitem__(key, t), None)


def test_two_flows_share_the_link_max_min_then_the_survivor_takes_it_all() -> None:
    net = _net()
    c = net.wan[("a", "b")].capacity
    b = 100e6
    p1, p2 = net.path("s1", "r1"), net.path("s2", "r2")
    times: dict[str, float] = {}
    net.push(p1, 0.0, b)
    net.push(p2, 0.0, 2 * b)
    _done_at(net, p1, times, "p1")
    _done_at(net, p2, times, "p2")
    assert p1.rate == pytest.approx(c / 2) and p2.rate == pytest.approx(c / 2)
    net.loop.run()
    assert times["p1"] == pytest.approx(2 * b / c)
    assert times["p2"] == pytest.approx(3 * b / c)
    assert net.wan[("a", "b")].counter.at(times["p2"]) == pytest.approx(3 * b)


def test_shares_are_per_connection_a_single_chunk_uses_one() -> None:
    net = _net()
    c = net.wan[("a", "b")].capacity
    small, big = net.path("s1", "r1"), net.path("s2", "r2")
    net.push(small, 0.0, 100e3)  # one chunk: one connection
    net.push(big, 0.0, 100e6)  # many chunks: all four
    assert small.k == 1 and big.k == 4
    assert small.rate == pytest.approx(c / 5) and big.rate == pytest.approx(4 * c / 5)


def test_a_rate_drop_in_the_schedule_slows_a_transfer_in_flight() -> None:
    wan = LinkProfile(name="wan", rate=8e9, delay=0.01, tcp=BIG_WINDOWS, schedule=[LinkChange(at=1.0, rate=4e9)])
    net = _net(wan)
    c = net.wan[("a", "b")].capacity
    net.schedule_changes()
    p = net.path("s1", "r1")
    times: dict[str, float] = {}
    net.push(p, 0.0, 2.0 * c)  # 2 s at the full rate
    _done_at(net, p, times, "done")
    net.loop.run()
    assert times["done"] == pytest.approx(1.0 + 1.0 * c / (c / 2))


def test_a_stream_the_link_keeps_up_with_pays_only_its_last_part() -> None:
    net = _net()
    c = net.wan[("a", "b")].capacity
    p = net.path("s1", "r1")
    times: dict[str, float] = {}
    net.stream(p, 0.0, 0.3 * c)
    assert p.rate == pytest.approx(0.3 * c) and p.queued(1.0) == 0.0
    net.loop.at(2.0, 2, lambda _: (net.end_stream(p, 2.0, 50e6), _done_at(net, p, times, "done")))
    net.loop.run()
    assert times["done"] == pytest.approx(2.0 + 50e6 / c)


def test_streams_faster_than_their_share_queue_and_drain_after() -> None:
    net = _net()
    c = net.wan[("a", "b")].capacity
    p1, p2 = net.path("s1", "r1"), net.path("s2", "r2")
    times: dict[str, float] = {}
    net.stream(p1, 0.0, 0.75 * c)
    net.stream(p2, 0.0, 0.75 * c)
    assert p1.rate + p2.rate == pytest.approx(c)
    assert p1.rate == pytest.approx(c / 2)
    net.loop.at(1.0, 2, lambda _: [net.end_stream(p, 1.0, 0.0) for p in (p1, p2)] and None)
    net.loop.at(1.0, 3, lambda _: [_done_at(net, p, times, p.src) for p in (p1, p2)] and None)
    net.loop.run()
    # 1.5 c bytes went in, c left by t = 1: the rest drains at the full rate by 1.5 s.
    assert times["s1"] == pytest.approx(1.5) and times["s2"] == pytest.approx(1.5)


def test_a_lone_connection_is_window_limited() -> None:
    wan = LinkProfile(name="wan", rate=100e9, delay=0.015, tcp=TcpSettings(rmem_max=4 << 20, wmem_max=4 << 20))
    net = _net(wan)
    p = net.path("s1", "r1")
    net.push(p, 0.0, 1e9)
    rtt = 2 * (0.015 + 0.0)
    assert p.rate == pytest.approx(4 * (4 << 20) / rtt)
    assert p.rate < net.wan[("a", "b")].capacity


def test_loss_limits_loss_based_tcp_by_mathis_not_bbr() -> None:
    prof = LinkProfile(name="lossy", rate=100e9, delay=0.015, loss=0.01, tcp=BIG_WINDOWS)
    cubic = TcpModel.of(prof, TransferSpec(), 1.0)
    bbr = TcpModel.of(
        prof.model_copy(update={"tcp": TcpSettings(congestion="bbr", rmem_max=GIB, wmem_max=GIB)}), TransferSpec(), 1.0
    )
    assert cubic.connection_rate(0.03, 0.01, 0.0) == pytest.approx(1460 / 0.03 * math.sqrt(1.5) / 0.1)
    assert bbr.connection_rate(0.03, 0.01, 0.0) == pytest.approx(GIB / 0.03)
    # Correlated losses come in bursts: fewer loss events, a higher rate.
    assert cubic.connection_rate(0.03, 0.01, 0.75) == pytest.approx(2 * cubic.connection_rate(0.03, 0.01, 0.0))
    assert cubic.link_payload(100e9, 0.01) == pytest.approx(100e9 / 8 * 1460 / 1500 * 0.99)
    assert cubic.connection_rate(0.03, 1.0, 0.0) == 0.0


def test_an_outage_stalls_a_transfer_until_its_retransmission_after_the_link_is_back() -> None:
    wan = LinkProfile(
        name="wan",
        rate=8e9,
        delay=0.01,
        tcp=BIG_WINDOWS,
        schedule=[LinkChange(at=1.0, loss=1.0), LinkChange(at=3.0, loss=0.0)],
    )
    net = _net(wan)
    c = net.wan[("a", "b")].capacity
    net.schedule_changes()
    p = net.path("s1", "r1")
    times: dict[str, float] = {}
    net.push(p, 0.0, 1.5 * c)
    _done_at(net, p, times, "done")
    net.loop.run()
    # Half the bytes went before the outage; TCP then retransmits on its doubling timer (RTO =
    # 200 ms + the 20 ms round trip, speedup 1), so the rest goes at the first retransmission after
    # 3.0 s: 1.0 + 0.22 x (1 + 2 + 4 + 8) = 4.3 s, and takes 0.5 s.
    assert times["done"] == pytest.approx(1.0 + 0.22 * 15 + 0.5)
