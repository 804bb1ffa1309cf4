"""A command's hold on its output directory: one live command per directory, and a finished
command's output is never replaced without `--overwrite`.

The hold is an `flock` on `.testbed.lock` inside the directory. The kernel drops it when the
holding process ends, however it ends (`kill -9` included), so a dead owner never blocks the
next command. The file records who took it (pid and the process's start time, host, command
line, when) so a refusal can name the live run; it stays after the command ends and then marks
the directory as a previous output. A directory with `run.json` but no lock file (written before
the lock existed) counts as one too.

Within one process the hold is re-entrant (a command takes its `--out`, the runner then takes
each run directory under it), and a directory written earlier by the same command invocation
(`begin_command`) is its own to rewrite: a study that repeats a run into the same directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import socket
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from testbed.core.errors import UserError

LOCK_NAME = ".testbed.lock"
OVERWRITE_FLAG = "--overwrite"


@dataclass(frozen=True)
class Holder:
    """Who took a directory's lock (or last took it)."""

    pid: int
    start: int | None  # the process's start time (/proc/PID/stat): a reused pid is not it
    host: str
    command: str
    started: str  # ISO time, UTC
    invocation: str  # one command invocation of that process

    def describe(self) -> str:
        return f"pid {self.pid} (`{self.command}`), started {self.started}"


class DirBusy(UserError):
    """Another live command holds the directory."""


class DirTaken(UserError):
    """The directory holds a previous command's output, and `--overwrite` was not given."""


@dataclass
class _Held:
    directory: Path
    fd: int
    overwrite: bool
    count: int
    created: bool  # the directory did not exist before: removed again if left empty


_held: dict[Path, _Held] = {}
_command = "testbed"


def _token() -> str:
    # `secrets.token_hex` itself (random bytes as hex), without importing secrets, hmac and
    # hashlib (OpenSSL's set-up) into every command.
    return os.urandom(8).hex()


_invocation = _token()


def begin_command(argv: Sequence[str]) -> None:
    """A new command invocation in this process (the CLI's `main`): what the lock records, and
    outputs of an earlier invocation count as previous ones."""
    global _command, _invocation
    _command = "testbed " + shlex.join(argv)
    _invocation = _token()


@contextlib.contextmanager
def command_scope(argv: Sequence[str]) -> Iterator[None]:
    """One command invocation (`begin_command`): every directory it took with `acquire` and did
    not release is released at its end, so a command takes its output directory in one line."""
    begin_command(argv)
    before = set(_held)
    try:
        yield
    finally:
        for key in [k for k in _held if k not in before]:
            h = _held[key]
            h.count = 1
            release(h.directory)


def current_command() -> str:
    return _command


def process_start(pid: int) -> int | None:
    """Start time of `pid` (clock ticks since boot, /proc/PID/stat field 22), None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def read_holder(directory: Path) -> Holder | None:
    """The lock file's record, or None when there is none (or it does not parse)."""
    try:
        raw = json.loads((directory / LOCK_NAME).read_text())
        return Holder(**{k: raw[k] for k in Holder.__dataclass_fields__})
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _legacy_run(directory: Path) -> str | None:
    """A run.json written before the lock existed: how it describes the run, else None."""
    try:
        meta = json.loads((directory / "run.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or "scenario" not in meta:
        return None
    return ", ".join(f"{k} {meta[k]}" for k in ("scenario", "backend", "state") if meta.get(k) is not None)


def _previous(directory: Path) -> str | None:
    """What a previous command left in `directory` (None: nothing, or this invocation's own)."""
    holder = read_holder(directory)
    if holder is not None:
        if holder.invocation == _invocation:
            return None
        run = _legacy_run(directory)
        return f"the output of `{holder.command}` (pid {holder.pid}, started {holder.started}" + (
            f"; {run})" if run else ")"
        )
    with contextlib.suppress(OSError):
        if (directory / LOCK_NAME).stat().st_size:  # empty: made just now, by this acquire
            return "the output of an earlier testbed command"
    run = _legacy_run(directory)
    return f"a previous run ({run})" if run else None


def replaceable(directory: Path) -> bool:
    """This process holds `directory` or a folder above it with `--overwrite`."""
    d = directory.resolve()
    return any(h.overwrite and (d == p or p in d.parents) for p, h in _held.items())


def acquire(directory: Path, overwrite: bool = False, flag: str = "--out") -> None:
    """Take `directory` (created if missing) for this process. DirBusy naming the live holder
    when another process has it; DirTaken when it holds a previous command's output and neither
    `overwrite` nor a hold above it with overwrite allows replacing it."""
    key = directory.resolve()
    if (h := _held.get(key)) is not None:
        h.count += 1
        return
    overwrite = overwrite or replaceable(key)
    created = not directory.exists()
    fd = _lock(directory, flag)
    try:
        prev = _previous(directory)
        if prev is not None and not overwrite:
            raise DirTaken(
                f"{flag} {str(directory)!r} holds {prev}; give {OVERWRITE_FLAG} to replace it, or another {flag}"
            )
        me = os.getpid()
        record = Holder(
            me,
            process_start(me),
            socket.gethostname(),
            _command,
            datetime.now(UTC).isoformat(timespec="seconds"),
            _invocation,
        )
        data = (json.dumps(asdict(record)) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except BaseException:
        os.close(fd)  # closing drops the lock
        raise
    _held[key] = _Held(directory, fd, overwrite, 1, created)


def _lock(directory: Path, flag: str) -> int:
    """An open descriptor of the directory's lock file, locked; DirBusy when another process
    holds it. A lock file removed meanwhile (its holder wrote nothing else) is taken afresh."""
    path = directory / LOCK_NAME
    for _ in range(10):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise UserError(
                f"{flag} {str(directory)!r}: cannot take its lock file {LOCK_NAME} ({e.strerror or e})"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = read_holder(directory)
            who = holder.describe() if holder is not None else "another testbed command"
            raise DirBusy(
                f"{flag} {str(directory)!r} is in use by a live run: {who}; wait for it to end or give another {flag}"
            ) from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # locked a file its holder had just removed: take the new one
    raise DirBusy(f"{flag} {str(directory)!r}: its lock file keeps being replaced; another command is taking it")


def release(directory: Path) -> None:
    """Give back one hold on `directory`; the last one drops the lock. The lock file stays as
    the mark of this command's output, unless the command wrote nothing else there (it failed
    before its output began): then the directory is left as it was found."""
    key = directory.resolve()
    h = _held.get(key)
    if h is None:
        return
    h.count -= 1
    if h.count:
        return
    del _held[key]
    try:
        if [p.name for p in h.directory.iterdir()] == [LOCK_NAME]:
            (h.directory / LOCK_NAME).unlink()  # still locked: a newcomer sees it gone, retakes
            if h.created:
                h.directory.rmdir()
    except OSError:
        pass  # left as a mark: harmless
    finally:
        os.close(h.fd)


@contextlib.contextmanager
def holding(directory: Path, overwrite: bool = False, flag: str = "--out") -> Iterator[None]:
    """`acquire` for the block's duration."""
    acquire(directory, overwrite, flag)
    try:
        yield
    finally:
        release(directory)
