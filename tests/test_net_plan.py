"""net/ topology and plans as data: names, addresses, the shaping each method plans (pure)."""

from __future__ import annotations

import dataclasses
import errno
import re
import sys

import pytest

from testbed.core.schema.linkprofile import LinkParams, TcpSettings
from testbed.net import plan as P
from testbed.net.capabilities import ShapingCaps, ShapingUnavailable, choose_method
from testbed.net.executor import _DISPATCH, NetError, kernel_error
from testbed.net.nsexec import EXIT_FAILED, nsexec_argv
from testbed.net.nsexec import main as nsexec_main
from testbed.net.nsthread import sysctl_path
from testbed.net.teardown import NsProcess, TeardownReport
from testbed.net.topology import FALLBACK_MTU, IFNAME_MAX, Method, Topology, build_topology, new_prefix

pytestmark = pytest.mark.pure

HOSTS = [("prfaas-p0", "prfaas"), ("prfaas-p1", "prfaas"), ("pd-p0", "pd"), ("pd-d0", "pd")]
FWD = LinkParams(
    rate_bps=1e9, delay_s=0.01, jitter_s=0.001, loss=0.01, loss_correlation=0.25, queue_bytes=2_500_000, mtu=None
)
BACK = dataclasses.replace(FWD, rate_bps=2e8, loss=0.0, loss_correlation=0.0, queue_bytes=500_000)
LINKS = {("prfaas", "pd"): FWD, ("pd", "prfaas"): BACK}
TCP = TcpSettings(congestion="cubic", rmem_max=32 << 20, wmem_max=4 << 20)


def topo(method: Method = "netem", **kw: object) -> Topology:
    return build_topology("ptb3fa2", HOSTS, LINKS, method, tcp=TCP, **kw)  # type: ignore[arg-type]


def of(ops: list[P.Operation], kind: type[P.Operation]) -> list[P.Operation]:
    return [o for o in ops if type(o) is kind]


IF_FIELDS = ("ifname", "peer_ifname", "master", "iif", "dev")


# -- topology -------------------------------------------------------------------------------------


def test_new_prefix_format() -> None:
    prefixes = {new_prefix() for _ in range(50)}
    assert all(re.fullmatch(r"ptb[0-9a-f]{4}", p) for p in prefixes)
    assert len(prefixes) > 1


def test_topology_names_addresses_gateways() -> None:
    t = topo()
    assert [d.name for d in t.dcs] == ["prfaas", "pd"]  # order of first appearance
    prfaas, pd = t.dcs
    assert (prfaas.index, prfaas.subnet, prfaas.gateway) == (0, "10.231.0.0/24", "10.231.0.1")
    assert (pd.index, pd.subnet, pd.gateway) == (1, "10.231.1.0/24", "10.231.1.1")
    assert t.wan_ns == "ptb3fa2-wan"
    assert t.host("prfaas-p0").netns == "ptb3fa2-prfaas-p0"
    assert [(h.name, h.ip, h.gateway) for h in t.hosts] == [
        ("prfaas-p0", "10.231.0.10", "10.231.0.1"),
        ("prfaas-p1", "10.231.0.11", "10.231.0.1"),
        ("pd-p0", "10.231.1.10", "10.231.1.1"),
        ("pd-d0", "10.231.1.11", "10.231.1.1"),
    ]
    assert t.dc("pd").switch_ns == "ptb3fa2-sw-pd"
    names = t.namespaces()
    assert len(names) == len(set(names)) == 1 + 2 + 4
    assert all(n.startswith("ptb3fa2-") for n in names)
    with pytest.raises(KeyError, match="no host"):
        t.host("nope")


