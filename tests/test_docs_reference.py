"""The documentation's generated reference covers the code, and its figures trace to results files.

Each check walks the code on its own (the argparse parsers, the pydantic models, the records'
columns) and looks for an entry in the page the site generates, so a subcommand, a flag, a
scenario field or a `summary.json` key that the generator missed, or that has no words, fails
here; `make docs` then builds the pages strictly."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import pytest
from pydantic import BaseModel

from testbed.cli import build_parser
from testbed.core.schema.linkprofile import LinkProfile
from testbed.core.schema.scenario import Scenario
from testbed.docsite import cli_ref, pages, rundir_ref, schema_ref
from testbed.docsite.notes import NOTES
from testbed.docsite.results import DATA, MEASUREMENTS, readme_block
from testbed.metrics.artefacts import RunInfo, Summary
from testbed.metrics.records import COLUMNS

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


# -- the CLI --------------------------------------------------------------------------------


def _commands(
    p: argparse.ArgumentParser, path: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            seen: set[int] = set()
            for name, child in a.choices.items():
                if id(child) not in seen:
                    seen.add(id(child))
                    yield from _commands(child, (*path, name))


def _section(text: str, anchor: str) -> str:
    m = re.search(r"^#+ .*\{#" + re.escape(anchor) + r"\}$", text, re.M)
    assert m, f"no section for {anchor!r} in the CLI reference"
    nxt = re.search(r"^#+ ", text[m.end() :], re.M)
    return text[m.end() : m.end() + nxt.start() if nxt else len(text)]


def test_every_subcommand_and_flag_has_an_entry_in_the_cli_reference() -> None:
    text = cli_ref.render()
    missing = []
    cmds = list(_commands(build_parser(), ("testbed",)))
    assert len(cmds) > 15
    for path, parser in cmds:
        section = _section(text, "-".join(path))
        for a in parser._actions:
            if a.help == argparse.SUPPRESS or isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            for opt in a.option_strings or [a.dest]:
                if f"`{opt}`" not in section:
                    missing.append(f"{' '.join(path)} {opt}")
    assert not missing, "not in the CLI reference: " + ", ".join(missing)


def test_a_command_the_generator_does_not_know_shows_up() -> None:
    # The reference is read from the parser itself: a subcommand registered later is listed.
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    extra = sub.add_parser("zz-new", help="a command added after the docs were written")
    extra.add_argument("--zz-flag", help="its flag")
    text = cli_ref.render(cli_ref.commands(p))
    assert "`testbed zz-new`" in text and "`--zz-flag`" in _section(text, "testbed-zz-new")


# -- models ---------------------------------------------------------------------------------


def _nested(tp: Any) -> list[tuple[str, type[BaseModel]]]:
    origin, args = get_origin(tp), get_args(tp)
    if origin is typing.Annotated:
        return _nested(args[0])
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [("", tp)]
    if origin in (Union, types.UnionType):
        return [x for a in args for x in _nested(a)]
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        return [("[]" + s, m) for s, m in _nested(args[0])]
    if origin is dict:
        return [(".<name>" + s, m) for s, m in _nested(args[1])]
    return []


def _paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for name, info in model.model_fields.items():
        path = prefix + (info.alias or name)
        out.add(path)
        for suffix, sub in _nested(info.annotation):
            out |= _paths(sub, f"{path}{suffix}.")
    return out


def _described(text: str, path: str) -> list[str]:
    """The description cell of every table row for `path` (first cell `` `path` ``)."""
    rows = [line for line in text.splitlines() if line.startswith(f"| `{path}` |")]
    return [r.rstrip().rstrip("|").rsplit("|", 1)[-1].strip() for r in rows]


@pytest.mark.parametrize(
    "model,render", [(Scenario, schema_ref.scenario_page), (LinkProfile, schema_ref.link_profile_page)]
)
def test_every_scenario_and_link_profile_field_has_a_described_entry(model: type[BaseModel], render: Any) -> None:
    text = render()
    paths = _paths(model)
    assert len(paths) > (100 if model is Scenario else 10)
    absent = [p for p in sorted(paths) if not _described(text, p)]
    undescribed = [p for p in sorted(paths) if any(not d for d in _described(text, p))]
    assert not absent, f"no entry in the {model.__name__} reference: {absent}"
    assert not undescribed, (
        f"{model.__name__} fields without words (add a comment on the field's line in the "
        f"model, or a note in testbed/docsite/notes.py): {undescribed}"
    )


def test_every_summary_run_and_records_key_has_a_described_entry() -> None:
    text = rundir_ref.page()
    summary = text[text.index("## `summary.json`") : text.index("## `run.json`")]
    run = text[text.index("## `run.json`") : text.index("## Schema versions")]
    records = text[text.index("## `records.csv`") : text.index("## `summary.json`")]
    for section, paths in ((summary, _paths(Summary)), (run, _paths(RunInfo)), (records, set(COLUMNS))):
        absent = [p for p in sorted(paths) if not _described(section, p)]
        undescribed = [p for p in sorted(paths) if any(not d for d in _described(section, p))]
        assert not absent, f"no entry in the run-directory reference: {absent}"
        assert not undescribed, f"keys without words (document the field where it is typed): {undescribed}"
    assert "`ttft_breakdown_s.transfer_tail`" in summary and "`schema`" in summary  # the alias, as written


def test_no_note_outlives_its_field() -> None:
    stale = []
    for key in NOTES:
        module, cls_name, field = key.rsplit(".", 2)
        cls = getattr(importlib.import_module(module), cls_name, None)
        if cls is None or field not in getattr(cls, "__annotations__", {}):
            stale.append(key)
    assert not stale, f"notes whose field is gone (remove them): {stale}"


def test_generated_pages_and_blocks_build() -> None:
    generated = pages.generate()
    for name in (
        "reference/cli.md",
        "reference/scenario.md",
        "reference/run-directory.md",
        "reference/http-api.md",
        "reference/api/index.md",
        "results/index.md",
    ):
        assert generated[name].startswith("# "), name
    for rel in pages.pages_with_blocks():
        filled = pages.fill((DOCS / rel).read_text(), rel)
        assert "<!-- gen:" not in filled, rel
    with pytest.raises(KeyError, match="no generated block 'nope'"):
        pages.fill("<!-- gen:nope -->\n")


# -- results --------------------------------------------------------------------------------

SNIPPET = re.compile(r'--8<-- "results/data/([\w.-]+)\.md"')
FIGURE = re.compile(r"results/data/([\w.-]+\.png)")


def _doc_texts() -> dict[str, str]:
    out = {str(p.relative_to(ROOT)): p.read_text() for p in DOCS.rglob("*.md") if "results/data" not in str(p)}
    out["README.md"] = (ROOT / "README.md").read_text()
    return out


def test_every_included_results_file_was_written_by_the_results_command() -> None:
    names = {m.name for m in MEASUREMENTS}
    figures = {fig for m in MEASUREMENTS for _, fig in m.figures}
    problems = []
    for where, text in _doc_texts().items():
        for name in SNIPPET.findall(text):
            if name not in names:
                problems.append(f"{where}: {name}.md is no measurement of testbed/docsite/measurements.py")
            elif not (DATA / f"{name}.md").exists():
                problems.append(f"{where}: includes {name}.md, which `make docs-results ONLY={name}` has not written")
        for fig in FIGURE.findall(text):
            if fig not in figures or not (DATA / fig).exists():
                problems.append(f"{where}: figure {fig} is no results figure on disk")
    assert not problems, "\n".join(problems)


MEASURED_HEADING = re.compile(r"^(#+) Measured\b.*$", re.M)


def test_every_measured_section_quotes_a_results_file() -> None:
    """A section that reports measurements takes them from a results file, never typed in."""
    problems = []
    for where, text in _doc_texts().items():
        for m in MEASURED_HEADING.finditer(text):
            level = len(m.group(1))
            rest = text[m.end() :]
            nxt = re.search(rf"^#{{1,{level}}} ", rest, re.M)
            section = rest[: nxt.start()] if nxt else rest
            if not SNIPPET.search(section):
                problems.append(f"{where}: '{m.group(0).strip()}' quotes no results file")
    assert not problems, "\n".join(problems)


def test_every_results_file_is_stamped() -> None:
    names = {m.name for m in MEASUREMENTS}
    files = sorted(DATA.glob("*.md"))
    assert files, "no results files"
    for f in files:
        assert f.stem in names, f"{f.name}: no measurement writes it"
        stamp = json.loads(f.with_suffix(".json").read_text())
        assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC$", stamp["date"]) and stamp["commit"] and stamp["commands"]
        first = f.read_text().split("\n\n")[1]
        assert stamp["date"] in first and stamp["commit"] in first, f"{f.name}: the stamp line is not its stamp"


def test_the_readme_is_a_landing_page_and_quotes_its_headline_from_a_results_file() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    m = re.search(r"<!-- results:([\w-]+) -->\n(.*?)\n<!-- /results -->", text, re.S)
    assert m, "README.md has no headline block taken from a results file"
    data = (DATA / f"{m.group(1)}.md").read_text()
    assert m.group(2).strip() == readme_block(data).strip(), (
        "README.md's headline table differs from its results file: run `make docs-results` (it rewrites it)"
    )
