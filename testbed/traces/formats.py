"""The trace file formats behind one protocol, and their registry.

A format is an object that says whether a file looks like it (`detect`), reads a file into
requests (`read`), writes requests to a file (`write`) and which block size its hash ids mean.
`FORMATS` holds one of each, in detection order; the loader, `testbed trace ...` and every
`--format` choice come from it. Adding a format is a class here, its name in `FormatName`
and one case in `_format` (mypy names the case a new name lacks). JSONL formats are told apart by
their first object's keys (`FileLook.first_object`): aiperf's multi-turn conversations have
`turns`, Bailian lines `chat_id`, `parent_chat_id` and `turn`; any other `.jsonl` is Mooncake.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Final, Literal, Protocol, get_args

from testbed.config.input_files import InputFileError, refuse_special
from testbed.core.schema.kinds import unknown_kind
from testbed.traces import azure, burstgpt
from testbed.traces.aiperf_multiturn import AIPERF_BLOCK_TOKENS, iter_aiperf, looks_like_aiperf, write_aiperf
from testbed.traces.bailian import BAILIAN_BLOCK_TOKENS, iter_bailian, looks_like_bailian, write_bailian
from testbed.traces.csvutil import LoadStats, Window, describe_header, read_header, sniff_columns
from testbed.traces.files import compression, open_trace, plain_name
from testbed.traces.mooncake import MOONCAKE_BLOCK_TOKENS, iter_mooncake, write_mooncake
from testbed.traces.types import Trace, TraceError, TraceRequest

FormatName = Literal["mooncake", "azure", "burstgpt", "bailian", "aiperf-multi-turn"]


@dataclass(frozen=True)
class ReadOptions:
    """What a reader may push down: `window`/`limit` (see `loader.load_trace`), BurstGPT's
    `keep_failed` and `models`; `stats` counts what was skipped or changed, `on_error` takes
    bad lines instead of raising."""

    window: Window | None = None
    limit: int | None = None
    keep_failed: bool = False
    models: Collection[str] | None = None
    stats: LoadStats | None = None
    on_error: Callable[[TraceError], None] | None = None


@dataclass(frozen=True)
class WriteOptions:
    """`variant`: one of the format's `variants` (None: its default); `seed` and `failed_share`
    draw BurstGPT's extra columns and failed rows."""

    variant: str | None = None
    seed: int = 1
    failed_share: float = 0.0


class FileLook:
    """What detection looks at: the file's suffix, and its CSV header read once if asked for."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.suffix = plain_name(self.path).suffix.lower()  # `x.csv.gz` is a CSV (read decompressed)

    @cached_property
    def columns(self) -> list[str]:
        return sniff_columns(self.path)

    @cached_property
    def first_object(self) -> object:
        """A JSONL file's first non-blank line, parsed (None: none, or not JSON)."""
        try:
            with open_trace(self.path) as f:
                for raw in f:
                    if raw.strip():
                        return json.loads(raw)
        except (ValueError, RecursionError, TraceError):
            return None
        return None

    @cached_property
    def raw_columns(self) -> list[str]:
        """The header's fields as written (for messages)."""
        return read_header(self.path).columns


class TraceFormat(Protocol):
    @property
    def name(self) -> FormatName: ...
    @property
    def label(self) -> str:
        """The format's name in messages ("Azure")."""
        ...

    @property
    def suffix(self) -> str: ...
    @property
    def header(self) -> tuple[str, ...] | None:
        """The CSV columns detection looks for (None: not a CSV format)."""
        ...

    @property
    def block_tokens(self) -> int:
        """Tokens per prefix block, what its hash ids (if any) count in."""
        ...

    @property
    def token_columns(self) -> tuple[str, str] | None:
        """The (input, output) column names its load notes refer to (None: no notes)."""
        ...

    @property
    def variants(self) -> tuple[str, ...]:
        """The layouts `write` can produce (empty: one layout)."""
        ...

    @property
    def default_variant(self) -> str | None: ...
    @property
    def variant_noun(self) -> str:
        """What a variant changes, for help texts ("layout", "header")."""
        ...

    @property
    def carries_hashes(self) -> bool: ...
    @property
    def writes_failed(self) -> bool:
        """Whether `write` can mark rows as failed (`WriteOptions.failed_share`)."""
        ...

    @property
    def filters_models(self) -> bool:
        """Whether it has a Model column to filter on (`ReadOptions.models`)."""
        ...

    def detect(self, look: FileLook) -> bool: ...
    def read(self, path: str | Path, opts: ReadOptions) -> Iterator[TraceRequest]: ...
    def write(self, path: str | Path, trace: Trace, opts: WriteOptions) -> None: ...


