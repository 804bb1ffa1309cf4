"""The one Markdown table writer: its escaping rule and its alignment."""

from __future__ import annotations

import pytest

from testbed.docsite.markdown import table as docs_table
from testbed.metrics.markdown_table import escape_cell, md_table, table_lines

pytestmark = pytest.mark.pure


def test_cells_stay_one_cell_on_one_line() -> None:
    assert escape_cell("a | b") == "a \\| b"
    assert escape_cell("already \\| escaped") == "already \\| escaped"  # not doubled into \\\\|
    assert escape_cell("both \\| and |") == "both \\| and \\|"
    assert escape_cell("two\nlines") == "two lines"
    assert escape_cell("crlf  \r\n   and\rcr") == "crlf and cr"
    assert escape_cell("  keeps  inner  spaces ") == "  keeps  inner  spaces "


def test_table_lines_and_alignment() -> None:
    lines = table_lines(["name", "n", "share"], [["a|b", "1", "2%"], ["c", "10", "3%"]], ["", "right", "center"])
    assert lines == [
        "| name | n | share |",
        "|---|---:|:---:|",
        "| a\\|b | 1 | 2% |",
        "| c | 10 | 3% |",
    ]
    assert md_table(["x", "y"], [["1", ""]]) == "| x | y |\n|---|---|\n| 1 |  |"
    assert table_lines(["x", "y"], [], ["left"])[1] == "|:---|---|"
    with pytest.raises(ValueError, match="3 alignments for 2 columns"):
        table_lines(["x", "y"], [], ["", "", "right"])


def test_docs_tables_add_entities_and_single_spaces() -> None:
    out = docs_table(["flag", "help"], [["--out", "runs/<time>  or\n `a|b` | c"]])
    assert out.splitlines()[2] == "| --out | runs/&lt;time&gt; or `a\\|b` \\| c |"
