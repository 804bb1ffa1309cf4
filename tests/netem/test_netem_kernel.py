"""The netem plan against a kernel that has sch_netem (`make test-netem` runs these in a
user-mode-linux guest; a kernel without netem skips them): what the executor sets reads back,
and a netem link loses, correlates and orders packets as the profile says."""

from __future__ import annotations

import errno
import os
import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest

from testbed.core.schema.linkprofile import LinkParams
from testbed.net import plan as P
from testbed.net.capabilities import probe_shaping
from testbed.net.executor import Executor
from testbed.net.nsthread import NetnsLoop
from testbed.net.probe_stats import probe_stats
from testbed.net.probes import LossSink, measure_rtt, send_probes, udp_echo_server, wait_drained
from testbed.net.teardown import teardown
from testbed.net.topology import Topology, build_topology

pytestmark = pytest.mark.netns

U32 = 2**32 - 1


@pytest.fixture(scope="module", autouse=True)
def _need_netem() -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    caps = probe_shaping()
    if not caps.netem:
        pytest.skip(f"this kernel lacks sch_netem (make test-netem runs a guest kernel that has it): {caps.detail}")


def uniq() -> str:
    return "ptbn" + secrets.token_hex(3)


def netem_options(ns: str, ifname: str, handle: int) -> Any:
    from pyroute2 import IPRoute  # type: ignore[import-untyped]

    with IPRoute(netns=ns, flags=0, groups=0) as x:
        idx = x.link_lookup(ifname=ifname)[0]
        q = next(q for q in x.get_qdiscs(index=idx) if q["handle"] == handle)
        assert q.get_attr("TCA_KIND") == "netem"
        return q.get_attr("TCA_OPTIONS")


def test_netem_rate_gilbert_loss_and_change_read_back(scratch: str) -> None:
    cid = 0x10010
    leaf = P.NetemLeaf(scratch, "p0", cid, 0.015, 0.0002, 0.01, 0.25, 2923, 100 * 10**9)
    with Executor() as ex:
        ex.apply([P.HtbRoot(scratch, "p0"), P.HtbClass(scratch, "p0", cid, 100 * 10**9, 12_500_000, 65536), leaf])
        o = netem_options(scratch, "p0", leaf.handle)
        assert o["limit"] == 2923
        # 100 Gbit/s is past netem's 32-bit byte rate: the kernel holds it as rate64.
        assert o.get_attr("TCA_NETEM_RATE64") == 100 * 10**9 // 8
        ge = o.get_attr("TCA_NETEM_LOSS").get_attr("NETEM_LOSS_GE")
        assert abs(ge["p"] / U32 - 0.0075) < 1e-6 and abs(ge["r"] / U32 - 0.7425) < 1e-6
        assert (ge["h"], ge["k1"]) == (0, 0)
        # A change to independent loss and a 32-bit rate: nothing of the old model survives.
        ex.apply([P.ChangeNetem(scratch, "p0", cid, 0.020, 0.0, 0.02, 0.0, 2000, 500 * 10**6)])
        o = netem_options(scratch, "p0", leaf.handle)
        assert o.get_attr("TCA_NETEM_RATE")["rate"] == 500 * 10**6 // 8
        assert o.get_attr("TCA_NETEM_RATE64") is None
        loss = o.get_attr("TCA_NETEM_LOSS")
        assert loss is None or loss.get_attr("NETEM_LOSS_GE") is None
        assert o.get_attr("TCA_NETEM_CORR")["loss_corr"] == 0 and abs(o["loss"] / U32 - 0.02) < 1e-6
        assert o["limit"] == 2000


def test_netem_leaf_needs_its_class(scratch: str) -> None:
    from testbed.net.executor import NetError

    with Executor() as ex, pytest.raises(NetError, match=r"netem delay 5ms .* rate 100Mbit: .*\(errno \d+\)") as ei:
        ex.apply([P.NetemLeaf(scratch, "p0", 0x10010, 0.005, 0.0, 0.0, 0.0, 100, 10**8)])
    assert ei.value.errno in (errno.ENOENT, errno.EINVAL)


DELAY, JITTER, LOSS, CORR = 0.010, 0.001, 0.05, 0.5
LINK = LinkParams(
    rate_bps=50e6, delay_s=DELAY, jitter_s=JITTER, loss=LOSS, loss_correlation=CORR, queue_bytes=1 << 20, mtu=None
)


@pytest.fixture(scope="module")
def link() -> Iterator[Topology]:
    t = build_topology(uniq(), [("a", "dc0"), ("b", "dc1")], {("dc0", "dc1"): LINK, ("dc1", "dc0"): LINK}, "netem")
    try:
        with Executor() as ex:
            ex.apply(P.plan_up(t))
        yield t
    finally:
        teardown(t.prefix + "-")


def test_netem_link_loss_correlation_and_order(link: Topology) -> None:
    """10,000 probes 0.5 ms apart (jitter 1 ms): the loss and its lag-1 correlation are the
    profile's, and netem's rate keeps them in order."""
    b = link.host("b")
    with NetnsLoop(b.netns) as lb, NetnsLoop(link.host("a").netns) as la:
        sink = LossSink()
        lb.run(sink.start(b.ip, 7001))
        sent = la.run(send_probes(b.ip, 7001, 10000, 2000.0), 600).sent
        wait_drained(sink, 2 * DELAY + 0.5)
        st = probe_stats(sent, sink.arrivals())
        lb.loop.call_soon_threadsafe(sink.close)
    print(f"\nnetem probes: {st}")
    assert st.loss is not None and abs(st.loss - LOSS) < 0.015
    assert st.loss_correlation is not None and abs(st.loss_correlation - CORR) < 0.12
    assert st.reordered == 0.0


def test_netem_link_rtt_over_the_unshaped_path(link: Topology) -> None:
    b = link.host("b")
    with NetnsLoop(b.netns) as lb, NetnsLoop(link.host("a").netns) as la:
        echo = lb.submit(udp_echo_server(b.ip, 7000))
        time.sleep(0.1)
        r = la.run(measure_rtt(b.ip, 7000, count=100), 120)
        echo.cancel()
    print(f"\nnetem RTT: median {r.median_s * 1e3:.2f} ms, p10 {r.p10_s * 1e3:.2f}, p90 {r.p90_s * 1e3:.2f}")
    # The guest's own stack adds milliseconds at worst; the shaped part is 2 x 10 ms.
    assert 2 * DELAY <= r.p10_s + 2 * JITTER and r.median_s < 2 * DELAY + 0.010
