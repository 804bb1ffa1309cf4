"""What the project cites as a source is in the repository: a file named in a docstring, a
comment, a scenario or a help text must exist, so that a reader can follow the reference."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parent.parent
# A cited document: anything under docs/, or a markdown file named in capitals (README.md,
# traces/FORMATS.md, the paper's notes), with the path it is cited by.
CITED = re.compile(r"(?<![\w./-])((?:docs/[\w./-]+\.md)|(?:[\w-]+/)*[A-Z][A-Z_]+\.md)\b")
SOURCES = ("testbed", "scenarios", "netem_profiles", "tests", "analysis", "Makefile", "README.md")


def _texts() -> list[Path]:
    out: list[Path] = []
    for name in SOURCES:
        p = ROOT / name
        if p.is_file():
            out.append(p)
        else:
            out.extend(f for f in p.rglob("*") if f.suffix in (".py", ".yaml", ".md", ".ipynb") and f.is_file())
    return out


def test_every_cited_document_exists() -> None:
    missing = []
    for f in _texts():
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for m in CITED.finditer(line):
                if not (ROOT / m.group(1)).exists():
                    missing.append(f"{f.relative_to(ROOT)}:{n}: {m.group(1)}")
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)


def test_the_paper_is_cited_by_its_public_reference() -> None:
    text = (ROOT / "docs" / "paper.md").read_text()
    assert "arXiv" in text and "2604.15039" in text
