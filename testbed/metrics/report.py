"""Markdown reports: `write_report` for one run, `write_comparison` for several (plots in report_plots.py).

Tables lead with paper units (what the paper's figures mean) and give wire units alongside.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from testbed.core.record import RequestRecord
from testbed.core.schema.scaling import Scale
from testbed.metrics.artefacts import RunInfo, Summary
from testbed.metrics.artefacts.summary_file import Control, Fidelity, WanLink
from testbed.metrics.control import cache_rows, change_rows, control_rows, phase_label, phase_rows, plot_control
from testbed.metrics.fault_effects import faults_section, load_faults
from testbed.metrics.fidelity import LINE_LATE_S
from testbed.metrics.markdown_table import md_table
from testbed.metrics.plot_style import run_title
from testbed.metrics.report_format import NA, fmt, fmt_bytes, fmt_change, fmt_factor, fmt_ms, fmt_pct, fmt_rate
from testbed.metrics.report_plots import plot_links, plot_queues, plot_ttft_cdf, plot_turns
from testbed.metrics.roles import decision_rows, long_term_rows, plot_roles, read_role_decisions, roles_cell
from testbed.metrics.scheduler_report import scheduler_rows
from testbed.metrics.series_format import SeriesPoint
from testbed.metrics.sessions import session_rows, turn_rows
from testbed.metrics.summary import (
    BREAKDOWN_STAGES,
    completed_ttfts_wire,
    load_records,
    load_run_meta,
    load_run_timeseries,
    read_run_info,
    summarize,
    write_summary,
)
from testbed.metrics.wanlink import plot_wan, wan_rows

if TYPE_CHECKING:
    pass

STAGE_LABELS: dict[str, str] = {
    "routing": "Routing",
    "prefill_queue": "Prefill queue",
    "prefill_compute": "Prefill compute",
    "transfer_tail": "KV transfer tail",
    "decode_queue": "Decode queue",
    "first_step": "First decode step",
    "other": "Other: network, HTTP",
}
# ---------------------------------------------------------------- rows shared by markdown and terminal


def run_label(summary: Summary) -> str:
    name, policy = summary.run.name, summary.run.policy
    return name if not policy or policy in name else f"{name} ({policy})"


def unique_labels(summaries: Sequence[Summary], dirs: Sequence[Path] | None = None) -> list[str]:
    """Run labels; where two runs share a name (repeats of one scenario), their directories tell
    them apart (the shortest tail of each path that differs), and only where those are alike too
    a number."""
    labels = [run_label(s) for s in summaries]
    if dirs is not None and len(dirs) == len(labels) and len(set(labels)) < len(labels):
        paths = [Path(d).resolve().parts for d in dirs]
        for k in range(1, max(len(p) for p in paths) + 1):
            tails = ["/".join(p[-k:]) for p in paths]
            if len(set(tails)) == len(tails):
                labels = [lab if labels.count(lab) == 1 else tail for lab, tail in zip(labels, tails)]
                break
    seen: dict[str, int] = {}
    out = []
    for lab in labels:
        seen[lab] = seen.get(lab, 0) + 1
        out.append(lab if labels.count(lab) == 1 else f"{lab} #{seen[lab]}")
    return out


STAT_LABELS: tuple[tuple[str, str], ...] = (("mean", "mean"), ("p50", "P50"), ("p90", "P90"), ("p99", "P99"))


def summary_rows(s: Summary) -> list[tuple[str, str, str]]:
    """(metric, paper units, wire units) for one run."""
    req, thr, by, eg, w = s.requests, s.throughput, s.bytes, s.wan_egress, s.wire
    tt, wt, tp, wp = s.ttft_s, w.ttft_s, s.tpot_s, w.tpot_s
    done = f"{req.completed:,} / {req.total:,}"
    rows = [
        ("Requests completed / total", done, done),
        ("Requests failed", fmt(req.failed), fmt(req.failed)),
        ("Run duration", fmt(s.run.duration_s_paper, " s"), fmt(w.duration_s, " s")),
        ("Throughput (completed)", fmt(thr.completed_rps_paper, " req/s"), fmt(thr.completed_rps_wire, " req/s")),
        ("Goodput (both SLOs)", fmt(thr.goodput_rps_paper, " req/s"), fmt(thr.goodput_rps_wire, " req/s")),
        ("SLO attainment", fmt_pct(thr.slo_attainment), fmt_pct(thr.slo_attainment)),
        ("Output tokens", fmt(thr.output_tokens_per_s_paper, " tok/s"), fmt(thr.output_tokens_per_s_wire, " tok/s")),
    ]
    for k, lab in STAT_LABELS:
        rows.append((f"TTFT {lab}", fmt(getattr(tt, k), " s"), fmt(getattr(wt, k), " s")))
    halves = s.ttft_halves_s
    if halves:
        f, la = halves.first.mean, halves.last.mean
        sp = s.run.speedup
        rows.append(
            (
                "TTFT mean, first / last half of arrivals",
                f"{fmt(f)} / {fmt(la)} s",
                f"{fmt(None if f is None else f / sp)} / {fmt(None if la is None else la / sp)} s",
            )
        )
    for k, lab in STAT_LABELS:
        rows.append((f"TPOT {lab}", fmt_ms(getattr(tp, k)), fmt_ms(getattr(wp, k))))
    off = fmt_pct(s.offload.ratio)
    rows += [
        ("Offload ratio (KV over WAN)", off, off),
        ("KV bytes per request", fmt_bytes(by.kv_per_request_paper), fmt_bytes(by.kv_per_request_wire)),
        (
            "WAN KV per offloaded request",
            fmt_bytes(by.wan_per_offloaded_request_paper),
            fmt_bytes(by.wan_per_offloaded_request_wire),
        ),
        ("KV bytes total", fmt_bytes(by.kv_total_paper), fmt_bytes(by.kv_total_wire)),
        ("WAN egress mean", fmt_rate(eg.mean_Bps_paper), fmt_rate(eg.mean_Bps_wire)),
        ("WAN egress peak", fmt_rate(eg.peak_Bps_paper), fmt_rate(eg.peak_Bps_wire)),
    ]
    return rows


def breakdown_rows(s: Summary) -> list[tuple[str, str, str, str]]:
    """(stage, paper s, wire s, share of mean TTFT)."""
    paper, wire, mean = s.ttft_breakdown_s, s.wire.ttft_breakdown_s, s.ttft_s.mean
    rows = []
    for k in BREAKDOWN_STAGES:
        p = paper.stage(k)
        rows.append(
            (
                STAGE_LABELS[k],
                fmt(p, " s"),
                fmt(wire.stage(k), " s"),
                fmt_pct(p / mean) if p is not None and mean else NA,
            )
        )
    return rows


def comparison_rows(summaries: Sequence[Summary]) -> list[tuple[str, list[str]]]:
    """(metric, one cell per run), paper units."""

    def row(label: str, f: Callable[[Summary], str]) -> tuple[str, list[str]]:
        return label, [f(s) for s in summaries]

    def ms(x: float | None) -> str:
        return fmt(None if x is None else x * 1000)

    rows = [
        row("Policy", lambda s: s.run.policy or NA),
        row("Scenario", lambda s: s.run.scenario or NA),
        row("Speedup / byte_scale", lambda s: f"{fmt_factor(s.run.speedup)} / {fmt_factor(s.run.byte_scale)}"),
        row("Shaping", lambda s: s.run.shaping_method),
        row("Completed / total", lambda s: f"{s.requests.completed:,} / {s.requests.total:,}"),
        row("Failed", lambda s: fmt(s.requests.failed)),
        row("Throughput (req/s)", lambda s: fmt(s.throughput.completed_rps_paper)),
        row("Goodput (req/s)", lambda s: fmt(s.throughput.goodput_rps_paper)),
        row("TTFT mean (s)", lambda s: fmt(s.ttft_s.mean)),
        row("TTFT P50 (s)", lambda s: fmt(s.ttft_s.p50)),
        row("TTFT P90 (s)", lambda s: fmt(s.ttft_s.p90)),
        row("TTFT P99 (s)", lambda s: fmt(s.ttft_s.p99)),
        row("TTFT mean, first / last half of arrivals (s)", _halves_cell),
    ]
    for k in BREAKDOWN_STAGES:
        rows.append(row(f"  {STAGE_LABELS[k]} (s)", lambda s, k=k: fmt(s.ttft_breakdown_s.stage(k))))  # type: ignore[misc]
    rows += [
        row("TPOT mean (ms)", lambda s: ms(s.tpot_s.mean)),
        row("TPOT P90 (ms)", lambda s: ms(s.tpot_s.p90)),
        row("Offload ratio", lambda s: fmt_pct(s.offload.ratio)),
        row("KV bytes / request", lambda s: fmt_bytes(s.bytes.kv_per_request_paper)),
        row("WAN KV / offloaded request", lambda s: fmt_bytes(s.bytes.wan_per_offloaded_request_paper)),
        row("WAN bytes / request (KV + cache moves)", lambda s: fmt_bytes(s.bytes.wan_per_request_paper)),
        row("Prompt tokens from cache", lambda s: fmt_pct(s.cache.cached_token_share if s.cache else None)),
        row("Cache moves", lambda s: fmt(s.cache.moves if s.cache else None)),
        row("Arrivals / turns sent before their parent finished", _sessions_cell),
        row("TTFT mean turn 1 / turn 2+ (s)", _turn_ttft_cell),
        row("Threshold changes / mean", lambda s: _thr_cell(s.control)),
        row("Role conversions -> PD split at the end", roles_cell),
        row("WAN egress mean (senders)", lambda s: fmt_rate(s.wan_egress.mean_Bps_paper)),
        row("WAN link mean / peak (counters)", lambda s: _wan_cell(s.wan_link)),
        row("WAN utilisation mean / peak", lambda s: _util_cell(s.wan_link)),
        row("Timing fidelity", _validity_cell),
    ]
    return rows


def _sessions_cell(s: Summary) -> str:
    ss = s.sessions
    return NA if ss is None else f"{ss.arrivals or 'open'} / {ss.early_turns:,} of {ss.follow_ups:,}"


def _turn_ttft_cell(s: Summary) -> str:
    ss = s.sessions
    if ss is None or not ss.by_turn:
        return NA
    later = [t for t in ss.by_turn if t.turn > 1 and t.ttft_mean_s is not None]
    n = sum(t.completed for t in later)
    rest = sum(t.ttft_mean_s * t.completed for t in later if t.ttft_mean_s is not None) / n if n else None
    return f"{fmt(ss.by_turn[0].ttft_mean_s)} / {fmt(rest)}"


def _halves_cell(s: Summary) -> str:
    h = s.ttft_halves_s
    return f"{fmt(h.first.mean if h else None)} / {fmt(h.last.mean if h else None)}"


def _format_or_na(x: float | None, f: str = "{:.2f}") -> str:
    return NA if x is None else f.format(x)


def _thr_cell(c: Control | None) -> str:
    if c is None or c.threshold_mean is None:
        return NA
    return f"{c.threshold_changes:,} / {c.threshold_mean:,.0f}"


def _wan_cell(w: WanLink) -> str:
    if w.mean_bps_paper is None:
        return NA
    peak = w.peak_bps_paper
    return f"{w.mean_bps_paper / 1e9:.3g} / {'n/a' if peak is None else f'{peak / 1e9:.3g}'} Gbit/s"


def _util_cell(w: WanLink) -> str:
    if w.mean_utilisation is None:
        return NA
    return f"{fmt_pct(w.mean_utilisation)} / {fmt_pct(w.peak_utilisation)}"


def verdicts(summaries: Sequence[Summary], labels: Sequence[str] | None = None) -> list[str]:
    """One line per run after the first: its mean and P90 TTFT relative to the first run."""
    labels = list(labels) if labels is not None else unique_labels(summaries)
    if not summaries:
        return []
    base = summaries[0].ttft_s
    return [
        f"{lab}: {fmt_change(s.ttft_s.mean, base.mean)} mean TTFT, "
        f"{fmt_change(s.ttft_s.p90, base.p90)} P90 TTFT vs {labels[0]}"
        for s, lab in zip(summaries[1:], labels[1:])
    ]


# ---------------------------------------------------------------- documents


def leftover_prefix(run_dir: Path) -> str | None:
    """The name `testbed down --prefix` takes for what the run started (its namespaces', local
    services' or Docker project's), from run.json; None when it recorded none."""
    facts = read_run_info(run_dir).shaping.model_dump()
    name = facts.get("prefix") or facts.get("project")
    return name if isinstance(name, str) and name.startswith("ptb") else None


def cut_short_note(s: Summary, prefix: str | None = None) -> str:
    """What happened to a run whose process died before closing it (run.json still `running`);
    `prefix`: the run's name for `testbed down` (`leftover_prefix`)."""
    planned = s.run.trace_requests
    recorded = s.requests.total
    lost = (
        ""
        if planned is None
        else (
            f" of {fmt(planned)} requests, {fmt(recorded)} have a record and {fmt(max(planned - recorded, 0))} none "
            "(never sent, or lost in flight with the process);"
        )
    )
    return (
        "> **CUT SHORT:** the run's process ended without closing the run (killed, or crashed);"
        + lost
        + " figures cover the recorded requests only. "
        f"`testbed down{f' --prefix {prefix}' if prefix else ''}` removes what the run left running."
    )


