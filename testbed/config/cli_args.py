"""Argument actions every subcommand shares, so that a flag means the same thing everywhere."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

from testbed.core.errors import UserError


class StoreOnce(argparse.Action):
    """A single-valued flag given twice is an error (exit 2), not the last one silently winning:
    `replay --scenario a --scenario b` used to run only b."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        seen = f"_{self.dest}_given"
        if getattr(namespace, seen, False):
            parser.error(f"{option_string or self.dest} given more than once (this command takes one)")
        setattr(namespace, seen, True)
        setattr(namespace, self.dest, values)


def check_out_dir(
    path: Path, flag: str = "--out", *, writes: Collection[str] = (), ours: Callable[[Path], bool] | None = None
) -> Path:
    """`path` as a directory a command may create and write into: not the filesystem root (a run
    would write and clear its artefacts there) and not an existing file. UserError otherwise.

    `writes`: the names the command writes there. An existing directory already holding any of
    them is refused, naming them, unless `ours(path)` says a previous output of the command is
    there (to be replaced): a folder of the user's own report.md or records.csv was overwritten
    silently. A new or empty directory, or one holding only other files, is fine."""
    if str(path) == "":
        raise UserError(f"{flag}: an empty path is not a directory")
    resolved = path.resolve()
    if resolved == Path(resolved.anchor):
        raise UserError(
            f"{flag} {str(path)!r}: the filesystem root is not an output directory; give a directory for it"
        )
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {str(path)!r}: an existing file, not a directory")
    if writes and path.is_dir():
        clash = [name for name in writes if os.path.lexists(path / name)]
        if clash and not (ours is not None and ours(path)):
            raise UserError(
                f"{flag} {str(path)!r} holds no previous run but has {', '.join(clash)}, which "
                "it would overwrite; give a new or empty directory, or move them"
            )
    return path


def out_dir(value: str) -> Path:
    """argparse `type` of an output directory flag (--out DIR): refused while parsing, before any
    work, with the CLI's one-line user error (argparse's own errors would not name the reason)."""
    path = check_out_dir(Path(value))
    probe_writable(path)
    return path


def probe_writable(path: Path, flag: str = "--out") -> None:
    """UserError unless a directory can be made where `path` is (or in it, when it exists): one
    is made and removed at once. Permissions alone cannot tell (root passes them; /proc, an
    immutable directory and a read-only mount refuse root too)."""
    import tempfile

    base = path
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        return  # a file on the way: the writer words that
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".testbed-probe-", dir=base))
    except OSError as e:
        raise UserError(f"{flag} {str(path)!r}: cannot write the output there: {e.strerror or e}") from None


def out_file(value: str) -> Path:
    """argparse `type` of the --out of a command that writes one file (a trace, a scenario):
    the one place --out is not a directory, so an existing directory is refused while parsing."""
    path = Path(value)
    if value == "":
        raise UserError("--out: an empty path is not a file")
    if path.is_dir():
        raise UserError(f"--out {value!r}: an existing directory; this command writes one file, give its path")
    return path


def add_overwrite(p: argparse.ArgumentParser, what: str = "its output directory") -> None:
    """`--overwrite`, one flag on every command that writes an output directory: without it, a
    directory holding a previous command's output (a finished or stopped run) is refused."""
    from testbed.config.run_lock import OVERWRITE_FLAG

    p.add_argument(
        OVERWRITE_FLAG,
        action="store_true",
        help=f"replace what a previous command left in {what} (refused without it); a directory "
        "a live command holds is refused regardless",
    )


@contextlib.contextmanager
def unwritable_out(path: Path, flag: str = "--out") -> Iterator[None]:
    """An OSError while making or writing output directory `path` as one UserError line: its
    parent may be /proc, read-only, immutable or full, which no check before writing can tell."""
    try:
        yield
    except OSError as e:
        where = f" ({e.filename})" if e.filename and Path(e.filename) != path else ""
        raise UserError(f"{flag} {str(path)!r}: cannot write the output there{where}: {e.strerror or e}") from None
