"""net/ against the kernel: build topologies in namespaces, read the state back with pyroute2,
and measure what they emulate (reachability, shaped rate, the delay-line path, teardown).

Every object is named `ptbt<random hex>-...` and removed in fixtures' `finally`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import fcntl
import heapq
import json
import os
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from testbed.core.schema.linkprofile import LinkParams, TcpSettings
from testbed.deploy.down_command import register
from testbed.net import plan as P
from testbed.net.capabilities import probe_shaping
from testbed.net.executor import Executor, NetError
from testbed.net.nsexec import nsexec_argv
from testbed.net.nsthread import NETNS_DIR, NetnsLoop, enter_netns, read_sysctl, run_in_netns
from testbed.net.teardown import leftovers, teardown
from testbed.net.topology import Topology, build_topology

pytestmark = pytest.mark.netns

RATE = 200e6
LINK = LinkParams(
    rate_bps=RATE, delay_s=0.0, jitter_s=0.0, loss=0.0, loss_correlation=0.0, queue_bytes=512 * 1024, mtu=None
)
LINKS = {("dc0", "dc1"): LINK, ("dc1", "dc0"): LINK}
HOSTS = [("a0", "dc0"), ("a1", "dc0"), ("b0", "dc1"), ("b1", "dc1")]
TCP = TcpSettings(congestion="reno", rmem_max=8 << 20, wmem_max=4 << 20)
PORT = 7000


def uniq() -> str:
    return "ptbt" + secrets.token_hex(3)


@pytest.fixture(scope="module", autouse=True)
def _need_netns() -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    from pyroute2 import netns  # type: ignore[import-untyped]

    name = uniq() + "-check"
    try:
        netns.create(name)
    except Exception as e:  # any failure here means: no namespaces on this machine
        pytest.skip(f"network namespaces unavailable: {e}")
    netns.remove(name)


@contextlib.contextmanager
def ipr(ns: str) -> Iterator[Any]:
    from pyroute2 import IPRoute

    h = IPRoute(netns=ns, flags=0, groups=0)
    try:
        yield h
    finally:
        h.close()


@contextlib.contextmanager
def running(topo: Topology) -> Iterator[Topology]:
    try:
        with Executor() as ex:
            ex.apply(P.plan_up(topo))
        yield topo
    finally:
        teardown(topo.prefix + "-")  # the dash: never a longer prefix someone else uses
        assert leftovers(topo.prefix + "-") == []


def link(h: Any, ifname: str) -> Any:
    found = h.link("get", index=h.link_lookup(ifname=ifname)[0])
    return found[0]


def htb_class(h: Any, ifname: str, classid: int) -> Any:
    idx = h.link_lookup(ifname=ifname)[0]
    return next(c for c in h.get_classes(index=idx) if c["handle"] == classid)


def class_rate_bps(cls: Any) -> int:
    opts = cls.get_attr("TCA_OPTIONS")
    rate64 = opts.get_attr("TCA_HTB_RATE64")
    return 8 * int(rate64 if rate64 else opts.get_attr("TCA_HTB_PARMS")["rate"])


@pytest.fixture(scope="module")
def net() -> Iterator[Topology]:
    """2 DCs x 2 hosts, routed, no shaping (tests add rate shaping themselves)."""
    with running(build_topology(uniq(), HOSTS, LINKS, "none", tcp=TCP)) as t:
        yield t


# -- async helpers run on NetnsLoops --------------------------------------------------------------


async def start_echo(host: str, port: int) -> asyncio.Server:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        finally:
            w.close()  # also when the loop cancels us at shutdown

    return await asyncio.start_server(handle, host, port)


async def start_sink(host: str, port: int) -> asyncio.Server:
    """Counts bytes until EOF, then answers (bytes, seconds from first to last byte)."""

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        n, t0 = 0, 0.0
        try:
            while chunk := await r.read(1 << 20):
                if n == 0:
                    t0 = time.perf_counter()
                n += len(chunk)
            w.write(struct.pack("!Qd", n, time.perf_counter() - t0))
            await w.drain()
        finally:
            w.close()

    return await asyncio.start_server(handle, host, port)


async def stop(server: asyncio.Server) -> None:
    server.close()
    await server.wait_closed()


async def echo(host: str, port: int, payload: bytes) -> tuple[bytes, str, float]:
    """(echoed bytes, client's local address, seconds for the round trip of a small message)."""
    r, w = await asyncio.open_connection(host, port)
    w.write(b"x")
    await r.readexactly(1)  # warm: ARP and the handshake are done
    t0 = time.perf_counter()
    w.write(b"y")
    await r.readexactly(1)
    rtt = time.perf_counter() - t0
    w.write(payload)
    got = await r.readexactly(len(payload))
    local = w.get_extra_info("sockname")[0]
    w.close()
    await w.wait_closed()
    return got, local, rtt


async def blast(host: str, port: int, seconds: float) -> tuple[int, float]:
    r, w = await asyncio.open_connection(host, port)
    buf = bytes(1 << 16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        w.write(buf)
        await w.drain()
    w.write_eof()
    n, dur = struct.unpack("!Qd", await r.readexactly(16))
    w.close()
    await w.wait_closed()
    return int(n), float(dur)


def transfer_bps(t: Topology, src: str, dst: str, seconds: float, port: int) -> tuple[float, int]:
    with NetnsLoop(t.host(dst).netns) as server_loop, NetnsLoop(t.host(src).netns) as client_loop:
        srv = server_loop.run(start_sink(t.host(dst).ip, port), timeout=5)
        try:
            n, dur = client_loop.run(blast(t.host(dst).ip, port, seconds), timeout=seconds + 20)
        finally:
            server_loop.run(stop(srv), timeout=5)
    return n * 8 / dur, n


# -- the routed topology ------------------------------------------------------------------------


def test_kernel_state_matches_the_plan(net: Topology) -> None:
    for h in net.hosts:
        with ipr(h.netns) as x:
            eth0 = link(x, "eth0")
            assert eth0.get("mtu") == 1500 and eth0["flags"] & 1, h
            assert link(x, "lo")["flags"] & 1
            addrs = {(a.get("address"), a["prefixlen"]) for a in x.addr("dump", family=socket.AF_INET)}
            assert (h.ip, 24) in addrs
            (default,) = [r for r in x.route("dump", family=socket.AF_INET, table=254) if r["dst_len"] == 0]
            assert default.get("gateway") == h.gateway
    with ipr(net.wan_ns) as x:
        for d in net.dcs:
            assert link(x, d.wan_ifname)["flags"] & 1
            addrs = {(a.get("address"), a["prefixlen"]) for a in x.addr("dump", family=socket.AF_INET)}
            assert (d.gateway, 24) in addrs
    for d in net.dcs:
        with ipr(d.switch_ns) as x:
            br = link(x, "br0")
            assert br.get(("linkinfo", "kind")) == "bridge"
            ports = {link(x, n).get("ifname") for n in ["up", "h0", "h1"] if link(x, n).get("master") == br["index"]}
            assert ports == {"up", "h0", "h1"}
    assert run_in_netns(net.wan_ns, read_sysctl, "net.ipv4.ip_forward") == "1"


def test_sysctls_read_back_inside_hosts_only(net: Topology) -> None:
    root_cc = read_sysctl("net.ipv4.tcp_congestion_control")
    root_rmem = read_sysctl("net.ipv4.tcp_rmem")
    for h in net.hosts:
        assert run_in_netns(h.netns, read_sysctl, "net.ipv4.tcp_rmem") == f"4096 131072 {8 << 20}"
        assert run_in_netns(h.netns, read_sysctl, "net.ipv4.tcp_wmem") == f"4096 16384 {4 << 20}"
    # The root namespace never saw the writes.
    assert read_sysctl("net.ipv4.tcp_congestion_control") == root_cc
    assert read_sysctl("net.ipv4.tcp_rmem") == root_rmem


def test_tcp_across_and_inside_dcs(net: Topology) -> None:
    payload = secrets.token_bytes(200_000)
    server = net.host("b0")
    with NetnsLoop(server.netns) as sl:
        srv = sl.run(start_echo(server.ip, PORT), timeout=5)
        try:
            for client in ("a0", "b1"):  # across the WAN router, and across the DC1 bridge
                with NetnsLoop(net.host(client).netns) as cl:
                    got, local, _ = cl.run(echo(server.ip, PORT, payload), timeout=10)
                assert got == payload
                assert local == net.host(client).ip  # the socket lived in the client's namespace
        finally:
            sl.run(stop(srv), timeout=5)


def test_htb_rate_is_what_tcp_gets(net: Topology) -> None:
    unshaped, _ = transfer_bps(net, "a0", "b0", 1.0, PORT + 1)
    with Executor() as ex:
        ex.apply(P.plan_shaping(net, "bfifo"))
    with ipr(net.wan_ns) as x:
        assert class_rate_bps(htb_class(x, "dc1", 0x10010)) == RATE
        before = htb_class(x, "dc1", 0x10010).get_attr("TCA_STATS2").get_attr("TCA_STATS_BASIC")["bytes"]
    shaped, n = transfer_bps(net, "a0", "b0", 3.0, PORT + 2)
    with ipr(net.wan_ns) as x:
        through = htb_class(x, "dc1", 0x10010).get_attr("TCA_STATS2").get_attr("TCA_STATS_BASIC")["bytes"] - before
    print(
        f"\nunshaped {unshaped / 1e6:.0f} Mbit/s; HTB {RATE / 1e6:.0f} Mbit/s -> TCP goodput "
        f"{shaped / 1e6:.1f} Mbit/s ({shaped / RATE:.1%}); class 1:10 carried {through} B for {n} B of payload"
    )
    assert 0.85 * RATE <= shaped <= RATE
    assert unshaped > 1.5 * RATE  # the HTB class, not the machine, is the bottleneck
    assert through >= n  # the transfer went through the DC0 -> DC1 class (u32 matched)


# -- the fallback plumbing, with a minimal delay line on tun0 ---------------------------------------

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


class TunRelay(threading.Thread):
    """A toy delay line: what arrives on tun0 goes back in `delay` seconds later."""

    def __init__(self, netns: str, delay: float) -> None:
        super().__init__(daemon=True)
        self.netns, self.delay = netns, delay
        self.packets = 0
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            enter_netns(self.netns)
            fd = os.open("/dev/net/tun", os.O_RDWR)
        except BaseException as e:
            self.error = e
            self.ready.set()
            return
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", b"tun0", IFF_TUN | IFF_NO_PI))
            self.ready.set()
            heap: list[tuple[float, int, bytes]] = []
            while not self.stopping.is_set():
                wait = min(0.05, max(0.0, heap[0][0] - time.monotonic())) if heap else 0.05
                if select.select([fd], [], [], wait)[0]:
                    heapq.heappush(heap, (time.monotonic() + self.delay, self.packets, os.read(fd, 65536)))
                    self.packets += 1
                while heap and heap[0][0] <= time.monotonic():
                    os.write(fd, heapq.heappop(heap)[2])
        except BaseException as e:
            self.error = e
            self.ready.set()
        finally:
            os.close(fd)


def test_fallback_plumbing_and_delay_path() -> None:
    t = build_topology(uniq(), HOSTS, LINKS, "fallback")
    with running(t):
        with ipr(t.wan_ns) as x:
            tun = link(x, "tun0")
            data = dict(tun.get(("linkinfo", "data"))["attrs"])
            assert tun.get(("linkinfo", "kind")) == "tun"
            assert (data["IFLA_TUN_TYPE"], data["IFLA_TUN_PI"], data["IFLA_TUN_PERSIST"]) == (1, 0, 1)
            assert tun.get("mtu") == 65000 and tun.get("txqlen") == P.tun_qlen(t) >= 1000
            rules = {(r.get("iifname"), r.get("table"), r.get("priority")) for r in x.get_rules(family=socket.AF_INET)}
            assert {("dc0", 100, 100), ("dc1", 100, 101)} <= rules
            (r100,) = list(x.route("dump", family=socket.AF_INET, table=100))
            assert r100["dst_len"] == 0 and r100.get("oif") == tun["index"]
            for d in t.dcs:
                assert link(x, d.wan_ifname).get("mtu") == 65000
                idx = x.link_lookup(ifname=d.wan_ifname)[0]
                src_cls = 0x10010 + (1 - d.index)
                assert class_rate_bps(htb_class(x, d.wan_ifname, src_cls)) == RATE
                (leaf,) = [q for q in x.get_qdiscs(index=idx) if q["parent"] == src_cls]
                assert leaf.get("kind") == "bfifo" and leaf.get_attr("TCA_OPTIONS")["limit"] == LINK.queue_bytes
        for key in ("all", "default", "tun0"):
            assert run_in_netns(t.wan_ns, read_sysctl, f"net.ipv4.conf.{key}.rp_filter") == "0"
        with ipr(t.host("a0").netns) as x:
            assert link(x, "eth0").get("mtu") == 65000

        # Attach a 10 ms delay line: a round trip crosses it twice.
        relay = TunRelay(t.wan_ns, 0.010)
        relay.start()
        try:
            assert relay.ready.wait(5) and relay.error is None, relay.error
            server = t.host("b0")
            with NetnsLoop(server.netns) as sl, NetnsLoop(t.host("a0").netns) as cl:
                srv = sl.run(start_echo(server.ip, PORT), timeout=5)
                try:
                    payload = secrets.token_bytes(300_000)
                    got, _, rtt = cl.run(echo(server.ip, PORT, payload), timeout=15)
                finally:
                    sl.run(stop(srv), timeout=5)
        finally:
            relay.stopping.set()
            relay.join(5)
        print(
            f"\nfallback path: echo RTT {rtt * 1e3:.1f} ms through a 10 ms/direction tun0 relay; "
            f"{relay.packets} packets relayed"
        )
        assert got == payload
        assert 0.020 <= rtt < 0.060
        assert relay.packets > 2 * len(payload) // 65000


# -- teardown ----------------------------------------------------------------------------------


def _in_netns(pid: int, ns: str) -> bool:
    try:
        a, b = os.stat(f"/proc/{pid}/ns/net"), os.stat(os.path.join(NETNS_DIR, ns))
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _wait_for(cond: Any, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_teardown_kills_processes_and_is_idempotent(capsys: pytest.CaptureFixture[str]) -> None:
    t = build_topology(uniq(), [("a0", "dc0"), ("b0", "dc1")], LINKS, "none")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with Executor() as ex:
            ex.apply(P.plan_up(t))
        ns = t.host("b0").netns
        sleeper = subprocess.Popen(nsexec_argv(ns, ["sleep", "600"], [("net.ipv4.ip_default_ttl", "33")]))
        stubborn = subprocess.Popen(
            nsexec_argv(
                t.wan_ns,
                [
                    sys.executable,
                    "-c",
                    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                    "print('ready', flush=True); time.sleep(600)",
                ],
            ),
            stdout=subprocess.PIPE,
        )
        outsider = subprocess.Popen(["sleep", "600"])  # root namespace: not ours to kill
        procs += [sleeper, stubborn, outsider]
        assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"
        assert _wait_for(lambda: _in_netns(sleeper.pid, ns) and _comm(sleeper.pid) == "sleep")
        assert _in_netns(stubborn.pid, t.wan_ns)
        assert run_in_netns(ns, read_sysctl, "net.ipv4.ip_default_ttl") == "33"
        assert read_sysctl("net.ipv4.ip_default_ttl") != "33"
        assert any(str(sleeper.pid) in x for x in leftovers(t.prefix + "-"))

        t0 = time.monotonic()
        report = teardown(t.prefix + "-")
        took = time.monotonic() - t0
        assert sorted(report.namespaces) == sorted(t.namespaces())
        signals = {p.pid: p.signal for p in report.processes}
        assert signals == {sleeper.pid: "SIGTERM", stubborn.pid: "SIGKILL"}
        assert sleeper.wait(5) == -signal.SIGTERM and stubborn.wait(5) == -signal.SIGKILL
        assert outsider.poll() is None
        assert leftovers(t.prefix + "-") == []
        assert not [n for n in os.listdir(NETNS_DIR) if n.startswith(t.prefix + "-")]

        again = teardown(t.prefix + "-")
        assert again.empty and not again.errors
        # `testbed down` is the same call: idempotent, exit 0, reports nothing left.
        parser = argparse.ArgumentParser()
        register(parser.add_subparsers())
        args = parser.parse_args(["down", "--prefix", t.prefix + "-", "--json"])
        capsys.readouterr()
        assert args.func(args) == 0
        out = json.loads(capsys.readouterr().out)
        assert out == {
            "prefix": t.prefix + "-",
            "namespaces": [],
            "processes": [],
            "errors": [],
            "docker": out["docker"],
            "local_runs": {},
            "live_runs_spared": {},
            "local_runs_spared": {},
        }
        # Docker leftovers too (compose and swarm): each kind reported, none found.
        assert {"containers", "networks", "volumes", "services", "configs"} <= set(out["docker"])
        assert not any(out["docker"].values())
        print(f"\n{report.summary()}\n(took {took:.1f} s)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()
        teardown(t.prefix + "-")


# -- capabilities and errors ------------------------------------------------------------------------


def test_netem_probe_matches_the_kernel(scratch: str) -> None:
    from pyroute2.netlink.exceptions import NetlinkError  # type: ignore[import-untyped]

    with ipr(scratch) as x:
        try:
            x.tc("add", "netem", x.link_lookup(ifname="p1")[0], 0x10000, delay=1000)
            netem_here = True
        except NetlinkError as e:
            assert e.code == errno.ENOENT, e  # absent, not some other failure
            netem_here = False
    caps = probe_shaping()
    print(f"\nprobe: netem={caps.netem} htb={caps.htb} tun={caps.tun}; {caps.detail}")
    assert caps.netem == netem_here
    assert caps.htb and caps.tun
    assert not [n for n in os.listdir(NETNS_DIR) if n.startswith("ptb-probe-")]
    if not netem_here:
        # The executor names the operation and the kernel's answer.
        with Executor() as ex, pytest.raises(NetError, match=r"netem delay 5ms.*\(errno 2\)") as ei:
            ex.apply(
                [
                    P.HtbRoot(scratch, "p1"),
                    P.HtbClass(scratch, "p1", 0x10010, 10**8, 200_000, 65536),
                    P.NetemLeaf(scratch, "p1", 0x10010, 0.005, 0.0, 0.0, 0.0, 100),
                ]
            )
        assert ei.value.errno == errno.ENOENT


def test_htb_rate64_and_runtime_change(scratch: str) -> None:
    cid = 0x10010
    with Executor() as ex:
        ex.apply([P.HtbRoot(scratch, "p0"), P.HtbClass(scratch, "p0", cid, 100 * 10**9, 12_500_000, 65536)])
        with ipr(scratch) as x:
            cls = htb_class(x, "p0", cid)
            assert cls.get_attr("TCA_OPTIONS").get_attr("TCA_HTB_RATE64") == 100 * 10**9 // 8
            assert class_rate_bps(cls) == 100 * 10**9
            assert cls.get_attr("TCA_OPTIONS").get_attr("TCA_HTB_PARMS")["quantum"] == 65536
        ex.apply([P.ChangeHtbClass(scratch, "p0", cid, 300 * 10**6, 131072, 65536)])
        with ipr(scratch) as x:
            assert class_rate_bps(htb_class(x, "p0", cid)) == 300 * 10**6


def test_executor_errors_name_the_operation(net: Topology) -> None:
    with Executor() as ex:
        with pytest.raises(NetError, match=rf"ip netns add {net.wan_ns}: namespace exists") as ei:
            ex.apply([P.AddNetns(net.wan_ns)])
        assert ei.value.errno == errno.EEXIST
        with pytest.raises(NetError, match=r"ip link set nope0 up: .*no interface 'nope0'"):
            ex.apply([P.LinkUp(net.wan_ns, "nope0")])
        with pytest.raises(NetError, match=r"ip route add 10.99.0.0/16 via 10.231.7.1: .*\(errno \d+\)"):
            ex.apply([P.AddRoute(net.wan_ns, "10.99.0.0/16", gateway="10.231.7.1")])
        with pytest.raises(NetError, match="only per-namespace net"):
            ex.apply([P.Sysctl(net.wan_ns, "kernel.hostname", "x")])
        # Adding an existing address is a no-op, not an error.
        ex.apply([P.AddAddress(net.wan_ns, "dc0", "10.231.0.1/24")])
