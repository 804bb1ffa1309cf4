"""Argument actions every subcommand shares, so that a flag means the same thing everywhere."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Sequence

from testbed.core.errors import UserError


class StoreOnce(argparse.Action):
    """A single-valued flag given twice is an error (exit 2), not the last one silently winning:
    `replay --scenario a --scenario b` used to run only b."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        seen = f"_{self.dest}_given"
        if getattr(namespace, seen, False):
            parser.error(f"{option_string or self.dest} given more than once (this command takes one)")
        setattr(namespace, seen, True)
        setattr(namespace, self.dest, values)


def check_out_dir(path: Path, flag: str = "--out") -> Path:
    """`path` as a directory a command may create and write into: not the filesystem root (a run
    would write and clear its artefacts there) and not an existing file. UserError otherwise."""
    if str(path) == "":
        raise UserError(f"{flag}: an empty path is not a directory")
    resolved = path.resolve()
    if resolved == Path(resolved.anchor):
        raise UserError(f"{flag} {str(path)!r}: the filesystem root is not an output directory; give a directory for it")
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {str(path)!r}: an existing file, not a directory")
    return path


def out_dir(value: str) -> Path:
    """argparse `type` of an output directory flag (--out DIR): refused while parsing, before any
    work, with the CLI's one-line user error (argparse's own errors would not name the reason)."""
    return check_out_dir(Path(value))
