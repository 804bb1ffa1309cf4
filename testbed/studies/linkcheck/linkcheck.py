"""`testbed linkcheck PROFILE`: build one shaped link between two namespaces and measure what it
delivers: RTT, goodput on 1 and N connections over the project's own KV transport (and iperf3
when installed), loss, and how fast throughput follows a scheduled rate change."""

from __future__ import annotations

import asyncio
import itertools
import math
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from testbed.core.schema.linkprofile import LinkParams, LinkProfile
from testbed.core.schema.scaling import Scale
from testbed.live.kv_transport import KVReceiver, KVSender
from testbed.metrics.series_format import SeriesWriter, read_series
from testbed.net import owners
from testbed.net.capabilities import choose_method, probe_shaping
from testbed.net.delayline import LATE_S, Lateness, control, lateness
from testbed.net.drop_counters import NetlinkReader, layout_for, read_path
from testbed.net.executor import Executor
from testbed.net.loss_account import LossAccount, QueueBound, Snapshot, account_loss, peak_in_flight
from testbed.net.monitor import LinkMonitor, WatchedLink
from testbed.net.nsexec import nsexec_argv
from testbed.net.nsthread import NetnsLoop, read_sysctl, run_in_netns
from testbed.net.plan import netem_limit_packets, plan_base, plan_change, plan_up
from testbed.net.probe_stats import ProbeStats, probe_stats
from testbed.net.probes import LossSink, RttResult, SendResult, measure_rtt, send_probes, udp_echo_server, wait_drained
from testbed.net.procs import ProcessGroup
from testbed.net.teardown import teardown
from testbed.net.topology import Method, Topology, build_topology, new_prefix
from testbed.net.wanrouter import start_delayline
from testbed.studies.linkcheck.linkcheck_types import (
    Goodput,
    Iperf3,
    LinkCheckResult,
    LossFigures,
    RateChange,
    RttFigures,
)

ECHO_PORT, SINK_PORT, KV_PORT, IPERF_PORT = 7000, 7001, 9000, 5201
SRC, DST = "dc-a", "dc-b"
BASE_RTT_PROBES = 50


@dataclass
class LinkCheckConfig:
    profile: LinkProfile
    scale: Scale
    connections: int = 4
    duration_s: float = 4.0  # wire seconds per goodput measurement
    loss_probes: int | None = 20000  # None: loss_probes_for the profile
    rtt_probes: int = 200
    method: str = "auto"
    one_connection: bool = True  # goodput on one connection too (beside `connections`)
    window_limited: bool = True  # one connection to a receiver with a small buffer (window-limited goodput)
    workdir: Path = field(default_factory=lambda: Path("/tmp"))


