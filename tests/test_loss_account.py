"""The loss account of a probe stream: the host's own drops told from the link's, the figure
marked INVALID when they cannot be, and the path's counters read through a fake reader."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from testbed.core.schema.linkprofile import LinkParams
from testbed.net.drop_counters import IfDrops, PathLayout, QdiscDrops, parse_snmp, read_path
from testbed.net.loss_account import Counter, QueueBound, account_loss, peak_in_flight
from testbed.studies.linkcheck.linkcheck import probe_rate
from testbed.studies.linkcheck.linkcheck_report import loss_cell, verdicts

pytestmark = pytest.mark.pure


def snap(**places: tuple[str, int]) -> dict[str, Counter]:
    return {k: Counter(stage, k, v) for k, (stage, v) in places.items()}  # type: ignore[arg-type]


ZERO = snap(sender=("before", 0), netem=("model", 0), sock=("after", 0))


def test_a_lossless_stream_with_no_host_drop_is_valid() -> None:
    a = account_loss(2000, 2000, ZERO, ZERO)
    assert a.valid and a.link == 0.0 and a.measured == 0.0 and a.unexplained == 0 and a.drops == {}


def test_the_models_drops_over_the_probes_it_saw_are_the_links_loss() -> None:
    # 20 dropped by the sender's namespace before the link, 5 by the receiving socket after it,
    # 100 by netem: the link lost 100 of the 1980 it saw, not 125 of 2000.
    after = snap(sender=("before", 20), netem=("model", 100), sock=("after", 5))
    a = account_loss(2000, 1875, ZERO, after)
    assert a.valid and a.reasons == []
    assert a.measured == pytest.approx(125 / 2000)
    assert a.link == pytest.approx(100 / 1980)
    assert a.host_drops == 25 and a.drops == {"sender": 20, "netem": 100, "sock": 5}


def test_probes_no_counter_saw_make_the_figure_invalid() -> None:
    # The flaky case: 79 of 2000 probes gone on a lossless link, and no counter rose.
    a = account_loss(2000, 1921, ZERO, ZERO)
    assert not a.valid and a.link is None and a.measured == pytest.approx(0.0395)
    assert a.reasons == ["79 of 79 lost probes vanished where no counter saw them"]


def test_counters_that_saw_more_drops_than_probes_lost_make_it_invalid() -> None:
    a = account_loss(2000, 1999, ZERO, snap(sender=("before", 0), netem=("model", 0), sock=("after", 3)))
    assert not a.valid and a.unexplained == -2
    assert "more drops than probes were lost" in a.reasons[0]


def test_netem_drops_while_its_queue_may_have_been_full_are_not_the_profiles_loss() -> None:
    after = snap(sender=("before", 0), netem=("model", 79), sock=("after", 0))
    full = account_loss(2000, 1921, ZERO, after, queue=QueueBound(limit_packets=189, peak_in_flight=189))
    assert not full.valid and full.link is None
    assert "netem's queue may have overflowed (up to 189 probes held against its limit of 189)" in full.reasons[0]
    # The same drops with the queue never near its limit: netem's own loss, a valid figure.
    roomy = account_loss(2000, 1921, ZERO, after, queue=QueueBound(limit_packets=189, peak_in_flight=130))
    assert roomy.valid and roomy.link == pytest.approx(79 / 2000)
    assert roomy.extra == {"netem_limit_packets": 189, "peak_in_flight": 130}


def test_probes_dropped_after_netem_count_towards_what_it_may_have_held() -> None:
    after = snap(sender=("before", 0), netem=("model", 10), sock=("after", 10))
    a = account_loss(2000, 1980, ZERO, after, queue=QueueBound(limit_packets=100, peak_in_flight=90))
    assert not a.valid and "up to 100 probes held" in a.reasons[0]


def test_a_full_queue_without_drops_leaves_the_figure_valid() -> None:
    a = account_loss(2000, 2000, ZERO, ZERO, queue=QueueBound(limit_packets=100, peak_in_flight=150))
    assert a.valid and a.link == 0.0


def test_too_many_drops_before_the_link_make_it_invalid() -> None:
    after = snap(sender=("before", 300), netem=("model", 0), sock=("after", 0))
    a = account_loss(2000, 1700, ZERO, after)
    assert not a.valid and "dropped 300 of 2000 probes before the link" in a.reasons[0]


def test_unreadable_or_reset_counters_make_it_invalid() -> None:
    a = account_loss(2000, 2000, None, ZERO, read_error="OSError: no such namespace")
    assert not a.valid and "could not be read (OSError: no such namespace)" in a.reasons[0]
    reset = account_loss(2000, 2000, snap(sender=("before", 7)), snap(sender=("before", 2)))
    assert not reset.valid and reset.reasons == ["counter sender went back from 7 to 2"]
    missing = account_loss(2000, 2000, ZERO, {})
    assert not missing.valid and len(missing.reasons) == 3


def test_the_sockets_own_overflow_count_stands_in_for_an_unread_namespace_count() -> None:
    # SO_RXQ_OVFL saw 4 drops the namespace's Udp InErrors did not (it is a subset of it).
    udp = snap(sender=("before", 0), netem=("model", 0), **{"b Udp InErrors": ("after", 1)})
    a = account_loss(2000, 1996, {k: Counter(c.stage, k, 0) for k, c in udp.items()}, udp, socket_overflow=4)
    assert a.valid and a.by_stage["after"] == 4 and a.link == 0.0


def test_peak_in_flight_counts_overlapping_intervals() -> None:
    assert peak_in_flight([]) == 0
    assert peak_in_flight([(0.0, 1.0), (0.5, 1.5), (0.9, 2.0), (1.2, 1.3)]) == 3
    # A probe received at the instant the next is sent does not overlap it.
    assert peak_in_flight([(0.0, 1.0), (1.0, 2.0)]) == 1


# -- the path's counters through a fake reader -------------------------------------------------


class FakeReader:
    """The kernel's counters as a test sets them."""

    def __init__(self) -> None:
        self.ifs: dict[str, list[IfDrops]] = {}
        self.qd: dict[tuple[str, str], list[QdiscDrops]] = {}
        self.mib: dict[str, dict[str, int]] = {}
        self.dl: Mapping[str, Any] | None = None

    def interfaces(self, ns: str) -> list[IfDrops]:
        return self.ifs.get(ns, [])

    def qdiscs(self, ns: str, ifname: str) -> list[QdiscDrops]:
        return self.qd.get((ns, ifname), [])

    def udp(self, ns: str) -> Mapping[str, int]:
        return self.mib.get(ns, {})

    def delay_line(self) -> Mapping[str, Any] | None:
        return self.dl


