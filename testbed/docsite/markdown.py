"""Small Markdown builders for the generated pages."""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence


def escape_text(text: str) -> str:
    """`<`, `>` and `&` outside code spans as entities, so help texts like `runs/<time>` are
    not read as HTML."""
    parts = text.split("`")
    return "`".join(p if i % 2 else html.escape(p, quote=False) for i, p in enumerate(parts))


def escape_cell(text: str) -> str:
    """Text safe inside a table cell: one line, pipes escaped (unless they are already)."""
    one = " ".join(text.split())
    return escape_text(one if "\\|" in one else one.replace("|", "\\|"))


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(escape_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


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