def windowed(reqs: Iterator[TraceRequest], window: Window | None, limit: int | None) -> Iterator[TraceRequest]:
    """Window and limit for a format without pushdown (Mooncake files are small), with the
    semantics of `transforms.window` then `transforms.head`."""
    start, end = window if window is not None else (-math.inf, math.inf)
    t0: float | None = None
    kept = 0
    if limit is not None and limit <= 0:
        return
    for r in reqs:
        if r.timestamp < start:
            continue
        if r.timestamp >= end:
            break
        if t0 is None:
            t0 = r.timestamp
        yield (r if t0 == 0.0 else dataclasses.replace(r, timestamp=r.timestamp - t0))
        kept += 1
        if kept == limit:
            break


class Mooncake:
    """Mooncake (FAST'25) JSONL with prefix block hashes (`testbed.traces.mooncake`)."""

    name: Final = "mooncake"
    label = "Mooncake"
    suffix = ".jsonl"
    header = None
    block_tokens = MOONCAKE_BLOCK_TOKENS
    token_columns = None
    variants: tuple[str, ...] = ()
    default_variant = None
    variant_noun = "layout"
    carries_hashes = True
    writes_failed = False
    filters_models = False

    def detect(self, look: FileLook) -> bool:
        if look.suffix != self.suffix:
            return False
        first = look.first_object
        return not (looks_like_bailian(first) or looks_like_aiperf(first))

    def read(self, path: str | Path, opts: ReadOptions) -> Iterator[TraceRequest]:
        return windowed(iter_mooncake(path, on_error=opts.on_error), opts.window, opts.limit)

    def write(self, path: str | Path, trace: Trace, opts: WriteOptions) -> None:
        write_mooncake(path, trace)


class Azure:
    """Azure LLM inference CSV, 2023 and 2024 layouts (`testbed.traces.azure`)."""

    name: Final = "azure"
    label = "Azure"
    suffix = ".csv"
    header = azure.COLUMNS
    block_tokens = azure.BLOCK_TOKENS
    token_columns = (azure.CONTEXT, azure.GENERATED)
    variants = azure.AZURE_STYLES
    default_variant = "2024"
    variant_noun = "layout"
    carries_hashes = False
    writes_failed = False
    filters_models = False

    def detect(self, look: FileLook) -> bool:
        return look.suffix == self.suffix and azure.is_azure_header(look.columns)

    def read(self, path: str | Path, opts: ReadOptions) -> Iterator[TraceRequest]:
        return azure.iter_azure(path, window=opts.window, limit=opts.limit, stats=opts.stats, on_error=opts.on_error)

    def write(self, path: str | Path, trace: Trace, opts: WriteOptions) -> None:
        azure.write_azure(path, trace, opts.variant or self.default_variant)


class BurstGPT:
    """BurstGPT CSV, v1 and v2 headers (`testbed.traces.burstgpt`)."""

    name: Final = "burstgpt"
    label = "BurstGPT"
    suffix = ".csv"
    header = burstgpt.REQUIRED
    block_tokens = burstgpt.BLOCK_TOKENS
    token_columns = (burstgpt.REQUEST, burstgpt.RESPONSE)
    variants = burstgpt.BURSTGPT_VARIANTS
    default_variant = "v2"
    variant_noun = "header"
    carries_hashes = False
    writes_failed = True
    filters_models = True

    def detect(self, look: FileLook) -> bool:
        return look.suffix == self.suffix and burstgpt.is_burstgpt_header(look.columns)

    def read(self, path: str | Path, opts: ReadOptions) -> Iterator[TraceRequest]:
        return burstgpt.iter_burstgpt(
            path,
            window=opts.window,
            limit=opts.limit,
            keep_failed=opts.keep_failed,
            models=opts.models,
            stats=opts.stats,
            on_error=opts.on_error,
        )

    def write(self, path: str | Path, trace: Trace, opts: WriteOptions) -> None:
        burstgpt.write_burstgpt(
            path, trace, opts.variant or self.default_variant, seed=opts.seed, failed_share=opts.failed_share
        )