def test_every_interface_name_fits_and_every_namespace_is_prefixed() -> None:
    t = build_topology("ptb3fa2", [(f"node-with-a-long-name-{i}", f"dc{i % 3}") for i in range(30)], {}, "fallback")
    ops = P.plan_up(t)
    ifnames = {getattr(o, f) for o in ops for f in IF_FIELDS if getattr(o, f, None)}
    assert ifnames and all(len(n) <= IFNAME_MAX for n in ifnames), sorted(ifnames, key=len)[-3:]
    for o in ops:
        for ns in (o.ns, getattr(o, "peer_ns", o.ns)):
            assert ns.startswith("ptb3fa2-"), o.describe()


def test_mtu_defaults_and_overrides() -> None:
    assert topo("fallback").mtu == FALLBACK_MTU == 65000
    assert topo("netem").mtu == 1500 and topo("none").mtu == 1500
    with_profile_mtu = {k: dataclasses.replace(v, mtu=9000) for k, v in LINKS.items()}
    assert build_topology("ptb3fa2", HOSTS, with_profile_mtu, "fallback").mtu == 9000
    assert topo("fallback", mtu=16000).mtu == 16000


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(prefix="xyz1"), "prefix"),
        (dict(hosts=[("wan", "a")]), "collide"),
        (dict(hosts=[("h", "a"), ("h", "b")]), "collide"),
        (dict(links={("a", "zz"): FWD}), "unknown datacenter"),
        (dict(links={("a", "a"): FWD}), "intra-DC"),
        (dict(hosts=[("bad name", "a")]), "host name"),
        (dict(mtu=100), "mtu"),
        (dict(method="tc"), "method"),
    ],
)
def test_topology_rejects(kw: dict[str, object], match: str) -> None:
    args: dict[str, object] = dict(prefix="ptb3fa2", hosts=[("h0", "a"), ("h1", "b")], links={}, method="none")
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        build_topology(**args)  # type: ignore[arg-type]


# -- plan_up: the routed network ---------------------------------------------------------------------


def test_plan_up_base_network() -> None:
    t = topo("none")
    ops = P.plan_up(t)
    # Namespaces first, then everything else.
    n = len(t.namespaces())
    assert ops[:n] == [P.AddNetns(ns) for ns in t.namespaces()]
    assert not of(ops[n:], P.AddNetns)
    assert set(of(ops, P.AddBridge)) == {P.AddBridge(d.switch_ns, "br0") for d in t.dcs}
    veths = of(ops, P.AddVeth)
    assert P.AddVeth(t.wan_ns, "dc1", "ptb3fa2-sw-pd", "up") in veths
    assert P.AddVeth("ptb3fa2-pd-d0", "eth0", "ptb3fa2-sw-pd", "h1") in veths
    assert len(veths) == len(t.dcs) + len(t.hosts)
    # Every veth end and bridge gets the MTU; every end and lo comes up.
    ends = {(o.ns, o.ifname) for o in veths} | {(o.peer_ns, o.peer_ifname) for o in veths}  # type: ignore[attr-defined]
    ends |= {(d.switch_ns, "br0") for d in t.dcs}
    assert {(o.ns, o.ifname) for o in of(ops, P.SetMtu)} == ends  # type: ignore[attr-defined]
    assert all(o.mtu == 1500 for o in of(ops, P.SetMtu))  # type: ignore[attr-defined]
    assert {(o.ns, o.ifname) for o in of(ops, P.LinkUp)} == ends | {(ns, "lo") for ns in t.namespaces()}  # type: ignore[attr-defined]
    assert P.SetMaster("ptb3fa2-sw-pd", "h1", "br0") in ops
    assert P.AddAddress(t.wan_ns, "dc0", "10.231.0.1/24") in ops
    assert P.AddAddress("ptb3fa2-pd-d0", "eth0", "10.231.1.11/24") in ops
    assert of(ops, P.AddRoute) == [P.AddRoute(h.netns, "default", gateway=h.gateway) for h in t.hosts]
    assert P.Sysctl(t.wan_ns, "net.ipv4.ip_forward", "1") in ops
    # An interface's ops come after its creation; addresses after MTU; routes after links are up.
    pos = {o: i for i, o in enumerate(ops)}
    assert pos[P.AddVeth("ptb3fa2-pd-d0", "eth0", "ptb3fa2-sw-pd", "h1")] < pos[P.SetMtu("ptb3fa2-pd-d0", "eth0", 1500)]
    assert pos[P.LinkUp("ptb3fa2-pd-d0", "eth0")] < pos[P.AddRoute("ptb3fa2-pd-d0", "default", gateway="10.231.1.1")]


