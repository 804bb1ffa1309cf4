"""Small Markdown builders for the generated pages."""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence

from testbed.metrics.markdown_table import escape_cell as table_cell
from testbed.metrics.markdown_table import md_table


def escape_text(text: str) -> str:
    """`<`, `>` and `&` outside code spans as entities, so help texts like `runs/<time>` are
    not read as HTML."""
    parts = text.split("`")
    return "`".join(p if i % 2 else html.escape(p, quote=False) for i, p in enumerate(parts))


def escape_cell(text: str) -> str:
    """Text safe inside a table cell of a page: one line with single spaces, HTML-like text as
    entities, then the reports' cell rule (`testbed.metrics.markdown_table`)."""
    return table_cell(escape_text(" ".join(text.split())))


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    return md_table(header, rows, cell=escape_cell)


def code(text: str, lang: str = "") -> str:
    fence = "````" if "```" in text else "```"
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}"


def demote(markdown: str, levels: int = 1) -> str:
    """Every ATX heading `levels` deeper (outside code fences)."""
    out = []
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("#"):
            line = "#" * levels + line
        out.append(line)
    return "\n".join(out)
