"""The backend capability matrix, read from the backend registry (`testbed.deploy.registry`),
and which backends each command offers, read from its `--backend` choices."""

from __future__ import annotations

import dataclasses

from testbed.deploy import registry
from testbed.docsite.cli_ref import Command, commands
from testbed.docsite.fielddoc import field_doc
from testbed.docsite.markdown import table


def capability_fields() -> list[tuple[str, str]]:
    """(capability, what it means) in declaration order."""
    return [(f.name, field_doc(registry.Capabilities, f.name)) for f in dataclasses.fields(registry.Capabilities)]


def matrix() -> str:
    caps = capability_fields()
    header = ("backend", "what it runs", *[f"`{c}`" for c, _ in caps])
    rows = []
    for e in registry.entries():
        rows.append((f"`{e.name}`", e.description, *["yes" if getattr(e.caps, c) else "-" for c, _ in caps]))
    legend = table(("capability", "meaning"), [(f"`{c}`", d) for c, d in caps])
    auto = registry.auto_help()
    return "\n".join(
        [
            table(header, rows),
            "",
            legend,
            "",
            f"`--backend auto` picks {auto.removeprefix('auto: ')}; without root that is the fallback, with a "
            "warning that says what is not emulated.",
        ]
    )


def offers(cmds: list[Command] | None = None) -> str:
    """Which backends each command's backend flags offer."""
    rows = []
    for c in cmds if cmds is not None else commands():
        for f in c.flags:
            if f.choices and any(n.endswith("backend") for n in f.names):
                rows.append(
                    (
                        f"`{c.name}`",
                        ", ".join(f"`{n}`" for n in f.names),
                        ", ".join(f"`{x}`" for x in f.choices),
                        f"`{f.default}`" if f.default else "",
                    )
                )
    return table(("command", "flag", "backends offered", "default"), rows)