def layout(method: str = "netem") -> PathLayout:
    return PathLayout("ha", "swa", "wan", "dc0", "dc1", "swb", "hb", method, "dc-a->dc-b")  # type: ignore[arg-type]


def fake_path(
    netem_drops: int, bfifo_drops: int = 0, backlog_drops: int = 0, rcvbuf: int = 0, sndbuf: int = 0
) -> FakeReader:
    r = FakeReader()
    r.ifs = {
        "ha": [IfDrops("eth0", 0, 0)],
        "swa": [IfDrops("uplink", 0, 0), IfDrops("p0", 0, 0)],
        "wan": [IfDrops("dc0", backlog_drops, 0), IfDrops("dc1", 0, 0), IfDrops("lo", 5, 5)],
        "swb": [IfDrops("uplink", 0, 0)],
        "hb": [IfDrops("eth0", 0, 0)],
    }
    r.qd = {
        ("wan", "dc1"): [
            QdiscDrops("dc1", "htb", 0x10000, netem_drops + bfifo_drops),
            QdiscDrops("dc1", "netem", 0x100000, netem_drops),
            QdiscDrops("dc1", "bfifo", 0x110000, bfifo_drops),
        ]
    }
    r.mib = {"ha": {"SndbufErrors": sndbuf}, "hb": {"InErrors": rcvbuf, "RcvbufErrors": rcvbuf}}
    return r


def test_read_path_places_each_counter_at_its_stage() -> None:
    s = read_path(fake_path(3, bfifo_drops=1, backlog_drops=2, rcvbuf=4, sndbuf=5), layout())
    stages = {p: c.stage for p, c in s.items() if c.value}
    assert stages == {
        "netem 10: on dc1 drops": "model",
        "bfifo 11: on dc1 drops": "after",
        "wan dc0 rx_dropped": "before",
        "hb Udp InErrors": "after",
        "ha Udp SndbufErrors": "before",
    }
    # HTB repeats its leaves' drops and the router's other interfaces carry no probe: not read.
    assert not any("htb" in p or " lo " in p for p in s)