def write_report(
    run_dir: Path,
    summary: Summary | None = None,
    records: Sequence[RequestRecord] | None = None,
    samples: Sequence[SeriesPoint] | None = None,
) -> Path:
    """Write `report.md` and its plots into the run directory; returns the report's path.

    Without `summary`, recomputes it and rewrites `summary.json`, so the two always agree.
    `records` and `samples`: the run's, as `load_records` and `load_run_timeseries` read them, for
    a caller that holds them already (a million records take seconds to read).
    """
    run_dir = Path(run_dir)
    s = summary if summary is not None else write_summary(run_dir, records, samples)
    run = s.run
    scale = Scale(run.speedup, run.byte_scale)
    records = load_records(run_dir) if records is None else records
    samples = load_run_timeseries(run_dir, load_run_meta(run_dir)) if samples is None else samples
    plots = _write_plots(run_dir, s, records, samples)

    out = [f"# Run report: {run.name}", "", _preamble(s), ""]
    if run.cut_short:
        out += [cut_short_note(s, leftover_prefix(run_dir)), ""]
    elif run.interrupted:
        out += ["> **Note:** the run was interrupted; figures cover the requests that finished.", ""]
    fid = s.fidelity
    if s.validity is not None and not s.validity.valid:
        out += [
            "> **INVALID RUN:** the testbed could not keep the scenario's time, so its figures are not "
            "measurements of the scenario: " + "; ".join(s.validity.reasons) + ".",
            "",
        ]
    out += ["## Summary", "", md_table(["Metric", "Paper units", "Wire units"], summary_rows(s)), ""]
    wrows = wan_rows(s.wan_link)
    if wrows:
        out += ["## WAN link", "", _shaping_line(run_dir), "", md_table(["WAN", "Paper units"], wrows), ""]
    prow = phase_rows(s)
    if prow:
        out += [
            "### By link phase",
            "",
            "Requests by the configured rate in force when they arrived (the link schedule).",
            "",
            md_table(
                ["phase (paper)", "requests", "TTFT mean / P90 (s)", "KV tail, offloaded (ms)", "offloaded"], prow
            ),
            "",
        ]
    crows = cache_rows(s)
    if crows:
        out += ["## Prefix caches", "", md_table(["Cache", "Value"], crows), ""]
    if s.sessions is not None:
        out += [
            "## Sessions",
            "",
            md_table(["Sessions", "Value"], session_rows(s.sessions)),
            "",
            md_table(["Turn", "Requests", "TTFT mean (s)", "TTFT P90 (s)", "Cached prompt (%)"], turn_rows(s.sessions)),
            "",
        ]
    srows = scheduler_rows(run_dir, read_run_info(run_dir), scale)
    if srows:
        out += ["## Scheduler", "", md_table(["Scheduler", "Value"], srows), ""]
    krows = control_rows(s)
    if krows:
        out += ["## Control loop", "", md_table(["Control", "Value"], krows), ""]
        changes = change_rows(s)
        if changes:
            out += [
                "Threshold changes (the first 20; all in `summary.json` and `decisions.jsonl`):",
                "",
                md_table(["t (paper s)", "from", "to", "reason"], changes),
                "",
            ]
    lrows = long_term_rows(s)
    if lrows:
        out += ["## Long-term loop", "", md_table(["Long-term loop", "Value"], lrows), ""]
        drows = decision_rows(s)
        if drows:
            out += [
                "Decisions (the first 20; all in `decisions.jsonl`, the first 50 in `summary.json`):",
                "",
                md_table(["t (paper s)", "action", "P/D after", "t after", "reason"], drows),
                "",
            ]
    out += [
        "## TTFT breakdown",
        "",
        "Mean per stage over completed requests; the stages sum to the mean TTFT.",
        "",
        md_table(["Stage", "Paper", "Wire", "Share of TTFT"], breakdown_rows(s)),
        "",
        "## Failures",
        "",
    ]
    reasons = s.requests.failure_reasons
    if s.requests.failure_kinds:
        out += [md_table(["Kind", "Requests"], [(k, fmt(n)) for k, n in s.requests.failure_kinds.items()]), ""]
    if s.requests.failure_nodes:
        out += [md_table(["Failed at", "Requests"], [(k, fmt(n)) for k, n in s.requests.failure_nodes.items()]), ""]
    out.append(md_table(["Reason", "Requests"], [(r, fmt(n)) for r, n in reasons.items()]) if reasons else "None.")
    if s.requests.pending:
        out += ["", f"Requests that never finished (run interrupted): {fmt(s.requests.pending)}."]
    out += ["", *faults_section(run_dir, records, scale.speedup, samples)]
    out += ["## Timing fidelity", "", _fidelity_line(fid), "", "## Plots", ""]
    out += [f"![{title}]({p.name})\n" for title, p in plots]
    path = run_dir / "report.md"
    path.write_text("\n".join(out).rstrip() + "\n")
    return path


