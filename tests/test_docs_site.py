"""The documentation site opens from file:// as well as over HTTP: pages are `name.html` (a link
to `name/` shows a directory listing from disk), the search index is inlined for offline use, and
nothing the pages load comes from the network. The browser check itself (a sidebar link, search
for "mooncake") is `make docs-check` (tests/site_browser.py, headless Chromium)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parent.parent


def _config() -> dict[str, object]:
    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert isinstance(cfg, dict)
    return cfg


def test_pages_are_files_not_directories() -> None:
    assert _config().get("use_directory_urls") is False


def test_search_works_without_a_server() -> None:
    cfg = _config()
    plugins = [p if isinstance(p, str) else next(iter(p)) for p in cfg["plugins"]]  # type: ignore[attr-defined]
    assert "search" in plugins and "offline" in plugins
    polyfills = cfg["extra"]["polyfills"]  # type: ignore[index]
    # The offline plugin adds unpkg.com's shim unless one whose name says iframe-worker is listed.
    assert any("iframe-worker" in p for p in polyfills)
    for p in polyfills:
        assert not p.startswith(("http:", "https:")), f"{p}: fetched from the network"
        assert (ROOT / "docs" / p).is_file(), f"{p}: not in docs/"


def test_no_web_fonts() -> None:
    assert _config()["theme"]["font"] is False  # type: ignore[index]


def test_traces_guide_answers_format_names() -> None:
    text = (ROOT / "docs/guides/traces.md").read_text()
    front = yaml.safe_load(text.split("---")[1])
    assert front["search"]["boost"] > 1
    assert "## Formats: Mooncake, Azure, BurstGPT" in text
