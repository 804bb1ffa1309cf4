"""Readers of server measurements for `testbed calibrate`: two CSV layouts of our own, aiperf's
per-request export and `vllm bench serve`'s result JSON. Errors name file, line and field.

CSV (a header line naming the columns is optional; without one the columns are positional;
blank lines and lines starting with '#' are skipped; extra named columns are ignored):
- prefill: `prompt_tokens,cached_tokens,prefill_s` (or `prompt_tokens,prefill_s`): prompt length
  in tokens, how many of them were a prefix-cache hit (so uncached = prompt - cached), seconds.
- decode: `batch_size,context_tokens,step_s`: sequences in the batch (a mean may be fractional),
  the tokens they hold in all (prompt + generated, summed over the batch), seconds per step.

aiperf (0.13) `profile_export.jsonl`, one `MetricRecordInfo` per line:
  {"metadata": {"request_start_ns": ..., "request_end_ns": ..., "benchmark_phase": "profiling",
   "was_cancelled": false, ...},
   "metrics": {"input_sequence_length": {"value": 550, "unit": "tokens"},
               "time_to_first_token": {"value": 255.9, "unit": "ms"},
               "request_latency": {"value": 297.5, "unit": "ms"},
               "output_sequence_length": {"value": 9, "unit": "tokens"},
               "usage_prompt_cache_read_tokens": {...}, ...},
   "error": {...}}            (null fields are left out)
  Used: input_sequence_length (prompt tokens), usage_prompt_cache_read_tokens (cached, when the
  server reports `prompt_tokens_details.cached_tokens`; else 0), output_sequence_length (else
  output_token_count), time_to_first_token, request_latency, metadata.request_start_ns (send
  time). Left out: warmup records, records with an error, cancelled ones.
  TTFT needs a streaming run (`aiperf profile --streaming`).

vllm `vllm bench serve --save-result --save-detailed` (vllm/benchmarks/serve.py): one JSON object
per run (`--append-result` adds one per line): top-level `max_concurrency` (int or null) and
per-request lists `input_lens`, `output_lens`, `ttfts` (s), `latencies` (s), `itls` (s between
chunks), `start_times` (s, newer versions), `errors` ("" on success). Without `--save-detailed`
the per-request lists are not saved. No cached-token counts: taken as 0.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.config.input_files import (
    MAX_CONFIG_BYTES,
    InputFileError,
    decode_utf8,
    json_kind,
    open_regular,
    quotable_header,
    read_text_capped,
)
from testbed.core.errors import UserError
from testbed.hardware.calibrate import DecodePoint, PrefillPoint, RequestRecord

PREFILL_COLUMNS = ("prompt_tokens", "cached_tokens", "prefill_s")
DECODE_COLUMNS = ("batch_size", "context_tokens", "step_s")
AIPERF_EXPORT = "profile_export.jsonl"

_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0}


class MeasurementError(UserError, ValueError):
    """An unusable measurement file: `path:line: field 'f': what is wrong`."""

    def __init__(self, message: str, *, path: str | Path, line: int | None = None, field: str | None = None) -> None:
        self.path, self.line, self.field, self.detail = str(path), line, field, message
        where = self.path if line is None else f"{self.path}:{line}"
        what = f"field {field!r}: " if field is not None else ""
        super().__init__(f"{where}: {what}{message}")


class _Bad(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


def _show(v: object) -> str:
    s = json.dumps(v) if not isinstance(v, str) else repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _number(v: object, field: str, *, positive: bool = False, text: bool = False) -> float:
    """A number: a JSON number, or with `text` a CSV cell."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)) or (isinstance(v, str) and not text):
        raise _Bad(field, f"expected a number, got {_show(v)}")
    try:
        x = float(v)
    except ValueError:
        raise _Bad(field, f"expected a number, got {_show(v)}") from None
    if not math.isfinite(x) or x < 0 or (positive and x == 0):
        raise _Bad(field, f"expected a {'positive' if positive else 'non-negative'} finite number, got {_show(v)}")
    return x


def _count(v: object, field: str, text: bool = False) -> int:
    x = _number(v, field, text=text)
    if not x.is_integer():
        raise _Bad(field, f"expected a whole number of tokens, got {_show(v)}")
    return int(x)


# ---- CSV -------------------------------------------------------------------------------------


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# A measured table is read whole; tables are tens to thousands of rows (see MAX_CONFIG_BYTES).
MAX_TABLE_BYTES = MAX_CONFIG_BYTES


