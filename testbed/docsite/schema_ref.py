"""The scenario and link-profile references, read from their pydantic models (fields, types,
defaults, constraints and the code's words on each), and the shipped files of each kind."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import yaml
from pydantic import BaseModel

from testbed.config.profiles import load_profile
from testbed.config.scenarios import load_scenario
from testbed.core.schema.linkprofile import LinkProfile
from testbed.core.schema.scenario import Scenario
from testbed.docsite.fielddoc import FieldRow, class_doc, model_rows
from testbed.docsite.markdown import escape_text, table

ROOT = Path(__file__).resolve().parents[2]
HEADER = ("field", "type", "default", "constraints", "what it is")


def _row(r: FieldRow) -> tuple[str, str, str, str, str]:
    return (
        f"`{r.path}`",
        r.typename,
        f"`{r.default}`" if r.default not in ("required", "(its fields' defaults)") else r.default,
        r.constraints,
        r.doc,
    )


def _tables(rows: Sequence[FieldRow], level: int) -> list[str]:
    """One table of the plain rows, then one per union member (its discriminator in the heading)."""
    plain = [r for r in rows if not r.variant]
    out = [table(HEADER, [_row(r) for r in plain]), ""] if plain else []
    variants: dict[str, list[FieldRow]] = {}
    for r in rows:
        if r.variant:
            variants.setdefault(r.variant, []).append(r)
    for name, vrows in variants.items():
        kind = next((r for r in vrows if r.path.endswith(".kind")), None)
        out += [f"{'#' * level} `kind: {name}`", ""]
        if kind is not None and kind.doc:
            out += [escape_text(kind.doc), ""]
        out += [table(HEADER, [_row(r) for r in vrows]), ""]
    return out


def model_page(model: type[BaseModel], title: str, intro: str) -> str:
    rows = list(model_rows(model))
    out = [f"# {title}", "", intro, ""]
    top = [r for r in rows if "." not in r.path.replace("[]", "") and not r.variant]
    simple = [
        r
        for r in top
        if r.model is None
        and not any(x.path.startswith(r.path + ".") or x.path.startswith(r.path + "[]") for x in rows)
    ]
    if simple:
        out += [table(HEADER, [_row(r) for r in simple]), ""]
    for t in top:
        if t in simple:
            continue
        sub = [r for r in rows if r.path.startswith(t.path + ".") or r.path.startswith(t.path + "[]")]
        out += [f"## `{t.path}`", "", escape_text(t.doc), ""]
        out += _tables([t, *sub], 3)
    return "\n".join(out) + "\n"


def file_description(path: Path) -> str:
    """A shipped file's own words: its `description`, else the comment block it starts with (a
    file that `extends` another inherits the other's description, which says nothing of it)."""
    text = path.read_text()
    raw = yaml.safe_load(text)
    if isinstance(raw, dict) and isinstance(raw.get("description"), str):
        return str(raw["description"])
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def _shipped(pattern: str, check: Callable[[Path], object]) -> list[tuple[str, str]]:
    out = []
    for p in sorted(ROOT.glob(pattern)):
        check(p)  # every shipped file loads: a broken one fails the docs build
        out.append((f"`{p.relative_to(ROOT)}`", file_description(p)))
    return out


def scenario_page() -> str:
    intro = (
        "A scenario file (`scenarios/*.yaml`) describes a deployment: the model, hardware, clusters, links, "
        "policy, scale, SLOs, workload, transfer and serving settings and any faults. This page is generated "
        "from the pydantic models in `testbed/core/schema/scenario.py`: every field with its type, default and "
        "constraints. A file may `extends:` another file, or a list of files merged left to right, and "
        "override parts of it; a mapping of another `kind` replaces the one it overrides. `--set FIELD=VALUE` "
        "overrides any field from the command line (list items by index: `--set clusters.0.prefill=2`). "
        "An invalid file is refused with one line naming the file and the field. Sizes such as `4TiB` are "
        "accepted where a field counts bytes of cache. Paths: `[]` is an item of a list, `<name>` a key of "
        "a map."
    )
    page = model_page(Scenario, "Scenario schema", intro)
    shipped = _shipped("scenarios/*.yaml", load_scenario) + _shipped("scenarios/faults/*.yaml", load_scenario)
    page += "\n## Shipped scenarios\n\n" + table(("file", "what it is"), shipped) + "\n"
    return page


def link_profile_page() -> str:
    intro = (
        "A link profile (`netem_profiles/*.yaml`, paper units) sets a link's rate, delay, jitter, loss, "
        "queue and TCP settings, and an optional schedule of changes over time. Generated from "
        "`testbed/core/schema/linkprofile.py`. " + escape_text(class_doc(LinkProfile))
    )
    page = model_page(LinkProfile, "Link profile schema", intro)
    shipped = _shipped("netem_profiles/*.yaml", load_profile)
    page += "\n## Shipped profiles\n\n" + table(("file", "what it is"), shipped) + "\n"
    return page