def _goodput(
    la: NetnsLoop,
    lb: NetnsLoop,
    receiver: KVReceiver,
    dest: tuple[str, int],
    nbytes: int,
    connections: int,
    tid: int,
    congestion: str | None,
    timeout: float,
) -> Goodput:
    """One transfer of `nbytes`; goodput is bytes over first-byte-sent .. last-byte-received."""
    fut = lb.submit(receiver_wait(receiver, tid, timeout))

    windows: list[int] = []
    received: list[tuple[float, int]] = []
    base = receiver.bytes_received  # the receiver serves one transfer after another

    async def send() -> float:
        sender = KVSender(connections=connections, chunk_bytes=256 * 1024, congestion=congestion)

        async def sample() -> None:
            # The peer's advertised window as the sender sees it (what bounds bytes in flight), and
            # the bytes the receiver has so far (the rate past TCP's ramp).
            while True:
                await asyncio.sleep(0.05)
                info = sender.tcp_info()
                windows.extend(c.snd_wnd for c in info)
                received.append((time.time(), receiver.bytes_received - base))

        sampler = asyncio.create_task(sample())
        try:
            t = sender.start(dest, tid, nbytes, 1)
            start = time.time()
            t.send_layer(0, nbytes)
            await t.finish()
            return t.first_send or start
        finally:
            sampler.cancel()
            await sender.close()

    start = la.run(send(), timeout)
    ok, complete, reason = fut.result(timeout)
    secs = complete - start
    steady = sorted(windows[len(windows) // 4 :])  # past slow start
    return {
        "connections": connections,
        "bytes": nbytes,
        "seconds": secs,
        "ok": ok,
        "reason": reason,
        "bps": nbytes * 8 / secs if ok and secs > 0 else None,
        "steady_bps": steady_rate(received, nbytes) if ok else None,
        "congestion": congestion,
        "received": [(round(t - start, 4), b) for t, b in received],
        "peer_window_bytes": steady[len(steady) // 2] if steady else None,
    }


STEADY_FROM, STEADY_TO = 0.25, 0.95  # of the transfer's bytes received
STEADY_MIN_S = 0.5


def steady_rate(received: list[tuple[float, int]], nbytes: int) -> float | None:
    """Bits per second received between a quarter and 95% of the transfer: the link's rate as TCP
    gets it past its ramp (slow start or BBR's startup take a few round trips, which over a 150 ms
    path is a fifth of a 3 s transfer), like iperf3's --omit, counted where iperf3 counts, at the
    receiver: a sender that reads its ACKs late (a busy or one-CPU machine) sees them lag the link
    and catch up in a burst. Both ends of the stretch are the receiver's own samples, so what it
    has not yet read from its socket counts alike at both. None when the stretch was shorter than
    STEADY_MIN_S (a short or fast transfer: the whole-transfer figure then says it)."""
    inside = [(t, b) for t, b in received if STEADY_FROM * nbytes <= b <= STEADY_TO * nbytes]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < STEADY_MIN_S:
        return None
    (t0, b0), (t1, b1) = inside[0], inside[-1]
    return (b1 - b0) * 8 / (t1 - t0)


def multi_goodput_bps(g: Goodput) -> float | None:
    """The figure the goodput bar judges: past the ramp where it was measured, else the whole transfer's."""
    steady = g.get("steady_bps")
    return float(steady) if steady is not None else g.get("bps")


def _predict(g: Goodput, rate_bps: float, rtt_s: float) -> Goodput:
    """One connection moves at most its window per round trip: min(rate, window / RTT), with the
    window the peer advertised during the transfer (read from the sender's TCP_INFO)."""
    w = g.get("peer_window_bytes")
    g["predicted_bps"] = min(rate_bps, w * 8 / rtt_s) if w else None
    return g


WINDOW_LATE_SHARE = 0.25  # of the round trip: past it the window-limited figure measured the host


def line_lateness(link: ShapedLink) -> Lateness:
    """The delay line's lateness counters so far (none: the kernel shapes the link)."""
    return lateness(link.delay_line) if link.delay_line is not None else Lateness(0.0, 0, 0)


def judge_window_limited(g: Goodput, line: Lateness, rtt_s: float) -> Goodput:
    """A window-limited connection moves one window per round trip, so every millisecond the
    delay line writes late lengthens its round trip and lowers its rate: the lateness per trip
    is recorded beside the prediction, and the figure is invalid (the host's, not the link's)
    when it reaches WINDOW_LATE_SHARE of the round trip."""
    g["valid"], g["reasons"] = True, []
    if not line.packets:
        return g
    per_trip = 2 * line.late_s / line.packets
    g["line_late_per_trip_s"] = per_trip
    if per_trip >= WINDOW_LATE_SHARE * rtt_s:
        g["valid"] = False
        g["reasons"].append(
            f"the delay line wrote the transfer's packets {per_trip * 1e3:.2f} ms late per round trip "
            f"(round trip {rtt_s * 1e3:.2f} ms): the host was too busy to time a window-limited connection"
        )
    return g


async def receiver_wait(receiver: KVReceiver, tid: int, timeout: float) -> tuple[bool, float, str]:
    res = await asyncio.wait_for(receiver.expect(tid), timeout)
    return res.ok, res.complete, res.reason


def _iperf3(topo: Topology, connections: int, seconds: float) -> Iperf3 | None:
    exe = shutil.which("iperf3")
    if exe is None:
        return None
    a, b = topo.host("a"), topo.host("b")
    server = subprocess.Popen(
        nsexec_argv(b.netns, [exe, "-s", "-1", "-p", str(IPERF_PORT)]),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.5)
        out = subprocess.run(
            nsexec_argv(
                a.netns,
                [exe, "-c", b.ip, "-p", str(IPERF_PORT), "-P", str(connections), "-t", f"{max(seconds, 1):.0f}", "-J"],
            ),
            capture_output=True,
            text=True,
            timeout=seconds + 30,
        )
        import json

        data = json.loads(out.stdout)
        return {"connections": connections, "bps": data["end"]["sum_received"]["bits_per_second"]}
    except (subprocess.SubprocessError, ValueError, KeyError) as e:
        return {"connections": connections, "error": str(e)}
    finally:
        server.kill()
        server.wait()


def _track_rate_change(
    topo: Topology,
    la: NetnsLoop,
    lb: NetnsLoop,
    receiver: KVReceiver,
    cfg: LinkCheckConfig,
    new: LinkParams,
    tid: int,
    workdir: Path,
) -> RateChange:
    """Bulk transfer on N connections; after 1.5 s the rate changes; measure (10 ms counter
    samples, 50 ms windows) how long until throughput is within 10% of the new rate."""
    old = topo.links[(SRC, DST)]
    p = cfg.profile
    series_path = workdir / "track.jsonl"
    w = SeriesWriter(series_path, "wan")
    mon = LinkMonitor(topo.wan_ns, [WatchedLink(f"dc{topo.dc(DST).index}", f"{SRC}->{DST}")], w, 0.01)
    mon.start()
    seconds = 4.0
    nbytes = int((old.rate_bps * 1.5 + new.rate_bps * (seconds - 1.5)) / 8)
    dest = (topo.host("b").ip, KV_PORT)
    fut = lb.submit(receiver_wait(receiver, tid, 60))

    async def send() -> None:
        sender = KVSender(connections=cfg.connections, chunk_bytes=256 * 1024, congestion=p.tcp.congestion)
        try:
            t = sender.start(dest, tid, nbytes, 1)
            t.send_layer(0, nbytes)
            await t.finish()
        finally:
            await sender.close()

    change = plan_change(topo, SRC, DST, new)
    with Executor() as ex:
        # Opened before the transfer: the change is then one netlink exchange, not the seconds a
        # slow machine takes to open a handle in the namespace while the transfer runs out.
        ex.open(*{op.ns for op in change})
        sfut = la.submit(send())
        time.sleep(1.5)
        t_change = time.time()
        ex.apply(change)
    sfut.result(60)
    fut.result(60)
    mon.stop()
    w.close()
    pts = [(p.t, p.value) for p in read_series(series_path) if p.metric == "link_bytes"]
    win = 0.05
    follow: float | None = None
    for i, (t, v) in enumerate(pts):
        if t < t_change:
            continue
        j = next((k for k in range(i, len(pts)) if pts[k][0] >= t + win), None)
        if j is None:
            break
        rate = (pts[j][1] - v) * 8 / (pts[j][0] - t)
        if abs(rate - new.rate_bps) <= 0.1 * new.rate_bps:
            follow = t + win - t_change  # the window that first matched ends here
            break
    before = [
        (pts[k + 1][1] - pts[k][1]) * 8 / (pts[k + 1][0] - pts[k][0])
        for k in range(len(pts) - 1)
        if t_change - 1.0 <= pts[k][0] < t_change - 0.05
    ]
    return {
        "old_bps": old.rate_bps,
        "new_bps": new.rate_bps,
        "follow_s": follow,
        "measured_before_bps": sum(before) / len(before) if before else None,
    }


@dataclass
class ShapedLink:
    topo: Topology
    params: LinkParams
    la: NetnsLoop  # the sending host's namespace
    lb: NetnsLoop  # the receiving host's
    base_rtt: RttResult  # over the routed path before the shaping went on
    ex: Executor  # its netlink handles read the path's drop counters
    delay_line: Path | None = None  # the delay line's control socket (method fallback)


@contextmanager
def shaped_link(cfg: LinkCheckConfig, method: Method) -> Iterator[ShapedLink]:
    """Two hosts in two DCs, linked by `cfg.profile` shaped by `method`; all removed on exit.
    The RTT of the same path unshaped is measured first: what the host's own stack and scheduling
    add (tens of microseconds on a host, milliseconds in a slow guest) is not the link's."""
    p = cfg.profile
    params = p.wire(cfg.scale)
    prefix = new_prefix()
    owners.claim(prefix, "linkcheck", cfg.workdir)
    topo = build_topology(
        prefix, [("a", SRC), ("b", DST)], {(SRC, DST): params, (DST, SRC): params}, method, mtu=p.mtu, tcp=p.tcp
    )
    workdir = cfg.workdir / f"{prefix}-linkcheck"
    workdir.mkdir(parents=True, exist_ok=True)
    procs = ProcessGroup(workdir / "logs")
    base, full = plan_base(topo), plan_up(topo)
    assert full[: len(base)] == base, "plan_up starts with plan_base"
    try:
        a, b = topo.host("a"), topo.host("b")
        # One executor throughout: each handle it opens in a namespace costs a fork.
        with Executor() as ex:
            ex.apply(base)
            with NetnsLoop(a.netns) as la, NetnsLoop(b.netns) as lb:
                base_rtt = _rtt(la, lb, b.ip, BASE_RTT_PROBES)
                ex.apply(full[len(base) :])
                ctl = start_delayline(procs, topo, workdir, None) if method == "fallback" else None
                yield ShapedLink(topo, params, la, lb, base_rtt, ex, ctl)
    finally:
        procs.stop(first=(), last=("delayline",))
        teardown(prefix)
        owners.release(prefix)
        shutil.rmtree(workdir, ignore_errors=True)


def _rtt(la: NetnsLoop, lb: NetnsLoop, ip: str, probes: int) -> RttResult:
    echo = lb.submit(udp_echo_server(ip, ECHO_PORT))
    time.sleep(0.1)
    try:
        return la.run(measure_rtt(ip, ECHO_PORT, count=probes), 120 + probes)
    finally:
        echo.cancel()


def _rtt_dict(rtt: RttResult, base: RttResult) -> RttFigures:
    return {
        "median_s": rtt.median_s,
        "p10_s": rtt.p10_s,
        "p90_s": rtt.p90_s,
        "sd_s": rtt.sd_s,
        "replies": rtt.received,
        "probes": rtt.sent,
        "base_median_s": base.median_s,
        "base_sd_s": base.sd_s,
        "host_median_s": rtt.host_median_s,
        "valid": rtt.received > 0,
        "reasons": [] if rtt.received else ["no probe came back"],
    }


def rtt_tolerance(rtt_s: float) -> float:
    """The RTT bar: within 1 ms or 3% of the configured round trip, whichever is wider."""
    return max(0.001, 0.03 * rtt_s)


def judge_rtt(d: RttFigures, line: Lateness, tolerance: float) -> None:
    """Mark the RTT figure invalid when the loaded host, not the link model, delayed the probes
    (the kernel stamps already keep the hosts' readers out of it): when the delay line wrote
    them late, or waited for a CPU while they queued to be read, by half the bar or more per
    round trip (two crossings) on average."""
    if not line.packets:
        return
    per_trip = 2 * line.late_s / line.packets
    wait_per_trip = 2 * line.cpu_wait_s / line.packets
    d["line_late_per_trip_s"] = per_trip
    d["line_late_packets"] = line.late_packets
    d["line_cpu_wait_per_trip_s"] = wait_per_trip
    if per_trip >= tolerance / 2:
        d["valid"] = False
        d["reasons"].append(
            f"the delay line wrote the probes {per_trip * 1e3:.2f} ms late per round trip "
            f"({line.late_packets} of {line.packets} packets over {LATE_S * 1e3:g} ms late): "
            f"the host was too busy to time the link"
        )
    if wait_per_trip >= tolerance / 2:
        d["valid"] = False
        d["reasons"].append(
            f"the delay line waited {wait_per_trip * 1e3:.2f} ms per round trip for a CPU: "
            f"the host was too busy to time the link"
        )


def measure_rtt_checked(link: ShapedLink, probes: int, tolerance: float) -> RttFigures:
    """The RTT over the shaped link, measured once more when the host made it invalid (a stall
    of a busy machine passes; a misconfigured link fails both times). The last run stands, with
    every attempt recorded."""
    ip = link.topo.host("b").ip
    no_line = Lateness(0.0, 0, 0)
    attempts: list[RttFigures] = []
    for _ in range(2):
        before = lateness(link.delay_line) if link.delay_line is not None else no_line
        d = _rtt_dict(_rtt(link.la, link.lb, ip, probes), link.base_rtt)
        after = lateness(link.delay_line) if link.delay_line is not None else no_line
        judge_rtt(d, after - before, tolerance)
        attempts.append(d)
        if d["valid"]:
            break
    out = attempts[-1].copy()
    if len(attempts) > 1:
        out["attempts"] = attempts
    return out


LOSS_BAR = 0.003  # loss within 0.3 percentage points
MIN_LOSS_PROBES = 2000


def loss_probes_for(p: LinkParams) -> int:
    """Probes enough that the loss bar is 3 standard deviations of the estimate: a Gilbert
    chain's losses come in runs, which inflates the variance by (1 + c) / (1 - c)."""
    var = p.loss * (1 - p.loss) * (1 + p.loss_correlation) / (1 - p.loss_correlation)
    return max(MIN_LOSS_PROBES, math.ceil(9 * var / LOSS_BAR**2))


MAX_PROBE_PPS = 10000.0
PROBE_BYTES = 200


def probe_rate(p: LinkParams, mtu: int, method: Method) -> float:
    """Probes per second: a quarter of the link rate at most, and under netem few enough that
    the probes in flight fill at most a third of its queue (it counts packets, and a probe is
    a small one), which leaves the rest for what a stalled CPU lets pile up. (The delay line
    holds its packets in a queue of its own, unbounded.)"""
    pps = min(MAX_PROBE_PPS, p.rate_bps / 8 / PROBE_BYTES / 4)
    hold_s = p.delay_s + p.jitter_s
    if method == "netem" and hold_s > 0:
        pps = min(pps, netem_limit_packets(p, mtu) / 3 / hold_s)
    return pps


@dataclass
class ProbeRun:
    stats: ProbeStats
    account: LossAccount
    send: SendResult
    pps: float


def _snapshot(link: ShapedLink) -> Snapshot:
    ctl = link.delay_line
    reader = NetlinkReader(link.ex.handle, (lambda: control(ctl, {"op": "stats"})) if ctl is not None else None)
    return read_path(reader, layout_for(link.topo, "a", "b"))


def _probe_stream(link: ShapedLink, count: int | None, rcvbuf: int = 32 << 20) -> ProbeRun:
    """Numbered UDP probes, paced well under the link rate so only the emulated loss drops them,
    and the path's drop counters around them: what the host dropped is not the link's loss."""
    b = link.topo.host("b")
    sink = LossSink()
    link.lb.run(sink.start(b.ip, SINK_PORT, rcvbuf))
    pps = probe_rate(link.params, link.topo.mtu, link.topo.method)
    count = loss_probes_for(link.params) if count is None else count
    before: Snapshot | None = None
    after: Snapshot | None = None
    error: str | None = None
    try:
        before = _snapshot(link)
    except Exception as e:  # netlink, /proc and the control socket each fail their own way
        error = f"{type(e).__name__}: {e}"
    sent = link.la.run(send_probes(b.ip, SINK_PORT, count, pps, PROBE_BYTES), 600 + count / 100)
    wait_drained(sink, 2 * link.params.delay_s + 0.5)
    if before is not None:
        try:
            after = _snapshot(link)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    arrivals = sink.arrivals()
    intervals = sink.intervals()
    overflow = sink.overflow
    link.lb.loop.call_soon_threadsafe(sink.close)
    st = probe_stats(sent.sent, arrivals)
    queue = (
        QueueBound(netem_limit_packets(link.params, link.topo.mtu), peak_in_flight(intervals))
        if link.topo.method == "netem"
        else None
    )
    acc = account_loss(
        sent.sent,
        st.received,
        before,
        after,
        queue=queue,
        send_retries=sent.retries,
        socket_overflow=overflow,
        read_error=error,
    )
    return ProbeRun(st, acc, sent, pps)


def measure_loss(link: ShapedLink, count: int | None) -> tuple[ProbeRun, LossFigures]:
    """The probe stream, measured once more when the host's drops made its loss figure invalid
    (a stall of a slow machine passes; a misconfigured link fails both times). The last run
    stands, with every attempt's account recorded."""
    attempts: list[LossFigures] = []
    for _ in range(2):
        run = _probe_stream(link, count)
        attempts.append(_loss_dict(run))
        if run.account.valid:
            break
    out = attempts[-1].copy()
    if len(attempts) > 1:
        out["attempts"] = attempts
    return run, out


def _loss_dict(run: ProbeRun) -> LossFigures:
    a = run.account
    out: LossFigures = {
        "sent": a.sent,
        "received": a.received,
        "measured": a.measured,
        "link": a.link,
        "valid": a.valid,
        "reasons": a.reasons,
        "host_drops": a.drops,
        "by_stage": a.by_stage,
        "unexplained": a.unexplained,
        "send_retries": a.send_retries,
        "socket_overflow": a.socket_overflow,
        "pps": run.pps,
        "sender_stalls": run.send.stalls,
        "sender_stalled_s": run.send.stalled_s,
    }
    # The account's own extra figures (the netem queue's) follow, as they come.
    return cast(LossFigures, {**out, **a.extra})


def _configured(cfg: LinkCheckConfig, method: Method, mtu: int) -> LinkCheckResult:
    p, params = cfg.profile, cfg.profile.wire(cfg.scale)
    return {
        "profile": p.name,
        "method": method,
        "mtu": mtu,
        "scale": {"speedup": cfg.scale.speedup, "byte_scale": cfg.scale.byte_scale},
        "configured": {
            "rate_bps_wire": params.rate_bps,
            "rate_bps_paper": p.rate,
            "rtt_s_wire": 2 * params.delay_s,
            "rtt_s_paper": 2 * p.delay,
            "loss": params.loss,
            "loss_correlation": params.loss_correlation,
            "queue_bytes": params.queue_bytes,
            "jitter_s_wire": params.jitter_s,
        },
    }


def run_linkcheck(cfg: LinkCheckConfig) -> LinkCheckResult:
    p = cfg.profile
    method = choose_method(probe_shaping(), cfg.method)
    ids = itertools.count(1)
    took: dict[str, float] = {}
    mark = time.monotonic()

    def step(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        took[name] = round(now - mark, 3)
        mark = now

    with shaped_link(cfg, method) as link:
        step("setup")
        topo, params, la, lb = link.topo, link.params, link.la, link.lb
        out = _configured(cfg, method, topo.mtu)
        out["took_s"] = took  # wall seconds by step (setup, rtt, loss, goodput, ...)
        workdir = cfg.workdir / f"{topo.prefix}-linkcheck"
        b = topo.host("b")
        out["rtt"] = measure_rtt_checked(link, cfg.rtt_probes, rtt_tolerance(2 * params.delay_s))
        step("rtt")
        _, out["loss"] = measure_loss(link, cfg.loss_probes)
        step("loss")

        receiver = KVReceiver()
        lb.run(receiver.start(b.ip, KV_PORT))
        dest = (b.ip, KV_PORT)
        nbytes = int(params.rate_bps / 8 * cfg.duration_s)
        timeout = cfg.duration_s * 20 + 30
        wmem = int(run_in_netns(topo.host("a").netns, read_sysctl, "net.ipv4.tcp_wmem").split()[2])
        rmem = int(run_in_netns(b.netns, read_sysctl, "net.ipv4.tcp_rmem").split()[2])
        rtt_s = out["rtt"]["median_s"] if out["rtt"]["replies"] else 2 * params.delay_s
        out["goodput"] = []
        cc = p.tcp.congestion
        multi = _goodput(la, lb, receiver, dest, nbytes, cfg.connections, next(ids), cc, timeout)
        out["goodput"].append(multi)
        if cfg.one_connection:
            single = _goodput(la, lb, receiver, dest, nbytes, 1, next(ids), cc, timeout)
            out["goodput"].append(_predict(single, params.rate_bps, rtt_s))
        step("goodput")
        if cfg.window_limited:
            # A receiver with a small fixed buffer: its advertised window, not the link, is then
            # the limit, and one connection should reach about window / RTT.
            small = max(int(params.rate_bps / 8 * rtt_s / 4), 32 * 1024)
            limited_rx = KVReceiver(rcvbuf=small)
            lb.run(limited_rx.start(b.ip, KV_PORT + 1))
            before = line_lateness(link)
            limited = _goodput(
                la, lb, limited_rx, (b.ip, KV_PORT + 1), max(nbytes // 2, 1 << 20), 1, next(ids), cc, timeout
            )
            lb.run(limited_rx.close())
            limited["rcvbuf"] = small
            limited = judge_window_limited(
                _predict(limited, params.rate_bps, rtt_s), line_lateness(link) - before, rtt_s
            )
            out["goodput"].append(limited)
            step("window")
        out["window_sysctls"] = {"tcp_wmem_max": wmem, "tcp_rmem_max": rmem}
        out["iperf3"] = _iperf3(topo, cfg.connections, cfg.duration_s)
        step("iperf3")
        rate_changes = [c for c in p.schedule if c.rate is not None]
        if rate_changes:
            new = params.with_change(rate_changes[0], p, cfg.scale)
            out["rate_change"] = _track_rate_change(topo, la, lb, receiver, cfg, new, next(ids), workdir)
            step("rate_change")
        lb.run(receiver.close())
    step("teardown")
    return out


def scale_for(profile: LinkProfile, speedup: float, byte_scale: float | None, wire_rate: float | None) -> Scale:
    """Byte scale from the wanted wire rate when given: wire = paper / b * s."""
    if wire_rate is not None:
        return Scale(speedup, max(profile.rate * speedup / wire_rate, 1.0))
    return Scale(speedup, byte_scale or 1.0)
