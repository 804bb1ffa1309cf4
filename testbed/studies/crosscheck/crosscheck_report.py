"""crosscheck.md, crosscheck.json and the terminal table of `testbed crosscheck`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from testbed.metrics.markdown_table import Align, table_lines
from testbed.studies.crosscheck import crosscheck_faults
from testbed.studies.crosscheck.crosscheck_table import Crosscheck

COLUMNS = ("metric", "model", "sim", "emulation", "sim vs emulation", "tolerance", "verdict")


def _cells(c: Crosscheck) -> list[list[str]]:
    return [
        [r.label, r.cells["model"], r.cells["sim"], r.cells["emulation"], r.cells["diff"], r.tolerance, r.verdict]
        for r in c.rows
    ]


def markdown(c: Crosscheck, level: int = 1) -> list[str]:
    h = "#" * level
    lines = [
        f"{h} Crosscheck of {c.scenario}: model, simulation, emulation",
        "",
        f"Simulation `{c.sim_dir}`; emulation "
        + (f"`{c.emulation_dir}`" if c.emulation_dir else "not run")
        + ". Paper units; the difference is the simulation's against the emulation's (relative, or in "
        "percentage points for the offload ratio). A metric without a tolerance is shown, not judged.",
        "",
    ]
    if c.model_note:
        lines += [c.model_note, ""]
    figures: list[Align] = ["right"] * (len(COLUMNS) - 2)  # the label and the verdict stay left
    lines += table_lines(COLUMNS, _cells(c), ["", *figures])
    explained = [r for r in c.rows if r.explanation]
    if explained or c.notes:
        lines += ["", f"{h}# Where simulation and emulation differ", ""]
        lines += [f"- {n}" for n in c.notes]
        lines += [f"- **{r.label}** ({r.cells['diff']}, {r.verdict}): {r.explanation}" for r in explained]
    lines += crosscheck_faults.markdown(c.faults, h)
    failed = c.failed_labels()
    if c.emulation_dir is None:
        lines += ["", "Verdict: none (no emulation to judge the simulation against)."]
    else:
        judged = sum(r.tolerance != "" for r in c.rows) + len(c.faults)
        lines += [
            "",
            f"Verdict: {len(failed)} of {judged} judged metrics outside tolerance"
            + (": " + ", ".join(failed) if failed else "")
            + ".",
        ]
    return lines


def write(checks: Sequence[Crosscheck], out: Path) -> Path:
    """One crosscheck: its table; several: each under a heading of one file."""
    out.mkdir(parents=True, exist_ok=True)
    if len(checks) == 1:
        lines = markdown(checks[0])
        data: object = checks[0].to_dict()
    else:
        lines = ["# Crosscheck: model, simulation, emulation", ""]
        for c in checks:
            lines += markdown(c, 2) + [""]
        data = [c.to_dict() for c in checks]
    path = out / "crosscheck.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    (out / "crosscheck.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def print_table(c: Crosscheck, console: Console | None = None) -> None:
    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=max(console.width, 120))  # a log or a pipe: room for every column
    table = Table(title=Text(f"{c.scenario}: model, simulation and emulation (paper units)"))
    for i, col in enumerate(COLUMNS):
        table.add_column(col, justify="left" if i == 0 or i == len(COLUMNS) - 1 else "right", no_wrap=i == 0)
    for cells in _cells(c):
        style = {"FAIL": "red", "n/a": "yellow", "ok": "green"}.get(cells[-1], "")
        table.add_row(*(Text(x) for x in cells[:-1]), Text(cells[-1], style=style))
    console.print(table)
    for n in c.notes:
        console.print(Text(f"note: {n}", style="yellow"))
    for r in c.rows:
        if r.explanation:
            console.print(Text(f"{r.label} ({r.cells['diff']}): {r.explanation}"))
    if c.faults:
        ft = Table(title=Text(f"{c.scenario}: faults, simulation against emulation (paper units)"))
        for i, col in enumerate(("fault", "metric", "sim", "emulation", "tolerance", "verdict")):
            ft.add_column(col, justify="right" if i in (2, 3) else "left")
        for fr in c.faults:
            cells = fr.cells()
            style = {"FAIL": "red", "n/a": "yellow", "ok": "green"}.get(cells[-1], "")
            ft.add_row(*(Text(x) for x in cells[:-1]), Text(cells[-1], style=style))
        console.print(ft)
        seen: set[str] = set()
        for fr in c.faults:
            if fr.explanation and fr.explanation not in seen:
                seen.add(fr.explanation)
                console.print(Text(f"fault #{fr.fault} {fr.kind}, failed and retried: {fr.explanation}"))
