"""`testbed linkcheck PROFILE`: build one shaped link between two namespaces and measure what it
delivers: RTT, goodput on 1 and N connections over the project's own KV transport (and iperf3
when installed), loss, and how fast throughput follows a scheduled rate change."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.core.linkprofile import LinkParams, LinkProfile
from testbed.core.scaling import Scale
from testbed.net.procs import ProcessGroup
from testbed.live.kv_transport import KVReceiver, KVSender
from testbed.metrics.series_format import SeriesWriter, read_series
from testbed.net.capabilities import choose_method, probe_shaping
from testbed.net.executor import Executor
from testbed.net.monitor import LinkMonitor, WatchedLink
from testbed.net.nsexec import nsexec_argv
from testbed.net.nsthread import NetnsLoop, read_sysctl, run_in_netns
from testbed.net.plan import plan_change, plan_up
from testbed.net.probes import LossSink, measure_rtt, send_probes, udp_echo_server
from testbed.net.teardown import teardown
from testbed.net.topology import Topology, build_topology, new_prefix
from testbed.net.wanrouter import start_delayline

ECHO_PORT, SINK_PORT, KV_PORT, IPERF_PORT = 7000, 7001, 9000, 5201
SRC, DST = "dc-a", "dc-b"


@dataclass
class LinkCheckConfig:
    profile: LinkProfile
    scale: Scale
    connections: int = 4
    duration_s: float = 4.0          # wire seconds per goodput measurement
    loss_probes: int = 20000
    rtt_probes: int = 200
    method: str = "auto"
    workdir: Path = field(default_factory=lambda: Path("/tmp"))


def _goodput(la: NetnsLoop, lb: NetnsLoop, receiver: KVReceiver, dest: tuple[str, int], nbytes: int,
             connections: int, tid: int, congestion: str | None, timeout: float) -> dict[str, Any]:
    """One transfer of `nbytes`; goodput is bytes over first-byte-sent .. last-byte-received."""
    fut = lb.submit(receiver_wait(receiver, tid, timeout))

    windows: list[int] = []

    async def send() -> float:
        sender = KVSender(connections=connections, chunk_bytes=256 * 1024, congestion=congestion)

        async def sample() -> None:
            # The peer's advertised window as the sender sees it: what bounds bytes in flight.
            while True:
                await asyncio.sleep(0.05)
                windows.extend(c.snd_wnd for c in sender.tcp_info())

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
    steady = sorted(windows[len(windows) // 4:])     # past slow start
    return {"connections": connections, "bytes": nbytes, "seconds": secs, "ok": ok, "reason": reason,
            "bps": nbytes * 8 / secs if ok and secs > 0 else None, "congestion": congestion,
            "peer_window_bytes": steady[len(steady) // 2] if steady else None}


def _predict(g: dict[str, Any], rate_bps: float, rtt_s: float) -> dict[str, Any]:
    """One connection moves at most its window per round trip: min(rate, window / RTT), with the
    window the peer advertised during the transfer (read from the sender's TCP_INFO)."""
    w = g.get("peer_window_bytes")
    g["predicted_bps"] = min(rate_bps, w * 8 / rtt_s) if w else None
    return g


async def receiver_wait(receiver: KVReceiver, tid: int, timeout: float) -> tuple[bool, float, str]:
    res = await asyncio.wait_for(receiver.expect(tid), timeout)
    return res.ok, res.complete, res.reason


def _iperf3(topo: Topology, connections: int, seconds: float) -> dict[str, Any] | None:
    exe = shutil.which("iperf3")
    if exe is None:
        return None
    a, b = topo.host("a"), topo.host("b")
    server = subprocess.Popen(nsexec_argv(b.netns, [exe, "-s", "-1", "-p", str(IPERF_PORT)]),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        out = subprocess.run(nsexec_argv(a.netns, [exe, "-c", b.ip, "-p", str(IPERF_PORT), "-P", str(connections),
                                                   "-t", f"{max(seconds, 1):.0f}", "-J"]),
                             capture_output=True, text=True, timeout=seconds + 30)
        import json
        data = json.loads(out.stdout)
        return {"connections": connections, "bps": data["end"]["sum_received"]["bits_per_second"]}
    except (subprocess.SubprocessError, ValueError, KeyError) as e:
        return {"connections": connections, "error": str(e)}
    finally:
        server.kill()
        server.wait()


def _track_rate_change(topo: Topology, la: NetnsLoop, lb: NetnsLoop, receiver: KVReceiver,
                       cfg: LinkCheckConfig, new: LinkParams, tid: int, workdir: Path) -> dict[str, Any]:
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

    sfut = la.submit(send())
    time.sleep(1.5)
    t_change = time.time()
    with Executor() as ex:
        ex.apply(plan_change(topo, SRC, DST, new))
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
            follow = t + win - t_change     # the window that first matched ends here
            break
    before = [(pts[k + 1][1] - pts[k][1]) * 8 / (pts[k + 1][0] - pts[k][0])
              for k in range(len(pts) - 1) if t_change - 1.0 <= pts[k][0] < t_change - 0.05]
    return {"old_bps": old.rate_bps, "new_bps": new.rate_bps, "follow_s": follow,
            "measured_before_bps": sum(before) / len(before) if before else None}


def run_linkcheck(cfg: LinkCheckConfig) -> dict[str, Any]:
    p = cfg.profile
    params = p.wire(cfg.scale)
    method = choose_method(probe_shaping(), cfg.method)
    prefix = new_prefix()
    topo = build_topology(prefix, [("a", SRC), ("b", DST)], {(SRC, DST): params, (DST, SRC): params},
                          method, mtu=p.mtu, tcp=p.tcp)
    workdir = cfg.workdir / f"{prefix}-linkcheck"
    workdir.mkdir(parents=True, exist_ok=True)
    procs = ProcessGroup(workdir / "logs")
    out: dict[str, Any] = {
        "profile": p.name, "method": method, "mtu": topo.mtu,
        "scale": {"speedup": cfg.scale.speedup, "byte_scale": cfg.scale.byte_scale},
        "configured": {"rate_bps_wire": params.rate_bps, "rate_bps_paper": p.rate,
                       "rtt_s_wire": 2 * params.delay_s, "rtt_s_paper": 2 * p.delay, "loss": params.loss,
                       "loss_correlation": params.loss_correlation, "queue_bytes": params.queue_bytes},
    }
    ids = itertools.count(1)
    try:
        with Executor() as ex:
            ex.apply(plan_up(topo))
        if method == "fallback":
            start_delayline(procs, topo, workdir, None)
        a, b = topo.host("a"), topo.host("b")
        with NetnsLoop(a.netns) as la, NetnsLoop(b.netns) as lb:
            echo = lb.submit(udp_echo_server(b.ip, ECHO_PORT))
            time.sleep(0.1)
            rtt = la.run(measure_rtt(b.ip, ECHO_PORT, count=cfg.rtt_probes), 120)
            echo.cancel()
            out["rtt"] = {"median_s": rtt.median_s, "p10_s": rtt.p10_s, "p90_s": rtt.p90_s,
                          "replies": rtt.received, "probes": rtt.sent}

            sink = LossSink()
            lb.run(sink.start(b.ip, SINK_PORT))
            # Pace probes well under the link rate so only the emulated loss drops them.
            pps = min(10000.0, params.rate_bps / 8 / 200 / 4)
            sent = la.run(send_probes(b.ip, SINK_PORT, cfg.loss_probes, pps), 600)
            time.sleep(2 * params.delay_s + 0.5)
            got = sink.received()
            lb.loop.call_soon_threadsafe(sink.close)
            out["loss"] = {"sent": sent, "received": got, "measured": 1 - got / sent if sent else None}

            receiver = KVReceiver()
            lb.run(receiver.start(b.ip, KV_PORT))
            dest = (b.ip, KV_PORT)
            nbytes = int(params.rate_bps / 8 * cfg.duration_s)
            timeout = cfg.duration_s * 20 + 30
            wmem = int(run_in_netns(a.netns, read_sysctl, "net.ipv4.tcp_wmem").split()[2])
            rmem = int(run_in_netns(b.netns, read_sysctl, "net.ipv4.tcp_rmem").split()[2])
            rtt_s = rtt.median_s if rtt.received else 2 * params.delay_s
            out["goodput"] = []
            cc = p.tcp.congestion
            multi = _goodput(la, lb, receiver, dest, nbytes, cfg.connections, next(ids), cc, timeout)
            out["goodput"].append(multi)
            single = _goodput(la, lb, receiver, dest, nbytes, 1, next(ids), cc, timeout)
            out["goodput"].append(_predict(single, params.rate_bps, rtt_s))
            # A receiver with a small fixed buffer: its advertised window, not the link, is then
            # the limit, and one connection should reach about window / RTT.
            small = max(int(params.rate_bps / 8 * rtt_s / 4), 32 * 1024)
            limited_rx = KVReceiver(rcvbuf=small)
            lb.run(limited_rx.start(b.ip, KV_PORT + 1))
            limited = _goodput(la, lb, limited_rx, (b.ip, KV_PORT + 1), max(nbytes // 2, 1 << 20), 1, next(ids),
                               cc, timeout)
            lb.run(limited_rx.close())
            limited["rcvbuf"] = small
            out["goodput"].append(_predict(limited, params.rate_bps, rtt_s))
            out["window_sysctls"] = {"tcp_wmem_max": wmem, "tcp_rmem_max": rmem}
            out["iperf3"] = _iperf3(topo, cfg.connections, cfg.duration_s)
            rate_changes = [c for c in p.schedule if c.rate is not None]
            if rate_changes:
                new = params.with_change(rate_changes[0], p, cfg.scale)
                out["rate_change"] = _track_rate_change(topo, la, lb, receiver, cfg, new, next(ids), workdir)
            lb.run(receiver.close())
    finally:
        procs.stop(first=(), last=("delayline",))
        teardown(prefix)
        shutil.rmtree(workdir, ignore_errors=True)
    return out


def verdicts(r: dict[str, Any]) -> dict[str, bool | None]:
    c = r["configured"]
    rtt = r["rtt"]["median_s"]
    multi = r["goodput"][0]
    loss = r["loss"]["measured"]
    out: dict[str, bool | None] = {
        "rtt": abs(rtt - c["rtt_s_wire"]) <= max(0.001, 0.03 * c["rtt_s_wire"]),
        "goodput_multi": multi["bps"] is not None and multi["bps"] >= 0.9 * c["rate_bps_wire"],
        "loss": loss is not None and abs(loss - c["loss"]) <= 0.003,
    }
    if "rate_change" in r:
        f = r["rate_change"]["follow_s"]
        out["rate_change"] = f is not None and f <= 0.2
    return out


def print_report(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    c, s = r["configured"], r["scale"]
    t = Table(title=f"linkcheck {r['profile']}: method {r['method']}, MTU {r['mtu']}, "
                    f"speedup {s['speedup']:g}, byte_scale {s['byte_scale']:g}")
    for col in ("measure", "configured / predicted (wire)", "achieved (wire)", "achieved (paper)", "bar"):
        t.add_column(col)
    v = verdicts(r)
    mark = {True: "PASS", False: "FAIL", None: "-"}
    sc = Scale(s["speedup"], s["byte_scale"])
    t.add_row("RTT median", f"{c['rtt_s_wire'] * 1e3:.2f} ms",
              f"{r['rtt']['median_s'] * 1e3:.2f} ms (p10 {r['rtt']['p10_s'] * 1e3:.2f}, p90 {r['rtt']['p90_s'] * 1e3:.2f})",
              f"{sc.paper_seconds(r['rtt']['median_s']) * 1e3:.2f} ms", mark[v["rtt"]] + " (1 ms or 3%)")
    for g in r["goodput"]:
        pred = g.get("predicted_bps") or c["rate_bps_wire"]
        label = f"goodput, {g['connections']} conn" + (
            f", receiver SO_RCVBUF {g['rcvbuf'] / 1e6:.2f} MB" if g.get("rcvbuf") else "")
        ach = g["bps"]
        bar = (mark[v["goodput_multi"]] + " (>= 90% of rate)") if g is r["goodput"][0] else (
            f"{ach / pred:.0%} of min(rate, window {g['peer_window_bytes'] / 1e6:.2f} MB / RTT)"
            if ach and g.get("peer_window_bytes") else "-")
        t.add_row(label, f"{pred / 1e6:.1f} Mbit/s", f"{ach / 1e6:.1f} Mbit/s" if ach else f"failed: {g['reason']}",
                  f"{sc.paper_rate_bps(ach) / 1e9:.2f} Gbit/s" if ach else "-", bar)
    if r.get("iperf3"):
        ip = r["iperf3"]
        t.add_row(f"iperf3, {ip['connections']} conn", f"{c['rate_bps_wire'] / 1e6:.1f} Mbit/s",
                  f"{ip['bps'] / 1e6:.1f} Mbit/s" if "bps" in ip else ip.get("error", "?"), "-", "-")
    else:
        t.add_row("iperf3", "-", "not installed", "-", "-")
    lo = r["loss"]
    t.add_row("loss", f"{c['loss']:.2%} (corr {c['loss_correlation']:g})",
              f"{lo['measured']:.2%} ({lo['sent'] - lo['received']} of {lo['sent']})", "-",
              mark[v["loss"]] + " (within 0.3 pp)")
    if "rate_change" in r:
        rc = r["rate_change"]
        f = rc["follow_s"]
        t.add_row("rate change", f"{rc['old_bps'] / 1e6:.0f} -> {rc['new_bps'] / 1e6:.0f} Mbit/s",
                  f"followed in {f * 1e3:.0f} ms" if f is not None else "did not follow", "-",
                  mark[v["rate_change"]] + " (within 200 ms)")
    Console().print(t)


def main_linkcheck(profile: LinkProfile, scale: Scale, connections: int, duration: float, method: str,
                   as_json: bool) -> int:
    import json

    r = run_linkcheck(LinkCheckConfig(profile, scale, connections, duration, method=method))
    r["verdicts"] = verdicts(r)
    if as_json:
        print(json.dumps(r, indent=1))
    else:
        print_report(r)
    return 0 if all(v is not False for v in r["verdicts"].values()) else 1


def scale_for(profile: LinkProfile, speedup: float, byte_scale: float | None, wire_rate: float | None) -> Scale:
    """Byte scale from the wanted wire rate when given: wire = paper / b * s."""
    if wire_rate is not None:
        return Scale(speedup, max(profile.rate * speedup / wire_rate, 1.0))
    return Scale(speedup, byte_scale or 1.0)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    lc = sub.add_parser("linkcheck", help="build one shaped link and measure RTT, goodput and loss against the profile")
    lc.add_argument("profile", help="link profile name (netem_profiles/NAME.yaml) or path")
    lc.add_argument("--speedup", type=float, default=1.0, help="time scale s (default 1)")
    g = lc.add_mutually_exclusive_group()
    g.add_argument("--byte-scale", type=float, help="byte scale b: wire rate = rate / b * s")
    g.add_argument("--wire-rate", default="1gbit", help="choose b so the wire rate is this (default 1gbit)")
    lc.add_argument("--connections", type=int, default=4, help="connections for the multi-connection goodput")
    lc.add_argument("--duration", type=float, default=4.0, help="wire seconds per goodput measurement")
    lc.add_argument("--method", choices=["auto", "netem", "fallback"], default="auto")
    lc.add_argument("--json", action="store_true", help="print JSON")
    lc.set_defaults(func=cmd_linkcheck)


def cmd_linkcheck(args: argparse.Namespace) -> int:
    from testbed.core.linkprofile import parse_rate
    from testbed.config.profiles import load_profile

    if os.geteuid() != 0:
        print("error: network namespaces need root", file=sys.stderr)
        return 1
    profile = load_profile(args.profile)        # a ProfileError is a UserError: the CLI prints it
    wire = None if args.byte_scale is not None else parse_rate(args.wire_rate)
    scale = scale_for(profile, args.speedup, args.byte_scale, wire)
    return main_linkcheck(profile, scale, args.connections, args.duration, args.method, args.json)
