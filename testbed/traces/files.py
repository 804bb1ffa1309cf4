"""The one place a trace file is opened, so every format refuses the same inputs and reads the
same compressed files.

A gzip or zstd trace (told by its magic bytes, whatever its name) is read as its decompressed
content: the published traces ship compressed. The CSV readers seek (a window's start found by
bisection, the header read apart from the rows), which a decompressing stream cannot do at any
speed, so the content is decompressed once per process into an unlinked temporary file, and
every open of the trace opens that file anew. Messages still name the trace the user gave.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, BinaryIO, cast

from testbed.config.input_files import InputFileError, open_regular
from testbed.traces.types import TraceError

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
COMPRESSED_SUFFIXES = (".gz", ".zst")

# (device, inode, size, mtime_ns) of a compressed trace -> the fd of its decompressed content.
_DECOMPRESSED: dict[tuple[int, int, int, int], int] = {}


def plain_name(path: str | Path) -> Path:
    """`path` without a compression suffix (`x.jsonl.gz` -> `x.jsonl`): what its format and
    request ids are named after."""
    p = Path(path)
    return p.with_suffix("") if p.suffix.lower() in COMPRESSED_SUFFIXES else p


def _zstd_reader(f: IO[bytes]) -> IO[bytes]:
    try:
        import zstandard
    except ImportError:
        raise TraceError(
            "zstd-compressed: reading it needs the 'zstandard' package (or decompress it first: zstd -d FILE)",
            path=getattr(f, "name", None),
        ) from None
    return zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)


def _decompressor(magic: bytes) -> tuple[str, Callable[[IO[bytes]], IO[bytes]]] | None:
    import gzip

    if magic.startswith(GZIP_MAGIC):
        return "gzip", lambda f: cast(BinaryIO, gzip.GzipFile(fileobj=f, mode="rb"))
    if magic.startswith(ZSTD_MAGIC):
        return "zstd", _zstd_reader
    return None


def _decompressed(path: str | Path, f: io.BufferedReader) -> io.BufferedReader:
    """`f` (a compressed trace, at offset 0) as its decompressed content, decompressed once."""
    st = os.fstat(f.fileno())
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    fd = _DECOMPRESSED.get(key)
    if fd is None:
        found = _decompressor(f.peek(4)[:4])
        assert found is not None
        kind, reader = found
        tmp = tempfile.TemporaryFile(prefix="testbed-trace-")
        try:
            with reader(f) as src:
                shutil.copyfileobj(src, tmp, 1 << 20)
            tmp.flush()
        except (OSError, EOFError) as e:
            tmp.close()
            raise TraceError(f"{kind}-compressed, and it does not decompress ({e})", path=path) from None
        except BaseException:
            tmp.close()
            raise
        fd = _DECOMPRESSED[key] = os.dup(tmp.fileno())
        tmp.close()
    f.close()
    # Through /proc, a new open file of its own: each reader keeps its own offset.
    return open(f"/proc/self/fd/{fd}", "rb")


def compression(path: str | Path) -> str | None:
    """ "gzip" or "zstd" when the file's first bytes say it is compressed, else None (also when it
    cannot be read: the reader words that)."""
    try:
        with open_regular(path) as f:
            found = _decompressor(f.peek(4)[:4])
    except (OSError, InputFileError):
        return None
    return None if found is None else found[0]


def open_trace(path: str | Path) -> io.BufferedReader:
    """The trace file opened in binary for streaming (no size cap: a trace may be GBs), its
    content decompressed when it is gzip or zstd. Only a regular file: a FIFO would block the
    open and a device never ends. TraceError otherwise."""
    try:
        f = open_regular(path)
    except InputFileError as e:
        raise TraceError(e.reason, path=path) from None
    except OSError as e:
        raise TraceError(f"cannot open: {e.strerror or e}", path=path) from None
    try:
        if _decompressor(f.peek(4)[:4]) is None:
            return f
        return _decompressed(path, f)
    except BaseException:
        f.close()
        raise
