"""A run's verdict as its exit status and its closing block.

Exit codes of `testbed replay` and `testbed up` (docs/guides/reading-a-run.md):
- 0: every run kept the scenario's time (or `--accept-invalid` was given);
- 1: a run failed (an error, a service that died);
- 2: usage or input error (a flag, a scenario, a trace: the message names it);
- 3: a run finished but the testbed marked it invalid (`validity.valid: false` in its summary.json):
  its figures are not measurements of the scenario;
- 130 / 143: stopped by Ctrl-C / SIGTERM (records kept).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from testbed.metrics.artefacts import Summary

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INVALID = 3

FIX = (
    "rerun at a lower speedup (--speedup auto finds the highest this host keeps), with fewer instances, "
    "on a quieter host, or simulate it (--backend sim)"
)
PLOTS = ("ttft_cdf.png", "queues.png", "links.png", "wan.png", "control.png", "roles.png")


@dataclass(frozen=True)
class RunOutcome:
    label: str
    run_dir: Path
    summary: Summary

    @property
    def reasons(self) -> list[str]:
        return [] if self.summary.validity is None else list(self.summary.validity.reasons)


def invalid(runs: Sequence[RunOutcome]) -> list[RunOutcome]:
    return [r for r in runs if not r.summary.valid]


def exit_code(runs: Sequence[RunOutcome], accept_invalid: bool = False) -> int:
    return EXIT_INVALID if invalid(runs) and not accept_invalid else EXIT_OK


def invalid_headline(runs: Sequence[RunOutcome]) -> list[str]:
    """What an invalid run prints before its figures: one line per invalid run."""
    return [
        f"INVALID RUN {r.label}: the testbed could not keep the scenario's time, its figures are not "
        f"measurements: {'; '.join(r.reasons) or 'no reason recorded'}"
        for r in invalid(runs)
    ]


def verdict_line(runs: Sequence[RunOutcome], accept_invalid: bool = False) -> str:
    """The last line of a run's output: the verdict, and for an invalid run the reason, the fix
    and the exit code."""
    bad = invalid(runs)
    n = len(runs)
    if not bad:
        what = "the run" if n == 1 else f"all {n} runs"
        return f"verdict: VALID: {what} kept the scenario's time (exit {EXIT_OK})"
    who = "the run" if n == 1 else f"{len(bad)} of {n} runs"
    why = "; ".join(f"{r.label}: {'; '.join(r.reasons) or 'no reason recorded'}" for r in bad)
    code = (
        f"exit {EXIT_OK} (--accept-invalid)"
        if accept_invalid
        else f"exit {EXIT_INVALID}; --accept-invalid exits {EXIT_OK} for exploration"
    )
    return f"verdict: INVALID: {who} could not keep the scenario's time ({why}). Fix: {FIX}. {code}"


def _files(d: Path, names: Sequence[str]) -> list[str]:
    return [n for n in names if (d / n).exists()]


def closing_block(
    runs: Sequence[RunOutcome],
    comparison: Path | None,
    comparison_lines: Sequence[str] = (),
    accept_invalid: bool = False,
) -> list[str]:
    """After every run and comparison: each run's validity and where its files are, the
    comparison's verdict, and last the verdict line."""
    out = ["", "── summary " + "─" * 60]
    width = max(len(r.label) for r in runs) if runs else 0
    for r in runs:
        state = "valid" if r.summary.valid else "INVALID"
        out.append(f"{r.label:<{width}}  {state:<7}  {r.run_dir}")
        d = r.run_dir
        # A long simulated run keeps records.parquet alone (`testbed export` writes the CSV).
        recs = (
            d / "records.csv"
            if (d / "records.csv").exists() or not (d / "records.parquet").exists()
            else d / "records.parquet"
        )
        out.append(f"{'':<{width}}  records {recs}, summary {d / 'summary.json'}")
        report = d / "report.md"
        plots = _files(d, PLOTS)
        if report.exists():
            out.append(f"{'':<{width}}  report {report}" + (f", plots {', '.join(plots)}" if plots else ""))
        elif plots:
            out.append(f"{'':<{width}}  plots {', '.join(plots)}; no report.md: `testbed report {d}` writes it")
        else:
            out.append(
                f"{'':<{width}}  no report: `testbed report {d}` writes report.md and its plots, "
                f"`testbed plot {d}` the plots alone"
            )
    if comparison is not None:
        out.append(
            f"comparison: {comparison}"
            + (" (ttft_cdf.png beside it)" if (comparison.parent / "ttft_cdf.png").exists() else "")
        )
    elif len(runs) > 1:
        out.append(f"comparison: testbed compare {' '.join(str(r.run_dir) for r in runs)} --out DIR")
    out += [f"  {line}" for line in comparison_lines]
    out.append(verdict_line(runs, accept_invalid))
    return out
