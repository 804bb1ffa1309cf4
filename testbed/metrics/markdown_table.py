"""The one Markdown table writer of the reports (run reports, studies, the docs site).

One escaping rule for every cell: a line break (and the spaces around it) becomes one space, so
the row stays one line, and a `|` not already escaped becomes `\\|`, so it does not end the cell.
Alignment is per column: "" (the default, `---`), "left" (`:---`), "right" (`---:`), "center"
(`:---:`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

Align = Literal["", "left", "right", "center"]
_RULE: dict[str, str] = {"": "---", "left": ":---", "right": "---:", "center": ":---:"}
_BREAK = re.compile(r"[ \t]*(?:\r\n|\r|\n)[ \t\r\n]*")
_PIPE = re.compile(r"(?<!\\)\|")


def escape_cell(text: str) -> str:
    """`text` safe inside a table cell (the rule above)."""
    return _PIPE.sub(r"\\|", _BREAK.sub(" ", text))


def table_lines(
    header: Sequence[str],
    rows: Iterable[Sequence[str]],
    align: Sequence[Align] = (),
    cell: Callable[[str], str] = escape_cell,
) -> list[str]:
    """The table's lines: header, rule, one line per row. `align` gives the first columns'
    alignment (the rest: default); `cell` escapes each cell (a caller adding its own escaping,
    e.g. HTML entities, passes a function that ends with `escape_cell`)."""
    if len(align) > len(header):
        raise ValueError(f"{len(align)} alignments for {len(header)} columns")
    rule = [_RULE[a] for a in align] + ["---"] * (len(header) - len(align))

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell(c) for c in cells) + " |"

    return [line(header), "|" + "|".join(rule) + "|", *(line(r) for r in rows)]


def md_table(
    header: Sequence[str],
    rows: Iterable[Sequence[str]],
    align: Sequence[Align] = (),
    cell: Callable[[str], str] = escape_cell,
) -> str:
    """`table_lines` joined into one string (no trailing newline)."""
    return "\n".join(table_lines(header, rows, align, cell))