def test_plan_up_tcp_sysctls_in_every_host() -> None:
    t = topo("none")
    ops = P.plan_up(t)
    for h in t.hosts:
        # Congestion control is set per socket: a netns default is limited to the host's allowed list.
        assert not [o for o in of(ops, P.Sysctl) if o.key == "net.ipv4.tcp_congestion_control"]  # type: ignore[attr-defined]
        assert P.Sysctl(h.netns, "net.ipv4.tcp_rmem", f"4096 131072 {32 << 20}") in ops
        assert P.Sysctl(h.netns, "net.ipv4.tcp_wmem", f"4096 16384 {4 << 20}") in ops
    bare = build_topology("ptb3fa2", HOSTS, LINKS, "none")
    assert not [o for o in of(P.plan_up(bare), P.Sysctl) if "tcp" in o.key]  # type: ignore[attr-defined]


# -- plan_up: shaping per method --------------------------------------------------------------------

SHAPING = (P.HtbRoot, P.HtbClass, P.AddSrcFilter, P.NetemLeaf, P.BfifoLeaf, P.AddTun, P.AddRule)


def test_plan_none_has_no_shaping() -> None:
    ops = P.plan_up(topo("none"))
    assert not [o for o in ops if type(o) in SHAPING]
    assert not [o for o in of(ops, P.Sysctl) if "rp_filter" in o.key]  # type: ignore[attr-defined]