def write_plots(run_dir: Path, summary: Summary | None = None) -> list[tuple[str, Path]]:
    """The run's plots alone (no report.md), from its records and time series: (title, path)
    of each written. Without `summary`, the one in summary.json, else recomputed."""
    run_dir = Path(run_dir)
    if summary is None:
        from testbed.metrics.summary import read_summary

        summary = read_summary(run_dir) if (run_dir / "summary.json").exists() else summarize(run_dir)
    return _write_plots(run_dir, summary, load_records(run_dir), load_run_timeseries(run_dir, load_run_meta(run_dir)))


def _write_plots(
    run_dir: Path, s: Summary, records: Sequence[Any], samples: Sequence[SeriesPoint]
) -> list[tuple[str, Path]]:
    """Every plot the run's data makes, each titled with the run's name (and INVALID when so)."""
    scale = Scale(s.run.speedup, s.run.byte_scale)
    ttfts = [t * scale.speedup for t in completed_ttfts_wire(records)]
    wan_series = frozenset(k for k, v in s.links.items() if v.wan)
    faults = load_faults(run_dir)

    def title(what: str) -> str:
        return run_title(s.run.name, s.valid, what)

    plots = [
        (
            "TTFT CDF",
            plot_ttft_cdf([(run_label(s), ttfts)], run_dir / "ttft_cdf.png", s.run.slo_ttft_s, title("TTFT CDF")),
        )
    ]
    if s.sessions is not None:
        plots.append(("TTFT and cache hit by turn", plot_turns(s.sessions, run_dir / "turns.png", title("by turn"))))
    for name, p in (
        ("Queues", plot_queues(samples, scale.speedup, run_dir / "queues.png", faults, title("queues"))),
        ("KV egress", plot_links(samples, scale, run_dir / "links.png", wan_series, faults, title("KV egress"))),
        ("WAN link", plot_wan(samples, scale, run_dir / "wan.png", faults, title("WAN link"))),
        (
            "Threshold and WAN bandwidth (control loop)",
            plot_control(samples, scale, run_dir / "control.png", faults, title("control loop")),
        ),
        (
            "PD roles, stage loads and threshold (long-term loop)",
            plot_roles(
                samples,
                read_role_decisions(run_dir, load_run_meta(run_dir).t0, scale.speedup),
                scale,
                run_dir / "roles.png",
                faults,
                title("long-term loop"),
            ),
        ),
    ):
        if p is not None:
            plots.append((name, p))
    return plots


