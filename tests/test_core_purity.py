"""core/ is I/O-free: nothing in it may import asyncio, socket, time or aiohttp."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure
FORBIDDEN = {"asyncio", "socket", "time", "aiohttp", "select", "selectors", "subprocess", "threading"}
CORE = Path(__file__).resolve().parent.parent / "testbed" / "core"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_core_has_modules() -> None:
    assert len(list(CORE.rglob("*.py"))) >= 8


@pytest.mark.parametrize("path", sorted(CORE.rglob("*.py")), ids=lambda p: str(p.relative_to(CORE)))
def test_core_module_is_io_free(path: Path) -> None:
    bad = _imports(path) & FORBIDDEN
    assert not bad, f"{path.name} imports {sorted(bad)}"


def test_checker_catches_a_forbidden_import(tmp_path: Path) -> None:
    f = tmp_path / "x.py"
    f.write_text("import os\nfrom asyncio import sleep\n")
    assert _imports(f) & FORBIDDEN == {"asyncio"}
