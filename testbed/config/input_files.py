"""Opening the files a user names (scenarios, link profiles, traces, measurements).

Only regular files: opening a FIFO blocks until something writes to it (the command hung
silently), and a device such as /dev/zero never ends (read whole, it ate memory until
MemoryError). A file read whole is also capped in size; one that is streamed (traces, GBs) is not.
"""

from __future__ import annotations

import io
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path

from testbed.core.errors import UserError

MIB = 1 << 20
# Scenario and link-profile YAML: the shipped ones are a few KiB, and a measured prefill table of
# thousands of rows stays under 1 MiB. PyYAML's pure-Python loader builds objects at a few MB/s
# and tens of bytes each per byte of input, so 16 MiB keeps a mistaken file (a trace or a log
# passed as --scenario) to seconds and a few hundred MB, while leaving 16x room over any table.
MAX_CONFIG_BYTES = 16 * MIB

_KINDS = (
    (stat.S_ISDIR, "directory"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISSOCK, "socket"),
)


class InputFileError(UserError, ValueError):
    """A named file that cannot be used as input; `reason` says why without the path."""

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


def _kind(mode: int) -> str | None:
    """What a non-regular file is, or None for a regular one."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "special file")


def refuse_special(path: str | Path) -> None:
    """InputFileError if `path` exists and is no regular file (a device, a FIFO, a directory):
    for checks that look at a name before reading, so they do not judge a device by its name."""
    try:
        kind = _kind(os.stat(path).st_mode)
    except OSError:
        return  # missing or unreadable: the reader words that
    if kind is not None:
        raise InputFileError(Path(path), f"not a regular file ({kind})")


def open_regular(path: str | Path) -> io.BufferedReader:
    """`path` opened for reading in binary, refused unless it is a regular file.

    Checked before opening (opening a FIFO would block, a device's open may act) and again on
    the open file, so a path swapped in between cannot slip through; O_NONBLOCK keeps that open
    from blocking on a FIFO and means nothing for a regular file. OSError (no such file, no
    permission) is left to the caller, which words it as before."""
    p = Path(path)
    kind = _kind(os.stat(p).st_mode)
    if kind is not None:
        raise InputFileError(p, f"not a regular file ({kind})")
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        kind = _kind(os.fstat(fd).st_mode)
        if kind is not None:
            raise InputFileError(p, f"not a regular file ({kind})")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_capped(path: str | Path, max_bytes: int) -> bytes:
    """A regular file's bytes, refused when larger than `max_bytes` (at most that many plus one
    are read, so a file that grows while read cannot pass either)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(max_bytes + 1) if size <= max_bytes else b""
        if size > max_bytes or len(data) > max_bytes:
            raise InputFileError(path, f"larger than {_size(max_bytes)} (it has {_size(max(size, len(data)))})")
    return data


def decode_utf8(data: bytes, path: str | Path) -> str:
    """`data` as UTF-8 text (a leading BOM dropped); refused naming the first bad byte."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InputFileError(path, f"not UTF-8 at byte {e.start} ({e.reason})") from None


def read_text_capped(path: str | Path, max_bytes: int) -> str:
    """A regular UTF-8 text file of at most `max_bytes` bytes."""
    return decode_utf8(read_capped(path, max_bytes), path)


def _size(n: int) -> str:
    return f"{n / MIB:.4g} MiB" if n >= MIB else f"{n:,} bytes"


# What an error may quote of a file that is not recognisably the kind expected: nothing. Any
# readable file can be named as input (`--trace /etc/shadow` under sudo), and its lines are not
# ours to print. These say what it is instead.
_COLUMN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_ ()./-]{0,39}")


def quotable_header(columns: Sequence[str], expected: Sequence[str]) -> str:
    """A CSV header for an error message, quoted only where it is recognisably one of ours: at
    least one expected column (case and repeated spaces aside), and every column a short name.
    Otherwise its number of fields."""
    if not columns or list(columns) == [""]:
        return "empty"
    norm = {" ".join(c.split()).casefold() for c in columns}
    if any(" ".join(n.split()).casefold() in norm for n in expected) and all(
        _COLUMN_NAME.fullmatch(c) for c in columns
    ):
        return ", ".join(columns)
    return f"{len(columns)} field{'s' if len(columns) != 1 else ''}, none of them a column it names"


def json_kind(value: object) -> str:
    """What a JSON value is ("a string"), for an error that must not quote it."""
    kinds = (
        (bool, "a boolean"),
        (int, "a number"),
        (float, "a number"),
        (str, "a string"),
        (list, "an array"),
        (dict, "an object"),
    )
    return next((name for t, name in kinds if isinstance(value, t)), "null")