def _shaping_line(run_dir: Path) -> str:
    """How the link was shaped, from run.json, in one sentence."""
    try:
        info: RunInfo = read_run_info(run_dir)
    except (OSError, ValueError):
        return ""
    sh = info.shaping
    parts = [f"Shaping method **{sh.method}**"]
    if sh.profile:
        parts.append(f"profile `{sh.profile}`")
    if sh.mtu:
        parts.append(f"MTU {sh.mtu}")
    if sh.links:
        k, v = next(iter(sh.links.items()))
        queue = f", queue {v.queue_bytes} B" if v.queue_bytes is not None else ""  # a flow model has none
        rate = NA if v.rate_bps_wire is None else f"{v.rate_bps_wire / 1e6:.4g}"
        delay = NA if v.delay_s_wire is None else f"{v.delay_s_wire * 1e3:.3g}"
        parts.append(f"{k}: {rate} Mbit/s wire, one-way delay {delay} ms wire, loss {v.loss:.2%}{queue}")
    detail = sh.detail
    return ", ".join(parts) + "." + (f" {detail}." if detail else "")


def _preamble(s: Summary) -> str:
    run = s.run
    thr = "" if run.threshold is None else f" (threshold {fmt(run.threshold)} tokens)"
    slo = ""
    if run.slo_ttft_s is not None and run.slo_tpot_s is not None:
        slo = f" SLOs: TTFT <= {fmt(run.slo_ttft_s, ' s')}, TPOT <= {fmt_ms(run.slo_tpot_s)}."
    rate = "" if run.offered_rate_rps is None else f" Offered load {fmt(run.offered_rate_rps, ' req/s')}."
    return (
        f"Scenario **{run.scenario or NA}**, policy **{run.policy or NA}**{thr}.{rate}{slo}\n\n"
        f"Scale: speedup s = {fmt_factor(run.speedup)} (wire time = paper time / s), "
        f"byte_scale b = {fmt_factor(run.byte_scale)} (wire KV bytes = paper bytes / b). "
        f"WAN shaping: **{run.shaping_method}**{shaping_note(run.shaping_method)}. Figures are in paper units; "
        "wire units are what this machine measured."
    )


