"""`testbed linkcheck --compare-methods`: one profile shaped by netem and by the userspace delay
line, each measured as `testbed.studies.linkcheck.linkcheck` measures a link, side by side."""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import cast

from testbed.core.schema.linkprofile import LinkProfile
from testbed.core.schema.scaling import Scale
from testbed.live.kv_transport import KVReceiver
from testbed.metrics.markdown_table import md_table, table_lines
from testbed.net.capabilities import probe_shaping
from testbed.net.topology import Method
from testbed.studies.linkcheck.linkcheck import (
    KV_PORT,
    LinkCheckConfig,
    _configured,
    _goodput,
    measure_loss,
    measure_rtt_checked,
    rtt_tolerance,
    shaped_link,
)
from testbed.studies.linkcheck.linkcheck_report import _past_ramp, rtt_invalid_cell, rtt_valid, shaped_rtt, verdicts
from testbed.studies.linkcheck.linkcheck_types import (
    Goodput,
    LinkCheckResult,
    MethodComparison,
    ProbeFigures,
    ScaleFigures,
)

COMPARED: tuple[Method, Method] = ("netem", "fallback")


def measure_method(cfg: LinkCheckConfig, method: Method) -> LinkCheckResult:
    """What `method` makes of the profile: RTT and its spread, the probe stream's loss, loss
    correlation, reordering and one-way delay spread, goodput on 1 and N connections."""
    with shaped_link(cfg, method) as link:
        out = _configured(cfg, method, link.topo.mtu)
        b = link.topo.host("b")
        out["rtt"] = measure_rtt_checked(link, cfg.rtt_probes, rtt_tolerance(2 * link.params.delay_s))
        run, out["loss"] = measure_loss(link, cfg.loss_probes)
        out["probes"] = cast(ProbeFigures, asdict(run.stats))
        receiver = KVReceiver()
        link.lb.run(receiver.start(b.ip, KV_PORT))
        nbytes = int(link.params.rate_bps / 8 * cfg.duration_s)
        timeout = cfg.duration_s * 20 + 30
        ids = itertools.count(1)
        out["goodput"] = [
            _goodput(
                link.la, link.lb, receiver, (b.ip, KV_PORT), nbytes, n, next(ids), cfg.profile.tcp.congestion, timeout
            )
            for n in (cfg.connections, 1)
        ]
        link.lb.run(receiver.close())
    out["verdicts"] = verdicts(out)
    return out


def compare_methods(cfg: LinkCheckConfig) -> MethodComparison:
    return {"profile": cfg.profile.name, "methods": {m: measure_method(cfg, m) for m in COMPARED}}


def _ms(x: float | None) -> str:
    return f"{x * 1e3:.2f} ms" if x is not None and math.isfinite(x) else "-"


def _pct(x: float | None, digits: int = 2) -> str:
    return f"{x:.{digits}%}" if x is not None else "-"


def compare_rows(c: MethodComparison) -> list[tuple[str, str, list[str]]]:
    """(measure, configured, one cell per method in COMPARED) for one profile."""
    rs = [c["methods"][m] for m in COMPARED]
    cfg = rs[0]["configured"]
    fail = {True: "", False: " FAIL", None: ""}

    def cells(f: Callable[[LinkCheckResult], str]) -> list[str]:
        return [f(r) for r in rs]

    rows = [
        (
            "RTT median",
            _ms(cfg["rtt_s_wire"]),
            cells(
                lambda r: (
                    f"{_ms(r['rtt']['median_s'])} (unshaped {_ms(r['rtt']['base_median_s'])})"
                    + (fail[r["verdicts"]["rtt"]] if rtt_valid(r) else " " + rtt_invalid_cell(r))
                )
            ),
        ),
        (
            "RTT sd",
            f"jitter {_ms(cfg['jitter_s_wire'])} each way",
            cells(lambda r: f"{_ms(r['rtt']['sd_s'])} (unshaped {_ms(r['rtt']['base_sd_s'])})"),
        ),
        ("one-way delay sd", "-", cells(lambda r: _ms(r["probes"]["delay_sd_s"]))),
        (
            "loss",
            _pct(cfg["loss"]),
            cells(
                lambda r: (
                    (f"{_pct(r['loss']['link'])} of {r['probes']['sent']}" + fail[r["verdicts"]["loss"]])
                    if r["loss"]["valid"]
                    else f"INVALID ({_pct(r['probes']['loss'])} of {r['probes']['sent']}: "
                    + "; ".join(r["loss"]["reasons"])
                    + ")"
                )
            ),
        ),
    ]
    if cfg["loss_correlation"]:
        rows.append(
            (
                "loss correlation (lag 1)",
                f"{cfg['loss_correlation']:g}",
                cells(
                    lambda r: (
                        f"{r['probes']['loss_correlation']:.3f}" if r["probes"]["loss_correlation"] is not None else "-"
                    )
                ),
            )
        )
    rows.append(("reordered probes", "0", cells(lambda r: _pct(r["probes"]["reordered"], 3))))
    for i, g in enumerate(rs[0]["goodput"]):

        def goodput(r: LinkCheckResult, i: int = i) -> str:
            gi = r["goodput"][i]
            text = f"{bps / 1e6:.1f} Mbit/s" + _past_ramp(gi) if (bps := gi["bps"]) else f"failed: {gi['reason']}"
            return text + (fail[r["verdicts"]["goodput_multi"]] if i == 0 else "")

        rows.append((f"goodput, {g['connections']} conn", f"{cfg['rate_bps_wire'] / 1e6:.1f} Mbit/s", cells(goodput)))
    return rows