def _open(path: Path) -> io.BufferedReader:
    """A measurement file for streaming: regular files only (exports of profiled requests may be
    large, so no size cap); a FIFO or device is refused rather than hung on."""
    try:
        return open_regular(path)
    except InputFileError as e:
        raise MeasurementError(e.reason, path=path) from None
    except OSError as e:
        raise MeasurementError(f"cannot read: {e.strerror or e}", path=path) from None


def _csv_rows(path: Path, columns: tuple[str, ...], optional: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    """(line, {column: text}) per data row. A first row with no number in it is the header (one
    with some numbers is data, so that a bad value there is reported as one)."""
    try:
        text = read_text_capped(path, MAX_TABLE_BYTES)
    except InputFileError as e:
        raise MeasurementError(e.reason, path=path) from None
    except OSError as e:
        raise MeasurementError(f"cannot read: {e.strerror or e}", path=path) from None
    positions: dict[str, int] | None = None
    positional = [c for c in columns if c not in optional]
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        for row in reader:
            line = reader.line_num
            cells = [c.strip() for c in row]
            if not any(cells) or cells[0].startswith("#"):
                continue
            if positions is None:
                if not any(_is_number(c) for c in cells):
                    names = [c.casefold() for c in cells]
                    for c in columns:
                        if c not in names and c not in optional:
                            raise MeasurementError(
                                f"missing column (header: {quotable_header(cells, columns)}; expected "
                                f"{', '.join(columns)})",
                                path=path,
                                line=line,
                                field=c,
                            )
                    positions = {c: names.index(c) for c in columns if c in names}
                    continue
                # No header: all the columns, or those without the optional ones, in order.
                use = list(columns) if len(cells) == len(columns) else positional
                if len(cells) != len(use):
                    raise MeasurementError(
                        f"expected {len(columns)} or {len(positional)} numbers "
                        f"({', '.join(columns)}), got {len(cells)} fields",
                        path=path,
                        line=line,
                    )
                positions = {c: i for i, c in enumerate(use)}
            width = max(positions.values()) + 1
            if len(cells) < width:
                raise MeasurementError(f"expected at least {width} fields, got {len(cells)}", path=path, line=line)
            yield line, {c: cells[i] for c, i in positions.items()}
    except csv.Error as e:
        raise MeasurementError(f"bad CSV ({e})", path=path, line=reader.line_num) from None


def read_prefill_csv(path: str | Path) -> list[PrefillPoint]:
    p = Path(path)
    out: list[PrefillPoint] = []
    for line, row in _csv_rows(p, PREFILL_COLUMNS, ("cached_tokens",)):
        try:
            prompt = _count(row["prompt_tokens"], "prompt_tokens", text=True)
            cached = _count(row.get("cached_tokens", "0"), "cached_tokens", text=True)
            secs = _number(row["prefill_s"], "prefill_s", positive=True, text=True)
            if cached > prompt:
                raise _Bad("cached_tokens", f"{cached} cached tokens is more than the prompt's {prompt}")
        except _Bad as e:
            raise MeasurementError(e.message, path=p, line=line, field=e.field) from None
        out.append(PrefillPoint(float(prompt - cached), float(cached), secs, f"{p.name}:{line}"))
    if not out:
        raise MeasurementError("no data rows", path=p)
    return out


def read_decode_csv(path: str | Path) -> list[DecodePoint]:
    p = Path(path)
    out: list[DecodePoint] = []
    for line, row in _csv_rows(p, DECODE_COLUMNS, ()):
        try:
            batch = _number(row["batch_size"], "batch_size", positive=True, text=True)
            ctx = _number(row["context_tokens"], "context_tokens", text=True)
            secs = _number(row["step_s"], "step_s", positive=True, text=True)
        except _Bad as e:
            raise MeasurementError(e.message, path=p, line=line, field=e.field) from None
        out.append(DecodePoint(batch, ctx, secs, f"{p.name}:{line}"))
    if not out:
        raise MeasurementError("no data rows", path=p)
    return out


# ---- aiperf ----------------------------------------------------------------------------------


@dataclass
class ReadStats:
    """What a reader left out, for the report."""

    used: int = 0
    warmup: int = 0
    failed: int = 0
    no_cache_counts: int = 0

    def note(self, path: Path) -> str:
        parts = [f"{path}: {self.used} requests"]
        if self.warmup:
            parts.append(f"{self.warmup} warmup left out")
        if self.failed:
            parts.append(f"{self.failed} failed or cancelled left out")
        if self.no_cache_counts:
            parts.append(f"no cached-token counts for {self.no_cache_counts} (taken as 0)")
        return ", ".join(parts)


def _metric(metrics: dict[str, object], name: str, required: bool = True) -> tuple[object, str] | None:
    m = metrics.get(name)
    if m is None:
        if required:
            raise _Bad(
                f"metrics.{name}",
                "missing"
                + (
                    " (TTFT is measured only on streaming runs: aiperf profile --streaming)"
                    if name == "time_to_first_token"
                    else ""
                ),
            )
        return None
    if not isinstance(m, dict) or "value" not in m:
        raise _Bad(f"metrics.{name}", f'expected {{"value": ..., "unit": ...}}, got {_show(m)}')
    return m["value"], str(m.get("unit", ""))


def _seconds(metrics: dict[str, object], name: str) -> float:
    got = _metric(metrics, name)
    assert got is not None
    value, unit = got
    if unit not in _TIME_UNITS:
        raise _Bad(f"metrics.{name}.unit", f"unknown time unit {unit!r} (expected one of {', '.join(_TIME_UNITS)})")
    return _number(value, f"metrics.{name}.value") * _TIME_UNITS[unit]


def _tokens(metrics: dict[str, object], *names: str) -> int | None:
    for name in names:
        got = _metric(metrics, name, required=False)
        if got is not None:
            return _count(got[0], f"metrics.{name}.value")
    return None


def aiperf_path(path: str | Path) -> Path:
    """An aiperf artifacts directory means its profile_export.jsonl."""
    p = Path(path)
    return p / AIPERF_EXPORT if p.is_dir() else p


def read_aiperf(path: str | Path, stats: ReadStats | None = None) -> list[RequestRecord]:
    p = aiperf_path(path)
    st = stats if stats is not None else ReadStats()
    # Every run's file has the same name: its artifacts directory tells them apart.
    label = f"{p.parent.name}/{p.name}" if p.name == AIPERF_EXPORT and p.parent.name else p.name
    out: list[RequestRecord] = []
    for line, rec in _json_lines(p):
        try:
            if not isinstance(rec, dict):
                raise _Bad("(record)", f"expected a JSON object, got {json_kind(rec)}")
            meta = rec.get("metadata")
            if not isinstance(meta, dict):
                raise _Bad("metadata", f"expected an object, got {json_kind(meta)}")
            if meta.get("benchmark_phase", "profiling") != "profiling":
                st.warmup += 1
                continue
            if rec.get("error") is not None or meta.get("was_cancelled") is True:
                st.failed += 1
                continue
            metrics = rec.get("metrics")
            if not isinstance(metrics, dict):
                raise _Bad("metrics", f"expected an object, got {json_kind(metrics)}")
            prompt = _tokens(metrics, "input_sequence_length")
            if prompt is None:
                raise _Bad("metrics.input_sequence_length", "missing")
            output = _tokens(metrics, "output_sequence_length", "output_token_count")
            if output is None:
                raise _Bad("metrics.output_sequence_length", "missing (and no output_token_count)")
            cached = _tokens(metrics, "usage_prompt_cache_read_tokens")
            ttft = _seconds(metrics, "time_to_first_token")
            latency = _seconds(metrics, "request_latency")
            start = _number(meta.get("request_start_ns"), "metadata.request_start_ns") * 1e-9
            if cached is not None and cached > prompt:
                raise _Bad(
                    "metrics.usage_prompt_cache_read_tokens",
                    f"{cached} cached tokens is more than the {prompt} input tokens",
                )
            if latency < ttft:
                raise _Bad("metrics.request_latency", f"{latency:g} s is less than the TTFT {ttft:g} s")
        except _Bad as e:
            raise MeasurementError(e.message, path=p, line=line, field=e.field) from None
        if cached is None:
            st.no_cache_counts += 1
        st.used += 1
        out.append(RequestRecord(f"{label}:{line}", str(p), prompt, cached, output, ttft, latency, start))
    if not out:
        raise MeasurementError("no successful profiling records", path=p)
    return out


def _json_lines(path: Path) -> Iterator[tuple[int, object]]:
    with io.TextIOWrapper(_open(path), encoding="utf-8") as f:
        try:
            for n, text in enumerate(f, 1):
                if text.strip():
                    try:
                        yield n, json.loads(text)
                    except json.JSONDecodeError as e:
                        raise MeasurementError(
                            f"not valid JSON ({e.msg} at column {e.colno})", path=path, line=n
                        ) from None
        except UnicodeDecodeError as e:
            raise MeasurementError(f"not UTF-8 text ({e.reason})", path=path) from None


# ---- vllm bench serve ------------------------------------------------------------------------

_VLLM_LISTS = ("input_lens", "output_lens", "ttfts")


def _json_documents(path: Path) -> Iterator[tuple[int, object]]:
    """(line, object) for each JSON document in the file: one, or one per run appended."""
    try:
        with _open(path) as f:
            text = decode_utf8(f.read(), path)
    except InputFileError as e:
        raise MeasurementError(e.reason, path=path) from None
    except OSError as e:
        raise MeasurementError(f"cannot read: {e.strerror or e}", path=path) from None
    dec = json.JSONDecoder()
    pos = 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            return
        line = text.count("\n", 0, pos) + 1
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise MeasurementError(f"not valid JSON ({e.msg} at column {e.colno})", path=path, line=e.lineno) from None
        yield line, obj


def read_vllm(path: str | Path, stats: ReadStats | None = None) -> list[RequestRecord]:
    p = Path(path)
    st = stats if stats is not None else ReadStats()
    out: list[RequestRecord] = []
    for run_no, (line, doc) in enumerate(_json_documents(p), 1):
        try:
            out += _vllm_run(p, line, run_no, doc, st)
        except _Bad as e:
            raise MeasurementError(e.message, path=p, line=line, field=e.field) from None
    if not out:
        raise MeasurementError("no successful requests", path=p)
    return out


def _list(doc: dict[str, object], name: str, n: int | None) -> list[Any]:
    v = doc[name]
    if not isinstance(v, list):
        raise _Bad(name, f"expected a list, got {_show(v)}")
    if n is not None and len(v) != n:
        raise _Bad(name, f"has {len(v)} entries, input_lens has {n}")
    return v


def _vllm_run(p: Path, line: int, run_no: int, doc: object, st: ReadStats) -> list[RequestRecord]:
    if not isinstance(doc, dict):
        raise _Bad("(document)", f"expected a JSON object, got {json_kind(doc)}")
    missing = [k for k in _VLLM_LISTS if k not in doc]
    if missing:
        raise _Bad(
            missing[0],
            "missing: the per-request lists are saved only by `vllm bench serve --save-result --save-detailed`",
        )
    n = len(_list(doc, "input_lens", None))
    lens, outs, ttfts = (_list(doc, k, n) for k in _VLLM_LISTS)
    lat = _list(doc, "latencies", n) if "latencies" in doc else None
    itls = _list(doc, "itls", n) if "itls" in doc else None
    if lat is None and itls is None:
        raise _Bad("latencies", "missing (and no itls to add up)")
    starts = _list(doc, "start_times", n) if "start_times" in doc else None
    errors = _list(doc, "errors", n) if "errors" in doc else None
    conc = doc.get("max_concurrency")
    if conc is not None:
        conc = _count(conc, "max_concurrency")
    run = f"{p}" if run_no == 1 else f"{p} (run {run_no})"
    out: list[RequestRecord] = []
    for i in range(n):
        # A failed request: an error text, no output or no first token (vllm saves 0 then).
        if (errors is not None and errors[i]) or outs[i] == 0 or ttfts[i] == 0:
            st.failed += 1
            continue
        prompt = _count(lens[i], f"input_lens[{i}]")
        output = _count(outs[i], f"output_lens[{i}]")
        ttft = _number(ttfts[i], f"ttfts[{i}]", positive=True)
        if lat is not None:
            latency = _number(lat[i], f"latencies[{i}]", positive=True)
        else:
            assert itls is not None
            gaps = itls[i]
            if not isinstance(gaps, list):
                raise _Bad(f"itls[{i}]", f"expected a list of seconds, got {_show(gaps)}")
            latency = ttft + sum(_number(g, f"itls[{i}][{k}]") for k, g in enumerate(gaps))
        if latency < ttft:
            raise _Bad(f"latencies[{i}]", f"{latency:g} s is less than the TTFT {ttft:g} s")
        start = _number(starts[i], f"start_times[{i}]") if starts is not None else None
        st.no_cache_counts += 1
        st.used += 1
        out.append(RequestRecord(f"{p.name}:{line}:{i}", run, prompt, None, output, ttft, latency, start, conc))
    return out
