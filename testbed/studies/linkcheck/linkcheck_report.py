"""`testbed linkcheck`'s judgement and output: the verdicts against each bar, the printed table, and the
run over several profiles."""

from __future__ import annotations

import math
import sys

from testbed.core.schema.linkprofile import LinkProfile
from testbed.core.schema.scaling import Scale
from testbed.studies.linkcheck.linkcheck import (
    LOSS_BAR,
    LinkCheckConfig,
    multi_goodput_bps,
    rtt_tolerance,
    run_linkcheck,
)
from testbed.studies.linkcheck.linkcheck_types import Goodput, LinkCheckResult, LossFigures


def rtt_valid(r: LinkCheckResult) -> bool:
    """Whether the RTT figure measured the link (results written before it was judged: yes)."""
    return bool(r["rtt"].get("valid", True))


def rtt_invalid_cell(r: LinkCheckResult) -> str:
    return "INVALID: " + "; ".join(r["rtt"]["reasons"])


def shaped_rtt(r: LinkCheckResult) -> float:
    """The RTT the shaping adds: measured median less the unshaped path's (0 when not measured)."""
    base = r["rtt"].get("base_median_s")
    return float(r["rtt"]["median_s"]) - (float(base) if base is not None and math.isfinite(base) else 0.0)


def loss_cell(lo: LossFigures) -> str:
    """The loss figure as measured: the link's, with what the host dropped beside it, or the
    probes' figure marked INVALID with why (never shown as the link's)."""
    lost = lo["sent"] - lo["received"]
    if not lo["valid"]:
        raw = f"{lo['measured']:.2%}" if lo["measured"] is not None else "-"
        return f"INVALID: probes lost {raw} ({lost} of {lo['sent']}): " + "; ".join(lo["reasons"])
    st = lo["by_stage"]
    host = st.get("before", 0) + st.get("after", 0)
    seen = lo["sent"] - st.get("before", 0)
    return f"{lo['link']:.2%} ({st.get('model', 0)} of {seen})" + (
        f"; the host dropped {host} more ({_places(lo['host_drops'])}), kept out of the figure" if host else ""
    )


def _places(drops: dict[str, int]) -> str:
    return ", ".join(f"{n} at {p}" for p, n in drops.items() if "netem" not in p and "packets_dropped" not in p)


def verdicts(r: LinkCheckResult) -> dict[str, bool | None]:
    c = r["configured"]
    rtt = shaped_rtt(r)
    multi = r["goodput"][0]
    loss = r["loss"]
    out: dict[str, bool | None] = {
        # An invalid figure (the host too busy to time the link) measured nothing of it: None.
        "rtt": (None if not rtt_valid(r) else abs(rtt - c["rtt_s_wire"]) <= rtt_tolerance(c["rtt_s_wire"])),
        "goodput_multi": (g := multi_goodput_bps(multi)) is not None and g >= 0.9 * c["rate_bps_wire"],
        # An invalid figure measured nothing of the link: None, neither pass nor fail.
        "loss": None if not loss["valid"] or (link := loss["link"]) is None else abs(link - c["loss"]) <= LOSS_BAR,
    }
    if "rate_change" in r:
        f = r["rate_change"]["follow_s"]
        out["rate_change"] = f is not None and f <= 0.2
    return out


