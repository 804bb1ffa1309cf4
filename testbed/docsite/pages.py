"""Every page and block the site build generates (`docs/gen_pages.py` hands them to MkDocs).

`generate()` returns whole pages by path under docs/. `BLOCKS` are generated pieces of
hand-written pages: a page writes `<!-- gen:NAME -->` on a line of its own (indented inside a list
item) and the build puts block NAME there; a name no block has fails the build.
"""

from __future__ import annotations

import json
import pkgutil
import re
from collections.abc import Callable

import testbed.core
from testbed.docsite import api_ref, backends_ref, cli_ref, extending_ref, rundir_ref, schema_ref
from testbed.docsite.markdown import table
from testbed.docsite.results import DATA, MEASUREMENTS, ROOT, Measurement

MARKER = re.compile(r"^([ \t]*)<!-- gen:([a-z0-9-]+) -->$", re.M)


def core_modules() -> list[str]:
    """Every module of core, its topic packages' included, dotted below `testbed.core` (`schema.scenario`)."""
    prefix = "testbed.core."
    return sorted(
        m.name.removeprefix(prefix)
        for m in pkgutil.walk_packages(testbed.core.__path__, prefix)
        if not m.ispkg and not any(part.startswith("_") for part in m.name.split("."))
    )


def api_pages() -> dict[str, str]:
    mods = core_modules()
    pages = {f"reference/api/{m.replace('.', '/')}.md": f"# testbed.core.{m}\n\n::: testbed.core.{m}\n" for m in mods}
    doc = (testbed.core.__doc__ or "").strip()
    index = [
        "# Core API",
        "",
        "`testbed.core` is the I/O-free heart of the testbed: the request lifecycle, service "
        "times, KV sizes, queues, caches, routing policies, the KV frame codec and the control loops' "
        "decisions. It takes `now` as an argument and returns decisions, events and bytes; the live services "
        "and the simulator drive the same code. One page per module, generated from the docstrings and "
        "signatures.",
        "",
    ]
    if doc:
        index += [doc, ""]
    index += [f"- [`testbed.core.{m}`]({m.replace('.', '/')}.md)" for m in mods]
    pages["reference/api/index.md"] = "\n".join(index) + "\n"
    return pages


def _stamp(m: Measurement) -> dict[str, object] | None:
    f = DATA / f"{m.name}.json"
    if not f.exists():
        return None
    loaded: dict[str, object] = json.loads(f.read_text())
    return loaded


def results_pages() -> dict[str, str]:
    pages: dict[str, str] = {}
    rows = []
    for m in MEASUREMENTS:
        st = _stamp(m)
        when = f"{st['date']}, `{st['commit']}`" if st else "not measured yet"
        rows.append((f"[{m.title}]({m.name}.md)", m.backend, "yes" if m.needs_root else "", when))
        body = [
            f"# {m.title}",
            "",
            m.what,
            "",
            f"Measured by {m.backend}{' (needs root)' if m.needs_root else ''}. Rerun with "
            f"`make docs-results ONLY={m.name}`, which runs:",
            "",
            "```sh",
            *m.commands(),
            "```",
            "",
        ]
        if m.reads:
            body += [
                "It reads the work directory of "
                + ", ".join(f"[{r}]({r}.md)" for r in m.reads)
                + ", so run that first.",
                "",
            ]
        if st is None:
            body += [
                '!!! note "Not measured yet"',
                "    No results file is committed for this measurement; the docs quote none of its figures.",
                "",
            ]
        else:
            body += [f'--8<-- "results/data/{m.name}.md"', ""]
            for _, fig in m.figures:
                body += [f"![{m.title}](data/{fig})", ""]
        pages[f"results/{m.name}.md"] = "\n".join(body)
    index = [
        "# Results",
        "",
        "Every figure the documentation quotes comes from one of these files. Each is written by one "
        "command, `make docs-results`, which reruns the measurements (by simulation where the figure is the "
        "simulator's, by emulation where it is the emulator's) and stamps each table with the date, the "
        "commit, the host and its cores, and the command. The files are committed "
        "(`docs/results/data/`): they are the record.",
        "",
        "```sh",
        "make docs-results                          # every measurement (emulated ones need root)",
        "make docs-results SKIP_EMULATION=1         # only the model and simulation ones (no root)",
        "make docs-results ONLY=replay,replay-sim   # a selection",
        "```",
        "",
        "Emulated measurements are timing-sensitive: run them on an otherwise idle machine. A measurement "
        "is one entry in `testbed/docsite/measurements.py` (name, commands, backend, how its table is read from "
        "what the commands wrote); see [Extending](../extending.md#a-measurement).",
        "",
        table(("measurement", "measured by", "root", "last measured"), rows),
        "",
    ]
    pages["results/index.md"] = "\n".join(index)
    return pages


def generate() -> dict[str, str]:
    pages = {
        "reference/cli.md": cli_ref.render(),
        "reference/scenario.md": schema_ref.scenario_page(),
        "reference/link-profile.md": schema_ref.link_profile_page(),
        "reference/run-directory.md": rundir_ref.page(),
        "reference/http-api.md": api_ref.page(),
    }
    pages.update(api_pages())
    pages.update(results_pages())
    return pages


def _kinds_table() -> str:
    return table(
        ("kind", "members now"), [(k, ", ".join(f"`{x}`" for x in v)) for k, v in extending_ref.members().items()]
    )


BLOCKS: dict[str, Callable[[], str]] = {
    "backend-matrix": backends_ref.matrix,
    "backend-offers": backends_ref.offers,
    "kinds": _kinds_table,
    "sites-policy": lambda: extending_ref.sites_list("policy"),
    "sites-fault-kind": lambda: extending_ref.sites_list("fault kind"),
    "sites-trace-format": lambda: extending_ref.sites_list("trace format"),
    "sites-prefill-model": lambda: extending_ref.sites_list("prefill model"),
    "commands": lambda: table(
        ("command", "what it does"),
        [
            (f"[`{c.name}`](../reference/cli.md#{c.anchor})", c.summary)
            for c in cli_ref.commands()[1:]
            if len(c.path) == 2
        ],
    ),
}


def fill(text: str, where: str = "<page>") -> str:
    """`text` with each `<!-- gen:NAME -->` line replaced by block NAME."""

    def sub(m: re.Match[str]) -> str:
        indent, name = m.group(1), m.group(2)
        if name not in BLOCKS:
            raise KeyError(f"{where}: no generated block {name!r} (known: {', '.join(BLOCKS)})")
        # A block inside a list item keeps the item's indentation.
        return "\n".join(indent + line if line else line for line in BLOCKS[name]().splitlines())

    return MARKER.sub(sub, text)


def pages_with_blocks() -> list[str]:
    """Hand-written pages (paths under docs/) that hold a block marker."""
    return sorted(
        str(p.relative_to(ROOT / "docs"))
        for p in (ROOT / "docs").rglob("*.md")
        if "results/data" not in str(p) and MARKER.search(p.read_text())
    )