def test_the_account_over_two_readings_of_a_fake_path() -> None:
    lay = layout()
    before = read_path(fake_path(0), lay)
    after = read_path(fake_path(40, backlog_drops=6, rcvbuf=2), lay)
    a = account_loss(2000, 1952, before, after, queue=QueueBound(189, 120))
    assert a.valid and a.by_stage == {"before": 6, "model": 40, "after": 2}
    assert a.link == pytest.approx(40 / 1994)
    cell = loss_cell(
        {
            "sent": a.sent,
            "received": a.received,
            "measured": a.measured,
            "link": a.link,
            "valid": a.valid,
            "reasons": a.reasons,
            "by_stage": a.by_stage,
            "host_drops": a.drops,
        }
    )
    assert cell == (
        "2.01% (40 of 1994); the host dropped 8 more (2 at hb Udp InErrors, 6 at wan dc0 rx_dropped), "
        "kept out of the figure"
    )


def test_the_delay_lines_counts_are_its_loss_and_its_write_errors() -> None:
    r = fake_path(0)
    r.dl = {"ok": True, "directions": {"dc-a->dc-b": {"packets_dropped": 17, "write_errors": 1}}}
    s = read_path(r, layout("fallback"))
    assert s["delay line dc-a->dc-b packets_dropped"] == Counter("model", "delay line dc-a->dc-b packets_dropped", 17)
    assert s["delay line dc-a->dc-b write_errors"].stage == "after"
    r.dl = {"ok": True, "directions": {}}
    with pytest.raises(OSError, match="no direction dc-a->dc-b"):
        read_path(r, layout("fallback"))


def test_parse_snmp_reads_the_udp_rows() -> None:
    text = (
        "Ip: Forwarding DefaultTTL\nIp: 1 64\n"
        "Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors InCsumErrors IgnoredMulti\n"
        "Udp: 10 0 3 12 3 1 0 0\nUdpLite: InDatagrams\nUdpLite: 0\n"
    )
    assert parse_snmp(text) == {
        "InDatagrams": 10,
        "NoPorts": 0,
        "InErrors": 3,
        "OutDatagrams": 12,
        "RcvbufErrors": 3,
        "SndbufErrors": 1,
        "InCsumErrors": 0,
        "IgnoredMulti": 0,
    }
    assert parse_snmp("Ip: a\nIp: 1\n") == {}


# -- linkcheck's use of the account --------------------------------------------------------------


def _result(loss: dict[str, Any]) -> dict[str, Any]:
    return {
        "configured": {"rtt_s_wire": 0.03, "rate_bps_wire": 50e6, "loss": 0.0},
        "rtt": {"median_s": 0.0305, "base_median_s": 0.0005},
        "goodput": [{"bps": 48e6}],
        "loss": loss,
    }


def test_an_invalid_loss_figure_is_neither_pass_nor_fail_and_is_shown_as_invalid() -> None:
    inv = account_loss(2000, 1921, ZERO, ZERO)
    lo = {
        "sent": inv.sent,
        "received": inv.received,
        "measured": inv.measured,
        "link": inv.link,
        "valid": inv.valid,
        "reasons": inv.reasons,
        "by_stage": inv.by_stage,
        "host_drops": inv.drops,
    }
    assert verdicts(_result(lo))["loss"] is None
    assert (
        loss_cell(lo)
        == "INVALID: probes lost 3.95% (79 of 2000): 79 of 79 lost probes vanished where no counter saw them"
    )
    ok = dict(lo, valid=True, link=0.004, reasons=[])
    assert verdicts(_result(ok))["loss"] is False  # a valid figure outside the bar fails
    assert verdicts(_result(dict(ok, link=0.002)))["loss"] is True


def test_probe_rate_leaves_netems_queue_two_thirds_free() -> None:
    p = LinkParams(
        rate_bps=50e6, delay_s=0.015, jitter_s=0.0002, loss=0.0, loss_correlation=0.0, queue_bytes=187500, mtu=None
    )
    pps = probe_rate(p, 1500, "netem")
    assert pps * (p.delay_s + p.jitter_s) == pytest.approx(189 / 3)
    assert probe_rate(p, 1500, "fallback") == pytest.approx(50e6 / 8 / 200 / 4)
    lan = LinkParams(
        rate_bps=50e6, delay_s=1e-5, jitter_s=0.0, loss=0.0, loss_correlation=0.0, queue_bytes=131072, mtu=None
    )
    assert probe_rate(lan, 1500, "netem") == pytest.approx(50e6 / 8 / 200 / 4)