def test_plan_netem_shapes_each_direction_on_the_egress_toward_its_destination() -> None:
    t = topo("netem")
    ops = P.plan_up(t)
    w = t.wan_ns
    # prfaas (DC 0) -> pd (DC 1) leaves through dc1; class 1:10 is source DC 0.
    assert P.HtbRoot(w, "dc1") in ops and P.HtbRoot(w, "dc0") in ops
    fwd_cls = 0x10010
    back_cls = 0x10011
    assert P.HtbClass(w, "dc1", fwd_cls, 1_000_000_000, P.htb_burst_bytes(1e9, 1500), 65536) in ops
    assert P.HtbClass(w, "dc0", back_cls, 200_000_000, P.htb_burst_bytes(2e8, 1500), 65536) in ops
    assert P.AddSrcFilter(w, "dc1", 1, "10.231.0.0/24", fwd_cls) in ops
    assert P.AddSrcFilter(w, "dc0", 2, "10.231.1.0/24", back_cls) in ops
    netem = {o.ifname: o for o in of(ops, P.NetemLeaf)}  # type: ignore[attr-defined]
    fwd = netem["dc1"]
    assert isinstance(fwd, P.NetemLeaf)
    assert (fwd.parent, fwd.handle) == (fwd_cls, 0x100000)
    assert (fwd.delay_s, fwd.jitter_s, fwd.loss, fwd.loss_correlation) == (0.01, 0.001, 0.01, 0.25)
    # Limit in packets: the queue plus what the delay holds, at MTU-size packets.
    in_flight = 1e9 / 8 * 0.011
    assert fwd.limit_packets == -(-int(in_flight + 2_500_000) // 1500)
    assert not of(ops, P.BfifoLeaf) and not of(ops, P.AddTun) and not of(ops, P.AddRule)
    # netem's own rate is the class's, so it releases in arrival order (jitter does not reorder).
    assert fwd.rate_bps == 1_000_000_000 and netem["dc0"].rate_bps == 200_000_000
    # Correlated loss as the Gilbert chain: P(keep -> drop) = (1 - c) p, P(drop -> keep) = (1 - c)(1 - p).
    assert "netem delay 10ms 1ms loss gemodel 0.75% 74.25% 100% 0% limit" in fwd.describe()
    assert fwd.describe().endswith(" rate 1Gbit")
    # Every leaf sits under a class planned before it, on the same interface, with its own handle.
    pos = {o: i for i, o in enumerate(ops)}
    classes = {(o.ifname, o.classid): pos[o] for o in of(ops, P.HtbClass)}  # type: ignore[attr-defined]
    for leaf in of(ops, P.NetemLeaf):
        assert classes[(leaf.ifname, leaf.parent)] < pos[leaf]  # type: ignore[attr-defined]


def test_plan_fallback_bfifo_tun_rules() -> None:
    t = topo("fallback")
    ops = P.plan_up(t)
    w = t.wan_ns
    assert not of(ops, P.NetemLeaf)
    bfifo = {o.ifname: o for o in of(ops, P.BfifoLeaf)}  # type: ignore[attr-defined]
    assert bfifo["dc1"] == P.BfifoLeaf(w, "dc1", 0x10010, 2_500_000)
    assert bfifo["dc0"] == P.BfifoLeaf(w, "dc0", 0x10011, 500_000)
    assert P.HtbClass(w, "dc1", 0x10010, 1_000_000_000, P.htb_burst_bytes(1e9, 65000), 65536) in ops
    assert P.AddTun(w, "tun0") in ops
    assert P.SetMtu(w, "tun0", 65000) in ops
    (qlen,) = of(ops, P.SetTxQueueLen)
    assert isinstance(qlen, P.SetTxQueueLen) and qlen.ifname == "tun0"
    assert qlen.qlen >= 1000 and qlen.qlen * 65000 >= FWD.bdp_bytes
    assert P.LinkUp(w, "tun0") in ops
    assert P.AddRoute(w, "default", dev="tun0", table=100) in ops
    assert set(of(ops, P.AddRule)) == {P.AddRule(w, "dc0", 100, 100), P.AddRule(w, "dc1", 100, 101)}
    rp = [o for o in of(ops, P.Sysctl) if "rp_filter" in o.key]  # type: ignore[attr-defined]
    assert {o.key: o.value for o in rp} == {  # type: ignore[attr-defined]
        "net.ipv4.conf.all.rp_filter": "0",
        "net.ipv4.conf.default.rp_filter": "0",
        "net.ipv4.conf.tun0.rp_filter": "0",
    }
    # all/default before the WAN interfaces exist, so they inherit 0.
    pos = {o: i for i, o in enumerate(ops)}
    first_wan_if = min(pos[o] for o in of(ops, P.AddVeth) if o.ns == w)
    assert pos[P.Sysctl(w, "net.ipv4.conf.default.rp_filter", "0")] < first_wan_if
    assert pos[P.AddTun(w, "tun0")] < pos[P.Sysctl(w, "net.ipv4.conf.tun0.rp_filter", "0")]
    assert pos[P.LinkUp(w, "tun0")] < pos[P.AddRoute(w, "default", dev="tun0", table=100)]


def test_tun_queue_holds_a_bdp() -> None:
    fat = {("prfaas", "pd"): dataclasses.replace(FWD, rate_bps=10e9, delay_s=0.1)}  # BDP 250 MB
    t = build_topology("ptb3fa2", HOSTS, fat, "fallback")
    assert P.tun_qlen(t) == -(-fat[("prfaas", "pd")].bdp_bytes // 65000) > 1000
    assert P.tun_qlen(topo("fallback")) == 1000


def test_three_dcs_get_one_class_per_source() -> None:
    hosts = [("a0", "a"), ("b0", "b"), ("c0", "c")]
    links = {(s, d): FWD for s in "abc" for d in "abc" if s != d}
    t = build_topology("ptb3fa2", hosts, links, "fallback")
    ops = P.plan_up(t)
    into_c = [o for o in of(ops, P.AddSrcFilter) if o.ifname == "dc2"]  # type: ignore[attr-defined]
    assert {(o.src_cidr, o.classid) for o in into_c} == {  # type: ignore[attr-defined]
        ("10.231.0.0/24", 0x10010),
        ("10.231.1.0/24", 0x10011),
    }
    assert len({o.prio for o in into_c}) == 2  # type: ignore[attr-defined]
    assert len(of(ops, P.HtbRoot)) == 3 and len(of(ops, P.HtbClass)) == 6 and len(of(ops, P.BfifoLeaf)) == 6
    handles = [(o.ifname, o.handle) for o in of(ops, P.BfifoLeaf)]  # type: ignore[attr-defined]
    assert len(set(handles)) == 6 and all(h >> 16 >= 0x10 for _, h in handles)


def test_unshaped_pairs_get_no_class() -> None:
    t = build_topology("ptb3fa2", HOSTS, {("prfaas", "pd"): FWD}, "netem")
    ops = P.plan_up(t)
    assert of(ops, P.HtbRoot) == [P.HtbRoot(t.wan_ns, "dc1")]


def test_htb_high_rates_get_explicit_quantum_and_a_ms_of_burst() -> None:
    big = {("prfaas", "pd"): dataclasses.replace(FWD, rate_bps=100e9)}
    ops = P.plan_up(build_topology("ptb3fa2", HOSTS, big, "netem"))
    (cls,) = of(ops, P.HtbClass)
    assert isinstance(cls, P.HtbClass)
    assert cls.rate_bps == 100_000_000_000  # > 2^32 bytes/s: the executor's pyroute2 call uses rate64
    assert cls.quantum == 65536
    assert cls.burst_bytes >= 100e9 / 8 / 1000
    assert "rate 100Gbit" in cls.describe()
    # Low rates: still a few MTUs and two GSO skbs.
    assert P.htb_burst_bytes(1e6, 65000) == 195000
    assert P.htb_burst_bytes(1e6, 1500) == 131072


def test_queue_packet_helpers() -> None:
    assert P.tc_queue_packets(150_000, 1500) == 100
    assert P.tc_queue_packets(150_001, 1500) == 101
    assert P.tc_queue_packets(1000, 1500) == P.MIN_QUEUE_PACKETS
    assert P.netem_limit_packets(dataclasses.replace(FWD, delay_s=0, jitter_s=0), 1500) == -(-2_500_000 // 1500)


# -- plan_change --------------------------------------------------------------------------------


def test_plan_change_netem_rate_and_delay() -> None:
    t = topo("netem")
    new = dataclasses.replace(FWD, rate_bps=5e8, delay_s=0.02, loss=0.0, loss_correlation=0.0)
    ops = P.plan_change(t, "prfaas", "pd", new)
    assert [type(o) for o in ops] == [P.ChangeHtbClass, P.ChangeNetem]
    htb, netem = ops
    assert htb == P.ChangeHtbClass(t.wan_ns, "dc1", 0x10010, 500_000_000, P.htb_burst_bytes(5e8, 1500), 65536)
    assert isinstance(netem, P.ChangeNetem) and (netem.delay_s, netem.loss, netem.parent) == (0.02, 0.0, 0x10010)
    assert netem.rate_bps == 500_000_000  # netem's rate follows the class's
    assert "tc class change dev dc1" in htb.describe() and "tc qdisc change dev dc1" in netem.describe()
    assert "loss 0% limit" in netem.describe()


def test_plan_change_fallback_and_none() -> None:
    ops = P.plan_change(topo("fallback"), "pd", "prfaas", dataclasses.replace(BACK, rate_bps=1e8))
    assert ops == [P.ChangeHtbClass("ptb3fa2-wan", "dc0", 0x10011, 100_000_000, P.htb_burst_bytes(1e8, 65000), 65536)]
    assert P.plan_change(topo("none"), "pd", "prfaas", BACK) == []
    only_fwd = build_topology("ptb3fa2", HOSTS, {("prfaas", "pd"): FWD}, "netem")
    with pytest.raises(ValueError, match="not shaped"):
        P.plan_change(only_fwd, "pd", "prfaas", BACK)


# -- the rest of the seams --------------------------------------------------------------------------


def test_every_operation_has_an_executor_and_a_description() -> None:
    kinds = {c for c in vars(P).values() if isinstance(c, type) and issubclass(c, P.Operation) and c is not P.Operation}
    assert kinds == set(_DISPATCH)
    for o in P.plan_up(topo("fallback")) + P.plan_up(topo("netem")):
        text = o.describe()
        assert o.ns in text and "NotImplemented" not in text


def test_kernel_error_text() -> None:
    from pyroute2.netlink.exceptions import NetlinkError  # type: ignore[import-untyped]

    assert kernel_error(NetlinkError(errno.ENOENT, "Specified qdisc kind is unknown")) == (
        "Specified qdisc kind is unknown",
        errno.ENOENT,
    )
    assert kernel_error(NetlinkError(errno.EEXIST)) == ("File exists", errno.EEXIST)
    assert NetError("x", 2).errno == 2


def test_choose_method() -> None:
    full = ShapingCaps(netem=True, htb=True, tun=True, detail="")
    here = ShapingCaps(netem=False, htb=True, tun=True, detail="netem: no (absent)")
    nothing = ShapingCaps(netem=False, htb=False, tun=False, detail="not root")
    assert choose_method(full) == "netem" and choose_method(full, "fallback") == "fallback"
    assert choose_method(here) == "fallback" and choose_method(here, "none") == "none"
    with pytest.raises(ShapingUnavailable, match="'netem' requested.*netem: no"):
        choose_method(here, "netem")
    with pytest.raises(ShapingUnavailable):
        choose_method(nothing)
    with pytest.raises(ValueError, match="one of"):
        choose_method(full, "tc")


def test_nsexec_argv_and_sysctl_paths() -> None:
    argv = nsexec_argv("ptb3fa2-pd-d0", ["sleep", "1"], [("net.ipv4.tcp_congestion_control", "reno")])
    assert argv == [
        sys.executable,
        "-m",
        "testbed.net.nsexec",
        "ptb3fa2-pd-d0",
        "--sysctl",
        "net.ipv4.tcp_congestion_control=reno",
        "--",
        "sleep",
        "1",
    ]
    assert nsexec_argv("n", ["x"], {"net.a": "1"})[-4:] == ["--sysctl", "net.a=1", "--", "x"]
    assert sysctl_path("net.ipv4.tcp_rmem") == "/proc/sys/net/ipv4/tcp_rmem"
    for bad in ("kernel.pid_max", "net.../x", "net.ipv4/../../kernel"):
        with pytest.raises(ValueError):
            sysctl_path(bad)


@pytest.mark.parametrize("argv", [["ns", "sleep", "1"], ["ns", "--"], ["ns", "--sysctl", "novalue", "--", "true"], []])
def test_nsexec_refuses_bad_command_lines(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert nsexec_main(argv) == EXIT_FAILED  # before touching any namespace
    assert capsys.readouterr().err.strip()  # and says why


def test_teardown_report() -> None:
    empty = TeardownReport("ptbt1", (), ())
    assert empty.empty and "nothing to remove" in empty.summary()
    r = TeardownReport("ptbt1", ("ptbt1-wan",), (NsProcess(42, "ptbt1-wan", "sleep", "SIGTERM"),))
    assert not r.empty and "pid 42 (sleep) in ptbt1-wan: SIGTERM" in r.summary()
    assert r.to_dict()["namespaces"] == ["ptbt1-wan"]