def _validity_cell(s: Summary) -> str:
    return "ok" if s.valid else "INVALID"


def _fidelity_line(fid: Fidelity) -> str:
    b = fid.bounds
    parts = []
    if fid.n:
        parts.append(
            f"Median prefill timing error {fmt_ms(fid.prefill_abs_err_median_s)} wire "
            f"({fmt_pct(fid.prefill_rel_err_median)} of the modelled time, bound "
            f"{fmt_pct(b.prefill_rel_err_median)}) over {fmt(fid.n)} requests."
        )
    else:
        parts.append("No records with both measured and modelled prefill times.")
    if fid.decode_step_late_share is not None:
        parts.append(
            f"Decode steps ended {fmt_pct(fid.decode_step_late_share)} late against the model "
            f"(bound {fmt_pct(b.decode_step_late_share)})."
        )
    if fid.token_lag_p90_s_paper is not None:
        parts.append(
            f"Token delivery lag P90 {fmt_ms(fid.token_lag_p90_s_paper)} paper "
            f"(bound {fmt_ms(b.token_lag_p90_s_paper)})."
        )
    if fid.router_overhead_p90_s_paper is not None:
        parts.append(
            f"Router overhead P90 {fmt_ms(fid.router_overhead_p90_s_paper)} paper "
            f"(bound {fmt_ms(b.router_overhead_p90_s_paper)})."
        )
    if fid.fault_late_max_s_paper is not None:
        parts.append(
            f"Fault steps took effect at most {fmt_ms(fid.fault_late_max_s_paper)} paper after their schedule "
            f"(bound {fmt_ms(b.fault_late_max_s_paper)})."
        )
    if fid.fault_steps_failed:
        parts.append(f"{len(fid.fault_steps_failed)} fault step(s) failed: {'; '.join(fid.fault_steps_failed)}.")
    if fid.wan_line_late_mean_s_wire is not None:
        share = fid.wan_line_late_share_of_delay
        parts.append(
            f"The WAN delay line wrote packets {fmt_ms(fid.wan_line_late_mean_s_wire)} wire late on average"
            + ("" if share is None else f" ({fmt_pct(share)} of the one-way delay)")
            + f", {fmt_pct(fid.wan_line_late_packets)} of them by more than "
            f"{fmt_ms(LINE_LATE_S)} (reported, not judged)."
        )
    if fid.cpu_busy_mean is not None:
        parts.append(
            f"Host CPUs {fmt_pct(fid.cpu_busy_mean)} busy on average, saturated "
            f"{fmt_pct(fid.cpu_saturated_share)} of the run."
        )
    return " ".join(parts)


