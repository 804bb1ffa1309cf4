"""The CLI reference, read from the argparse parsers `testbed.cli.build_parser` assembles: every
subcommand (nested ones too), its usage, description and every flag with its help, default and
choices. Flags hidden with `argparse.SUPPRESS` stay hidden."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass

from testbed.cli import build_parser
from testbed.docsite.markdown import code, escape_text, table


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # option strings, or the positional's name
    metavar: str
    help: str
    default: str
    choices: tuple[str, ...]
    required: bool
    positional: bool


@dataclass(frozen=True)
class Command:
    path: tuple[str, ...]  # ("testbed", "trace", "synth")
    summary: str  # the help its parent lists it with
    description: str
    usage: str
    flags: tuple[Flag, ...]
    subcommands: tuple[str, ...]

    @property
    def name(self) -> str:
        return " ".join(self.path)

    @property
    def anchor(self) -> str:
        return "-".join(self.path)


def _subparsers(p: argparse.ArgumentParser) -> argparse._SubParsersAction[argparse.ArgumentParser] | None:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return a
    return None


def _help(p: argparse.ArgumentParser, a: argparse.Action) -> str:
    if a.help is None or a.help == argparse.SUPPRESS:
        return ""
    text: str = p._get_formatter()._expand_help(a)
    return " ".join(text.split())


def _default(a: argparse.Action) -> str:
    d = a.default
    if (
        d is None
        or d is argparse.SUPPRESS
        or isinstance(
            a, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction, argparse._CountAction)
        )
    ):
        return ""
    if isinstance(d, (list, tuple)):
        return " ".join(str(x) for x in d) if d else ""
    return str(d)


def _metavar(a: argparse.Action) -> str:
    if a.nargs == 0:
        return ""
    if a.metavar is not None:
        return a.metavar if isinstance(a.metavar, str) else " ".join(a.metavar)
    if a.choices is not None and not a.option_strings:
        return a.dest
    return a.dest.upper() if a.option_strings else a.dest


def _flags(p: argparse.ArgumentParser) -> tuple[Flag, ...]:
    out = []
    for a in p._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) or a.help == argparse.SUPPRESS:
            continue
        choices = tuple(str(c) for c in a.choices) if a.choices is not None else ()
        out.append(
            Flag(
                tuple(a.option_strings) or (a.dest,),
                _metavar(a),
                _help(p, a),
                _default(a),
                choices,
                bool(a.required),
                not a.option_strings,
            )
        )
    return tuple(out)


def commands(parser: argparse.ArgumentParser | None = None) -> list[Command]:
    """Every command the `testbed` parser knows, depth first in registration order."""
    root = parser if parser is not None else build_parser()
    return list(_walk(root, ("testbed",), ""))


def _walk(p: argparse.ArgumentParser, path: tuple[str, ...], summary: str) -> Iterator[Command]:
    sub = _subparsers(p)
    names: list[tuple[str, argparse.ArgumentParser, str]] = []
    if sub is not None:
        helps = {c.dest: (c.help or "") for c in sub._choices_actions}
        seen: set[int] = set()
        for name, child in sub.choices.items():
            if id(child) in seen:  # an alias
                continue
            seen.add(id(child))
            names.append((name, child, helps.get(name, "")))
    usage = " ".join(p.format_usage().removeprefix("usage: ").split())
    yield Command(
        path,
        " ".join(summary.split()),
        " ".join((p.description or "").split()),
        usage,
        _flags(p),
        tuple(n for n, _, _ in names),
    )
    for name, child, text in names:
        yield from _walk(child, (*path, name), text)


def render(cmds: list[Command] | None = None) -> str:
    cmds = cmds if cmds is not None else commands()
    out = [
        "# Command line",
        "",
        "Generated from the argparse parsers of `testbed` (`testbed/cli.py` and the modules that register "
        "their subcommands), so it lists every subcommand and flag of this version. "
        "`testbed COMMAND --help` prints the same.",
        "",
    ]
    top = cmds[0]
    out += table(
        ["command", "what it does"], [[f"[`{c.name}`](#{c.anchor})", c.summary or c.description] for c in cmds[1:]]
    ).split("\n")
    out.append("")
    out += _section(top, level=2, title="testbed (global flags)")
    for c in cmds[1:]:
        out += _section(c, level=2 if len(c.path) == 2 else 3)
    return "\n".join(out) + "\n"


def _section(c: Command, level: int, title: str | None = None) -> list[str]:
    out = [f"{'#' * level} {title or c.name} {{#{c.anchor}}}", ""]
    if c.summary:
        out += [escape_text(c.summary), ""]
    if c.description and c.description != c.summary:
        out += [escape_text(c.description), ""]
    out += [code(c.usage, "text"), ""]
    if c.subcommands:
        out += ["Subcommands: " + ", ".join(f"[`{s}`](#{c.anchor}-{s})" for s in c.subcommands) + ".", ""]
    rows = []
    for f in c.flags:
        name = ", ".join(f"`{n}`" for n in f.names)
        arg = f"`{f.metavar}`" if f.metavar and not f.positional else ""
        extra = []
        if f.choices and not (f.metavar and "{" in f.metavar):
            extra.append("one of " + ", ".join(f"`{x}`" for x in f.choices))
        if f.required and not f.positional:
            extra.append("required")
        help_text = f.help + (f" ({'; '.join(extra)})" if extra else "")
        rows.append((name, arg, f"`{f.default}`" if f.default else "", help_text))
    if rows:
        out += [table(("flag", "argument", "default", "what it does"), rows), ""]
    return out