class Bailian:
    """Alibaba Bailian JSONL: stated sessions, seconds, 16-token blocks (`testbed.traces.bailian`)."""

    name: Final = "bailian"
    label = "Bailian"
    suffix = ".jsonl"
    header = None
    block_tokens = BAILIAN_BLOCK_TOKENS
    token_columns = None
    variants: tuple[str, ...] = ()
    default_variant = None
    variant_noun = "layout"
    carries_hashes = True
    writes_failed = False
    filters_models = False

    def detect(self, look: FileLook) -> bool:
        return look.suffix == self.suffix and looks_like_bailian(look.first_object)

    def read(self, path: str | Path, opts: ReadOptions) -> Iterator[TraceRequest]:
        return windowed(iter_bailian(path, on_error=opts.on_error), opts.window, opts.limit)

    def write(self, path: str | Path, trace: Trace, opts: WriteOptions) -> None:
        write_bailian(path, trace)


class AiperfMultiTurn:
    """aiperf's multi-turn custom dataset JSONL (`testbed.traces.aiperf_multiturn`)."""

    name: Final = "aiperf-multi-turn"
    label = "aiperf multi-turn"
    suffix = ".jsonl"
    header = None
    block_tokens = AIPERF_BLOCK_TOKENS
    token_columns = None
    variants: tuple[str, ...] = ()
    default_variant = None
    variant_noun = "layout"
    carries_hashes = True
    writes_failed = False
    filters_models = False

    def detect(self, look: FileLook) -> bool:
        return look.suffix == self.suffix and looks_like_aiperf(look.first_object)

    def read(self, path: str | Path, opts: ReadOptions) -> Iterator[TraceRequest]:
        return windowed(iter_aiperf(path, on_error=opts.on_error), opts.window, opts.limit)

    def write(self, path: str | Path, trace: Trace, opts: WriteOptions) -> None:
        write_aiperf(path, trace)


def _format(name: FormatName) -> TraceFormat:
    match name:
        case "mooncake":
            return Mooncake()
        case "azure":
            return Azure()
        case "burstgpt":
            return BurstGPT()
        case "bailian":
            return Bailian()
        case "aiperf-multi-turn":
            return AiperfMultiTurn()
        case _:
            unknown_kind("trace format", name)


# In detection order: a suffix alone first, then CSV headers (Azure's columns before BurstGPT's).
FORMATS: Mapping[FormatName, TraceFormat] = MappingProxyType({n: _format(n) for n in get_args(FormatName)})
SUPPORTED_FORMATS: tuple[FormatName, ...] = tuple(FORMATS)


def trace_format(name: str, path: str | Path | None = None) -> TraceFormat:
    """The format called `name` (a value from outside: a flag, a caller's string)."""
    for fmt in FORMATS.values():
        if fmt.name == name:
            return fmt
    raise TraceError(f"unsupported format {name!r} (supported: {', '.join(SUPPORTED_FORMATS)})", path=path)


def detect_format(path: str | Path) -> FormatName:
    """The first format whose `detect` takes the file: a `.jsonl` is aiperf multi-turn or
    Bailian by its first object's keys, else Mooncake; a `.csv` is Azure or BurstGPT by its
    header's column names."""
    try:
        refuse_special(path)
    except InputFileError as e:
        raise TraceError(e.reason, path=path) from None
    look = FileLook(path)
    for fmt in FORMATS.values():
        if fmt.detect(look):
            return fmt.name
    by_header = [f for f in FORMATS.values() if f.header is not None and f.suffix == look.suffix]
    if by_header:
        wanted = [
            f"{f.label}'s {'columns ' if i == 0 else ''}({', '.join(f.header or ())})" for i, f in enumerate(by_header)
        ]
        has = ("neither " + " nor ".join(wanted)) if len(wanted) > 1 else f"not {wanted[0]}"
        expected = [c for f in by_header for c in (f.header or ())]
        raise TraceError(
            f"unsupported format: the header ({describe_header(look.raw_columns, expected)}) has {has}",
            path=path,
            line=1,
        )
    packed = compression(path)
    raise TraceError(
        (f"{packed}-compressed; " if packed else "")
        + f"unsupported format: cannot tell the format from suffix {look.suffix or '(none)'!r} "
        f"(.jsonl, .csv, either one .gz or .zst compressed); give --format, one of {', '.join(SUPPORTED_FORMATS)}",
        path=path,
    )
