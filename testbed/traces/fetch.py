"""Download the public traces (`traces/fetch`): Mooncake FAST'25, Azure LLM inference 2023 and
2024, BurstGPT. Files land in DEST/GROUP/NAME; a mirror serves the same layout under its base URL
(so `python -m http.server -d traces/public` is one). A file already complete is skipped, a
partial one (NAME.part) resumed where the server supports ranges. Each file is then validated
with the project's loader.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.client import HTTPResponse
from pathlib import Path
from typing import TextIO, cast

MIRROR_ENV = "TESTBED_TRACE_MIRROR"
_CHUNK = 1 << 20
_REPORT_S = 10.0

_MOONCAKE = "https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces/"
_AZURE_2023 = "https://raw.githubusercontent.com/Azure/AzurePublicDataset/master/data/"
_AZURE_2024 = "https://github.com/Azure/AzurePublicDataset/releases/download/dataset-llm-2024/"
# Where the 2024 files were first published, before their move to the GitHub release.
_AZURE_2024_BLOB = "https://azurepublicdatasettraces.blob.core.windows.net/azurellminfererencetrace/"
_BURSTGPT = "https://github.com/HPMLL/BurstGPT/releases/download/v2.0/"


@dataclass(frozen=True)
class TraceFile:
    group: str
    name: str
    urls: tuple[str, ...]  # tried in order
    about: str

    @property
    def rel(self) -> str:
        return f"{self.group}/{self.name}"


CATALOGUE: tuple[TraceFile, ...] = (
    TraceFile(
        "mooncake", "conversation_trace.jsonl", (_MOONCAKE + "conversation_trace.jsonl",), "12,031 requests, ~1 h, 3 MB"
    ),
    TraceFile("mooncake", "toolagent_trace.jsonl", (_MOONCAKE + "toolagent_trace.jsonl",), "23,608 requests, 4 MB"),
    TraceFile("mooncake", "synthetic_trace.jsonl", (_MOONCAKE + "synthetic_trace.jsonl",), "3,993 requests, 1 MB"),
    TraceFile(
        "azure-2023",
        "AzureLLMInferenceTrace_code.csv",
        (_AZURE_2023 + "AzureLLMInferenceTrace_code.csv",),
        "code, 1 h of 2023-11-16, <1 MB",
    ),
    TraceFile(
        "azure-2023",
        "AzureLLMInferenceTrace_conv.csv",
        (_AZURE_2023 + "AzureLLMInferenceTrace_conv.csv",),
        "conversation, 1 h of 2023-11-16, 1 MB",
    ),
    TraceFile(
        "azure-2024",
        "AzureLLMInferenceTrace_code_1week.csv",
        (
            _AZURE_2024 + "AzureLLMInferenceTrace_code_1week.csv",
            _AZURE_2024_BLOB + "AzureLLMInferenceTrace_code_1week.csv",
        ),
        "code, a week of May 2024, 16.8M rows, ~0.7 GB",
    ),
    TraceFile(
        "azure-2024",
        "AzureLLMInferenceTrace_conv_1week.csv",
        (
            _AZURE_2024 + "AzureLLMInferenceTrace_conv_1week.csv",
            _AZURE_2024_BLOB + "AzureLLMInferenceTrace_conv_1week.csv",
        ),
        "conversation, a week of May 2024, 27.3M rows, 1.1 GB",
    ),
    TraceFile(
        "burstgpt", "BurstGPT_1.csv", (_BURSTGPT + "BurstGPT_1.csv",), "months 1-2 with failures, 1.43M rows, 52 MB"
    ),
    TraceFile(
        "burstgpt", "BurstGPT_2.csv", (_BURSTGPT + "BurstGPT_2.csv",), "months 3-4 with failures, 3.86M rows, 145 MB"
    ),
    TraceFile(
        "burstgpt",
        "BurstGPT_3.csv",
        (_BURSTGPT + "BurstGPT_3.csv",),
        "with Session ID and Elapsed time, with failures, 5.34M rows, 232 MB",
    ),
    TraceFile(
        "burstgpt",
        "BurstGPT_without_fails_1.csv",
        (_BURSTGPT + "BurstGPT_without_fails_1.csv",),
        "months 1-2, 1.40M rows, 51 MB",
    ),
    TraceFile(
        "burstgpt",
        "BurstGPT_without_fails_2.csv",
        (_BURSTGPT + "BurstGPT_without_fails_2.csv",),
        "months 3-4, 3.78M rows, 142 MB",
    ),
    TraceFile(
        "burstgpt",
        "BurstGPT_without_fails_3.csv",
        (_BURSTGPT + "BurstGPT_without_fails_3.csv",),
        "with Session ID and Elapsed time, 217 MB",
    ),
)
GROUPS = tuple(dict.fromkeys(f.group for f in CATALOGUE))
ALIASES = {"all": GROUPS, "azure": ("azure-2023", "azure-2024")}


class FetchError(Exception):
    pass


def select(names: list[str]) -> list[TraceFile]:
    """Catalogue entries for `names`: `all`, a group (mooncake, azure-2023, azure-2024, azure,
    burstgpt) or a file name; in catalogue order, each once."""
    chosen: set[str] = set()
    for name in names:
        groups = ALIASES.get(name, (name,) if name in GROUPS else ())
        files = [f for f in CATALOGUE if f.group in groups or f.name == name]
        if not files:
            known = ", ".join([*ALIASES, *GROUPS])
            raise FetchError(f"unknown trace {name!r}: one of {known}, or a file name (--list shows them)")
        chosen.update(f.rel for f in files)
    return [f for f in CATALOGUE if f.rel in chosen]


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def _open(url: str, offset: int, timeout: float) -> HTTPResponse:
    headers = {"User-Agent": "prfaas-testbed-fetch/1"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    # A file:// mirror gives an addinfourl: the same status, headers and read() (ranges ignored).
    return cast(HTTPResponse, urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout))


def _total_from_range(value: str | None) -> int | None:
    m = re.fullmatch(r"bytes (?:\d+-\d+|\*)/(\d+)", (value or "").strip())
    return int(m[1]) if m else None


def download(url: str, dest: Path, *, timeout: float = 60.0, out: TextIO | None = None) -> str:
    """Fetch `url` to `dest` via `dest.part`; returns "present", "resumed" or "downloaded".

    A `dest` that exists is checked against the server's size (a request for the bytes past
    its end: 416 or an equal Content-Length means complete) and re-fetched if it differs.
    """
    part = dest.with_name(dest.name + ".part")
    if dest.exists():
        have, current = dest.stat().st_size, dest
    elif part.exists():
        have, current = part.stat().st_size, part
    else:
        have, current = 0, part
    try:
        resp = _open(url, have, timeout)
    except urllib.error.HTTPError as e:
        total = _total_from_range(e.headers.get("Content-Range")) if e.code == 416 else None
        if e.code == 416 and have and total in (None, have):
            if current is part:
                part.replace(dest)
            return "present"
        if e.code == 416 and have and total is not None:
            current.unlink()  # longer than the server's file: not a prefix of it
            return download(url, dest, timeout=timeout, out=out)
        raise FetchError(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        raise FetchError(f"{url}: {getattr(e, 'reason', e)}") from None
    with resp:
        length = resp.headers.get("Content-Length")
        if resp.status == 206:
            start = re.match(r"bytes (\d+)-", resp.headers.get("Content-Range", ""))
            if start is None or int(start[1]) != have:
                raise FetchError(f"{url}: server resumed at the wrong offset ({resp.headers.get('Content-Range')})")
            total = _total_from_range(resp.headers.get("Content-Range"))
            mode, how = "ab", "resumed"
        else:
            total = int(length) if length is not None else None
            if current is dest and total == have:
                return "present"
            mode, how, have = "wb", "downloaded", 0
        if current is dest:
            dest.replace(part)
        dest.parent.mkdir(parents=True, exist_ok=True)
        got = have
        t0 = time.monotonic()
        report = t0 + _REPORT_S
        with part.open(mode) as f:
            while chunk := resp.read(_CHUNK):
                f.write(chunk)
                got += len(chunk)
                if out is not None and time.monotonic() >= report:
                    report += _REPORT_S
                    print(f"  {_size(got)}" + (f" of {_size(total)}" if total else ""), file=out, flush=True)
    if total is not None and got != total:
        raise FetchError(f"{url}: got {got:,} of {total:,} bytes (rerun to resume)")
    part.replace(dest)
    dt = max(time.monotonic() - t0, 1e-9)
    if out is not None:
        print(f"  {_size(got - have)} in {dt:.1f} s ({(got - have) / dt / 1e6:.1f} MB/s)", file=out)
    return how


def validate(path: Path) -> str:
    """`N requests over D s` from streaming the file through the loader (nothing is held)."""
    from testbed.traces.csvutil import LoadStats
    from testbed.traces.loader import detect_format, iter_trace, notes_for

    fmt = detect_format(path)
    stats = LoadStats()
    n, first, last = 0, 0.0, 0.0
    for r in iter_trace(path, fmt, stats=stats):
        if n == 0:
            first = r.timestamp
        last = r.timestamp
        n += 1
    notes = notes_for(fmt, stats)
    return f"{fmt}, {n:,} requests over {last - first:,.1f} s" + "".join(f"; {x}" for x in notes)


def main(argv: list[str] | None = None, default_dest: Path | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="traces/fetch",
        description="Download public LLM serving traces and check each with the project's loader.",
    )
    p.add_argument(
        "names", nargs="*", metavar="NAME", help=f"all, a group ({', '.join([*GROUPS, 'azure'])}) or a file name"
    )
    p.add_argument(
        "--dest",
        type=Path,
        default=default_dest or Path("traces/public"),
        help="directory for GROUP/NAME (default: traces/public, git-ignored)",
    )
    p.add_argument(
        "--base-url",
        default=os.environ.get(MIRROR_ENV),
        help=f"fetch GROUP/NAME from this mirror instead of the upstream URLs (env {MIRROR_ENV})",
    )
    p.add_argument("--list", action="store_true", help="list the known files and exit")
    p.add_argument("--no-validate", action="store_true", help="skip loading each file after download")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="network timeout per read (s)")
    args = p.parse_args(argv)
    if args.list or not args.names:
        for f in CATALOGUE:
            print(f"{f.group:<11} {f.name:<38} {f.about}")
        if not args.list:
            print("\ngive NAME(s) to download, e.g. `traces/fetch mooncake` or `traces/fetch all`", file=sys.stderr)
            return 2
        return 0
    try:
        files = select(args.names)
    except FetchError as e:
        print(f"fetch: {e}", file=sys.stderr)
        return 2
    failed = 0
    for f in files:
        dest = args.dest / f.group / f.name
        urls = (f"{args.base_url.rstrip('/')}/{f.rel}",) if args.base_url else f.urls
        status = ""
        errors: list[str] = []
        print(f"{f.rel}: fetching", flush=True)
        for url in urls:
            try:
                status = download(url, dest, timeout=args.timeout, out=sys.stdout)
                break
            except FetchError as e:
                errors.append(str(e))
        if not status:
            failed += 1
            print(f"{f.rel}: FAILED: {'; '.join(errors)}", flush=True)
            continue
        line = f"{f.rel}: {status}, {_size(dest.stat().st_size)}"
        if not args.no_validate:
            try:
                line += f"; {validate(dest)}"
            except ValueError as e:  # TraceError
                failed += 1
                line += f"; INVALID: {e}"
        print(line, flush=True)
    if failed:
        print(f"fetch: {failed} of {len(files)} files failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