def compare_markdown(results: list[MethodComparison]) -> str:
    s: ScaleFigures = results[0]["methods"][COMPARED[0]]["scale"] if results else {"speedup": 1.0, "byte_scale": 1.0}
    lines = [
        f"linkcheck --compare-methods (speedup {s['speedup']:g}; wire figures; FAIL: outside "
        "linkcheck's bar: RTT 1 ms or 3% over the unshaped path, loss 0.3 points, goodput on "
        "N connections past TCP's ramp 90% of the rate)",
        "",
        *table_lines(
            ["profile", "measure", "configured", *COMPARED],
            [
                [c["profile"] if k == 0 else "", measure, conf, *cells]
                for c in results
                for k, (measure, conf, cells) in enumerate(compare_rows(c))
            ],
        ),
    ]
    return "\n".join(lines) + "\n"


def _loss_with_corr(r: LinkCheckResult) -> str:
    if not r["loss"]["valid"]:
        return "INVALID"
    corr = r["probes"]["loss_correlation"]
    return _pct(r["loss"]["link"]) + (f" ({corr:.2f})" if corr is not None and r["configured"]["loss"] else "")


def compare_summary(results: list[MethodComparison]) -> str:
    """One row per profile, netem / the delay line in each cell: the table the README quotes."""

    def pair(c: MethodComparison, f: Callable[[LinkCheckResult], str]) -> str:
        return " / ".join(f(c["methods"][m]) for m in COMPARED)

    def mbit(g: Goodput) -> str:
        return f"{g['bps'] / 1e6:.1f}" if g["bps"] else "failed"

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.2f}"

    head = [
        "profile",
        "RTT (ms)",
        "RTT added",
        "RTT sd",
        "one-way delay sd",
        "loss (corr)",
        "measured",
        "goodput, 4 conn (Mbit/s)",
        "1 conn",
    ]
    rows: list[list[str]] = []
    for c in results:
        cfg = c["methods"][COMPARED[0]]["configured"]
        corr = f" ({cfg['loss_correlation']:g})" if cfg["loss_correlation"] else ""
        cells = [
            c["profile"],
            ms(cfg["rtt_s_wire"]),
            pair(c, lambda r: ms(shaped_rtt(r))),
            pair(c, lambda r: ms(r["rtt"]["sd_s"])),
            pair(c, lambda r: ms(r["probes"]["delay_sd_s"])),
            _pct(cfg["loss"]) + corr,
            pair(c, _loss_with_corr),
            f"{cfg['rate_bps_wire'] / 1e6:.0f}: " + pair(c, lambda r: mbit(r["goodput"][0])),
            pair(c, lambda r: mbit(r["goodput"][1])),
        ]
        rows.append(cells)
    return md_table(head, rows) + "\n"


def print_compare(c: MethodComparison) -> None:
    from rich.console import Console
    from rich.table import Table

    r0 = c["methods"][COMPARED[0]]
    t = Table(
        title=f"linkcheck --compare-methods {c['profile']}: MTU {r0['mtu']}, "
        f"speedup {r0['scale']['speedup']:g}, byte_scale {r0['scale']['byte_scale']:g}"
    )
    for col in ("measure", "configured (wire)", *COMPARED):
        t.add_column(col)
    for measure, conf, cells in compare_rows(c):
        t.add_row(measure, conf, *cells)
    Console().print(t)


def main_compare(
    profiles: list[LinkProfile],
    scales: list[Scale],
    connections: int,
    duration: float,
    as_json: bool,
    out: Path | None,
    rtt_probes: int = 200,
    loss_probes: int | None = 20000,
) -> int:
    import json

    caps = probe_shaping()
    if not (caps.netem and caps.htb and caps.tun):
        print(
            f"linkcheck --compare-methods needs both netem and the delay line (HTB + TUN); this kernel "
            f"has netem={caps.netem} htb={caps.htb} tun={caps.tun} (tests/netem/run_uml.sh runs one that has)",
            file=sys.stderr,
        )
        return 2
    results = []
    for profile, scale in zip(profiles, scales):
        c = compare_methods(LinkCheckConfig(profile, scale, connections, duration, loss_probes, rtt_probes))
        results.append(c)
        if not as_json:
            print_compare(c)
            sys.stdout.flush()
    if as_json:
        print(json.dumps(results, indent=1))
    md = compare_summary(results) + "\n" + compare_markdown(results)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare-methods.md").write_text(md)
        (out / "compare-methods.json").write_text(json.dumps(results, indent=1) + "\n")
        print(f"linkcheck: wrote {out / 'compare-methods.md'} and compare-methods.json", file=sys.stderr)
    elif not as_json:
        print(md)
    return 0
