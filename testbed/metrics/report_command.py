"""CLI subcommands `report` and `compare` (registered into the main parser by `register`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from testbed.config.cli_args import StoreOnce, out_dir
from testbed.metrics.artefacts import Summary

if TYPE_CHECKING:
    from testbed.core.record import RequestRecord


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "report",
        help="recompute summary.json and report.md of a run",
        description="Recompute RUN_DIR/summary.json, report.md and its plots from the run's records and time series.",
    )
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory (what replay --out wrote)")
    p.add_argument("--json", action="store_true", help="print summary.json instead of a table")
    p.set_defaults(func=cmd_report)

    c = sub.add_parser(
        "compare",
        help="put runs side by side (paper units)",
        description="Compare runs side by side in paper units; the first run is the baseline of the verdicts.",
    )
    c.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="run directories to set side by side")
    c.add_argument(
        "--out", action=StoreOnce, type=out_dir, metavar="DIR", help="also write DIR/comparison.md and DIR/ttft_cdf.png"
    )
    c.add_argument("--json", action="store_true", help="print the summaries and verdicts as JSON")
    c.add_argument(
        "--csv",
        action=StoreOnce,
        type=Path,
        metavar="FILE",
        help="also write FILE: one row per run, its directory, validity and every figure of its "
        "summary.json as a dotted column (ttft_s.p90, throughput.goodput_rps_paper, ...)",
    )
    c.add_argument(
        "--accept-invalid", action="store_true", help="exit 0 even when a run is marked invalid (without it: exit 3)"
    )
    c.set_defaults(func=cmd_compare)

    pl = sub.add_parser(
        "plot",
        help="write the plots of runs (simulated ones included) without a report",
        description="Write each RUN_DIR's plots (ttft_cdf.png, queues.png, and links.png, wan.png, control.png, "
        "roles.png where the run has their data) from its records and time series; each plot names "
        "its run and says INVALID when the testbed marked the run so.",
    )
    pl.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="run directories whose plots to write")
    pl.set_defaults(func=cmd_plot)

    ex = sub.add_parser(
        "export",
        help="write a run's records.csv and decisions.jsonl from its Parquet files",
        description="Write records.csv and decisions.jsonl into each RUN_DIR from its records.parquet and "
        "decisions.parquet (a simulated run of more than 20,000 requests writes only those): the lines "
        "the run would have written. A file that exists already is left as it is.",
    )
    ex.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="run directories to export")
    ex.set_defaults(func=cmd_export)


def cmd_report(args: argparse.Namespace) -> int:
    # Imported here: matplotlib costs ~0.5 s, which every other `testbed` command would pay.
    from testbed.metrics.report import write_report
    from testbed.metrics.summary import load_run_meta, load_run_timeseries, write_summary

    run_dir: Path = args.run_dir
    # A missing or malformed run file raises a UserError naming it (RunDirError, RecordFormatError,
    # TimeseriesError): the CLI prints it; anything else is a bug and keeps its traceback.
    # The records and series are read once, for the summary and the report alike.
    meta = load_run_meta(run_dir)  # run.json first: its errors before the records'
    records = _records(run_dir)
    samples = load_run_timeseries(run_dir, meta)
    summary = write_summary(run_dir, records, samples)
    report = write_report(run_dir, summary, records, samples)
    if args.json:
        print(json.dumps(summary.to_json_dict(), indent=2))
        return 0
    console = Console()
    from testbed.metrics.report import leftover_prefix

    print_summary_table(summary, console=console, prefix=leftover_prefix(run_dir))
    console.print(Text(f"wrote {run_dir / 'summary.json'} and {report}"))
    return 0


def _records(run_dir: Path) -> Sequence[RequestRecord]:
    """The run's records; from records.parquet alone (a long simulated run), read column by column
    (`RecordTable`), not as an object per request."""
    from testbed.metrics.run_files import RECORDS_FILE, records_file
    from testbed.metrics.summary import load_records

    p = records_file(run_dir)
    if p.name == RECORDS_FILE and p.is_file():
        from testbed.metrics.record_table import RecordTable

        return RecordTable(p)
    return load_records(run_dir)


def print_summary_table(
    summary: Summary,
    title: str | None = None,
    console: Console | None = None,
    prefix: str | None = None,
    validity: bool = True,
) -> None:
    """One run's summary as a terminal table (paper and wire units), plus its warnings (`prefix`:
    the run's name for `testbed down`, named in a cut-short run's; `validity` False leaves out the
    INVALID line, for a caller that says it around the table)."""
    from testbed.metrics.report import run_label, summary_rows

    run = summary.run
    console = console or Console()
    head = title or run_label(summary)
    table = Table(
        title=Text(
            f"{head}: {run.scenario}, speedup {run.speedup:g}, "
            f"byte_scale {run.byte_scale:g}, shaping {run.shaping_method}"
            + (
                "\n(fallback shaping: no netem in this kernel; HTB limits the rate, a userspace delay line adds "
                "delay, jitter and loss)"
                if run.shaping_method == "fallback"
                else ""
            )
        )
    )
    table.add_column("Metric", no_wrap=True)
    table.add_column("Paper", justify="right")
    # A simulated run has no wire: it runs in paper time and bytes, so a second column would repeat the first.
    wire = run.shaping_method != "sim"
    if wire:
        table.add_column("Wire", justify="right")
    for row in summary_rows(summary):
        table.add_row(*(Text(c) for c in (row if wire else row[:2])))
    console.print(table)
    if validity and not summary.valid and summary.validity is not None:
        console.print(Text("INVALID RUN: " + "; ".join(summary.validity.reasons), style="bold red"))
    if run.cut_short:
        from testbed.metrics.report import cut_short_note

        console.print(
            Text("warning: " + cut_short_note(summary, prefix).removeprefix("> **CUT SHORT:** "), style="yellow")
        )
    elif run.interrupted:
        console.print(Text("warning: the run was interrupted; figures cover what finished", style="yellow"))


def cmd_compare(args: argparse.Namespace) -> int:
    from testbed.metrics.report import comparison_rows, unique_labels, verdicts, write_comparison
    from testbed.metrics.summary import summarize
    from testbed.metrics.verdict import RunOutcome, closing_block, exit_code, invalid

    dirs: list[Path] = args.run_dirs
    summaries = [summarize(d) for d in dirs]
    written = write_comparison(dirs, args.out, summaries) if args.out is not None else None
    labels = unique_labels(summaries, dirs)
    lines = verdicts(summaries, labels)
    outcomes = [RunOutcome(lab, d, s) for lab, d, s in zip(labels, dirs, summaries)]
    if args.csv is not None:
        from testbed.metrics.summary_csv import write_summary_csv

        write_summary_csv(args.csv, outcomes)
    rc = exit_code(outcomes, args.accept_invalid)
    if args.json:
        runs = [
            {"label": lab, "run_dir": str(d), "valid": s.valid, "summary": s.to_json_dict()}
            for lab, d, s in zip(labels, dirs, summaries)
        ]
        print(json.dumps({"baseline": labels[0], "runs": runs, "verdicts": lines}, indent=2))
        return rc
    console = Console(highlight=False, soft_wrap=True)
    table = Table(title="Runs side by side (paper units)")
    table.add_column("Metric", no_wrap=True)
    for lab in labels:
        table.add_column(Text(lab), justify="right")
    for metric, cells in comparison_rows(summaries):
        table.add_row(Text(metric), *(Text(c) for c in cells))
    console.print(table)
    block = closing_block(outcomes, written, lines, args.accept_invalid)
    if args.csv is not None:
        block.insert(-1, f"csv: {args.csv}")
    for line in block[:-1]:
        console.print(Text(line))
    console.print(Text(block[-1], style="bold red" if invalid(outcomes) else "bold green"))
    return rc


def cmd_plot(args: argparse.Namespace) -> int:
    from testbed.metrics.report import write_plots

    for d in args.run_dirs:
        plots = write_plots(d)
        print(f"{d}: " + ", ".join(str(p) for _, p in plots))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from testbed.metrics.run_files import export_text

    for d in args.run_dirs:
        written = export_text(d)
        print(
            f"{d}: "
            + (", ".join(str(p) for p in written) if written else "records.csv and decisions.jsonl already there")
        )
    return 0