def write_comparison(run_dirs: Sequence[Path], out_dir: Path, summaries: Sequence[Summary] | None = None) -> Path:
    """Write `comparison.md` and `ttft_cdf.png` (all runs on one plot) into `out_dir`.

    The first run is the baseline of the verdicts. Run directories are only read; `summaries`
    (one per run, in order) saves recomputing them.
    """
    if not run_dirs:
        raise ValueError("write_comparison needs at least one run directory")
    dirs = [Path(d) for d in run_dirs]
    if summaries is None:
        summaries = [summarize(d) for d in dirs]
    elif len(summaries) != len(dirs):
        raise ValueError(f"{len(summaries)} summaries for {len(dirs)} run directories")
    labels = unique_labels(summaries, dirs)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    curves = [
        (lab if s.valid else f"{lab} (INVALID)", [t * s.run.speedup for t in completed_ttfts_wire(load_records(d))])
        for lab, s, d in zip(labels, summaries, dirs)
    ]
    slos = {s.run.slo_ttft_s for s in summaries}
    bad = [lab for lab, s in zip(labels, summaries) if not s.valid]
    plot_ttft_cdf(
        curves,
        out_dir / "ttft_cdf.png",
        slos.pop() if len(slos) == 1 else None,
        f"TTFT CDF: {' vs '.join(labels)}" + (f" (INVALID: {', '.join(bad)})" if bad else ""),
    )

    out = [f"# Comparison: {' vs '.join(labels)}", ""]
    for lab, s in zip(labels, summaries):
        if not s.valid and s.validity is not None:
            out += [
                f"> **INVALID RUN {lab}:** the testbed could not keep the scenario's time, so its figures are not "
                "measurements of the scenario: " + "; ".join(s.validity.reasons) + ".",
                "",
            ]
    out.append(f"All figures in paper units. Baseline for the verdicts: **{labels[0]}**.")
    setups = {(s.run.speedup, s.run.byte_scale, s.run.shaping_method) for s in summaries}
    if len(setups) > 1:
        out.append(
            "Note: the runs differ in scale or shaping method (see the table); paper units stay comparable, "
            "testbed artefacts may not."
        )
    out += ["", "## Verdict", ""]
    out += [f"- {v}" for v in verdicts(summaries, labels)] or ["- Only one run: nothing to compare."]
    out += ["", "## Side by side", ""]
    out.append(md_table(["Metric", *labels], [(m, *cells) for m, cells in comparison_rows(summaries)]))
    phases = [s.link_phases for s in summaries]
    if phases[0] and all(len(p) == len(phases[0]) for p in phases):
        out += [
            "",
            "## By link phase",
            "",
            "Mean / P90 TTFT (s) of the requests that arrived while each configured "
            "rate was in force; then the mean KV transfer tail of the offloaded ones.",
            "",
        ]
        rows = []
        for k, ph in enumerate(phases[0]):
            rows.append(
                (
                    phase_label(ph),
                    *[f"{_format_or_na(p[k].ttft_mean_s)} / {_format_or_na(p[k].ttft_p90_s)}" for p in phases],
                )
            )
            tails = [p[k].tail_mean_s for p in phases]
            rows.append(("  KV tail (ms)", *[_format_or_na(None if t is None else t * 1e3, "{:,.0f}") for t in tails]))
        out.append(md_table(["phase", *labels], rows))
    out += ["", "## TTFT CDF", "", "![TTFT CDF](ttft_cdf.png)", "", "## Runs", ""]
    out += [f"- {lab}: `{d}`" for lab, d in zip(labels, dirs)]
    path = out_dir / "comparison.md"
    path.write_text("\n".join(out) + "\n")
    return path


# What each shaping method means, for a reader who has not read the WAN-links guide.
SHAPING_NOTES = {
    "netem": "the kernel's netem shapes delay, jitter, loss and rate",
    "fallback": "this kernel has no netem: HTB limits the rate, the testbed's userspace delay line adds delay, "
    "jitter and loss",
    "none": "no WAN emulated: services talk over loopback",
    "sim": "modelled by the simulator, nothing on a wire",
}


def shaping_note(method: str | None) -> str:
    """` (what the method means)` for a known shaping method, else nothing."""
    note = SHAPING_NOTES.get(method or "")
    return f" ({note})" if note else ""