def print_report(r: LinkCheckResult) -> None:
    from rich.console import Console
    from rich.table import Table

    c, s = r["configured"], r["scale"]
    t = Table(
        title=f"linkcheck {r['profile']}: method {r['method']}, MTU {r['mtu']}, "
        f"speedup {s['speedup']:g}, byte_scale {s['byte_scale']:g}"
    )
    for col in ("measure", "configured / predicted (wire)", "achieved (wire)", "achieved (paper)", "bar"):
        t.add_column(col)
    v = verdicts(r)
    mark = {True: "PASS", False: "FAIL", None: "-"}
    loss_mark = "INVALID" if not r["loss"]["valid"] else mark[v["loss"]]
    sc = Scale(s["speedup"], s["byte_scale"])
    base = r["rtt"].get("base_median_s")
    over = f", over the unshaped {base * 1e3:.2f} ms" if base is not None and math.isfinite(base) else ""
    t.add_row(
        "RTT median",
        f"{c['rtt_s_wire'] * 1e3:.2f} ms",
        f"{r['rtt']['median_s'] * 1e3:.2f} ms (p10 {r['rtt']['p10_s'] * 1e3:.2f}, p90 {r['rtt']['p90_s'] * 1e3:.2f})",
        f"{sc.paper_seconds(r['rtt']['median_s']) * 1e3:.2f} ms",
        (mark[v["rtt"]] if rtt_valid(r) else rtt_invalid_cell(r)) + f" (1 ms or 3%{over})",
    )
    for g in r["goodput"]:
        pred = g.get("predicted_bps") or c["rate_bps_wire"]
        label = f"goodput, {g['connections']} conn" + (
            f", receiver SO_RCVBUF {g['rcvbuf'] / 1e6:.2f} MB" if g.get("rcvbuf") else ""
        )
        ach = g["bps"]
        bar = (
            (mark[v["goodput_multi"]] + " (past the ramp >= 90% of rate)")
            if g is r["goodput"][0]
            else "INVALID: " + "; ".join(g["reasons"])
            if not g.get("valid", True)
            else (
                f"{ach / pred:.0%} of min(rate, window {w / 1e6:.2f} MB / RTT)"
                if ach and (w := g.get("peer_window_bytes"))
                else "-"
            )
        )
        t.add_row(
            label,
            f"{pred / 1e6:.1f} Mbit/s",
            f"{ach / 1e6:.1f} Mbit/s{_past_ramp(g)}" if ach else f"failed: {g['reason']}",
            f"{sc.paper_rate_bps(ach) / 1e9:.2f} Gbit/s" if ach else "-",
            bar,
        )
    if ip := r.get("iperf3"):
        t.add_row(
            f"iperf3, {ip['connections']} conn",
            f"{c['rate_bps_wire'] / 1e6:.1f} Mbit/s",
            f"{ip['bps'] / 1e6:.1f} Mbit/s" if "bps" in ip else ip.get("error", "?"),
            "-",
            "-",
        )
    else:
        t.add_row("iperf3", "-", "not installed", "-", "-")
    lo = r["loss"]
    t.add_row(
        "loss", f"{c['loss']:.2%} (corr {c['loss_correlation']:g})", loss_cell(lo), "-", loss_mark + " (within 0.3 pp)"
    )
    if "rate_change" in r:
        rc = r["rate_change"]
        f = rc["follow_s"]
        t.add_row(
            "rate change",
            f"{rc['old_bps'] / 1e6:.0f} -> {rc['new_bps'] / 1e6:.0f} Mbit/s",
            f"followed in {f * 1e3:.0f} ms" if f is not None else "did not follow",
            "-",
            mark[v["rate_change"]] + " (within 200 ms)",
        )
    Console().print(t)


def main_linkcheck(
    profiles: list[LinkProfile],
    scales: list[Scale],
    connections: int,
    duration: float,
    method: str,
    as_json: bool,
    rtt_probes: int = 200,
    loss_probes: int | None = 20000,
) -> int:
    """Check each profile in turn (one process: a slow machine pays the start-up once)."""
    import json

    results = []
    for profile, scale in zip(profiles, scales):
        r = run_linkcheck(
            LinkCheckConfig(profile, scale, connections, duration, loss_probes, rtt_probes, method=method)
        )
        r["verdicts"] = verdicts(r)
        results.append(r)
        if not as_json:
            print_report(r)
            sys.stdout.flush()
    if as_json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=1))
    failed = [r["profile"] for r in results if any(v is False for v in r["verdicts"].values())]
    invalid = [r["profile"] for r in results if not r["loss"]["valid"]]
    untimed = [r["profile"] for r in results if not rtt_valid(r)]
    if len(results) > 1 and not as_json:
        print(
            f"linkcheck: {len(results) - len(failed)} of {len(results)} profiles within their bars"
            + (f"; outside: {', '.join(failed)}" if failed else "")
            + (f"; loss not measured (INVALID): {', '.join(invalid)}" if invalid else "")
            + (f"; RTT not measured (INVALID): {', '.join(untimed)}" if untimed else "")
        )
    return 1 if failed else 0


def _past_ramp(g: Goodput) -> str:
    return f" (past the ramp {steady / 1e6:.1f})" if (steady := g.get("steady_bps")) else ""
