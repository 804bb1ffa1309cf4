"""The one place a trace file is opened, so every format refuses the same inputs."""

from __future__ import annotations

import io
from pathlib import Path

from testbed.config.input_files import InputFileError, open_regular
from testbed.traces.types import TraceError


def open_trace(path: str | Path) -> io.BufferedReader:
    """The trace file opened in binary for streaming (no size cap: a trace may be GBs). Only a
    regular file: a FIFO would block the open and a device never ends. TraceError otherwise."""
    try:
        return open_regular(path)
    except InputFileError as e:
        raise TraceError(e.reason, path=path) from None
    except OSError as e:
        raise TraceError(f"cannot open: {e.strerror or e}", path=path) from None
