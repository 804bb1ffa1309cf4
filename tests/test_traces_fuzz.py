"""Every trace loader fed hostile lines: each line becomes a valid request or a TraceError naming
the file and line, never another exception. Hypothesis draws the odd values; each example batches
many lines (a seeded Random assembles them) so that the tests read over 10,000 lines in all."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import random
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed.core.schema.limits import MAX_HASH_ID, MAX_INPUT_TOKENS, MAX_OUTPUT_TOKENS
from testbed.traces import trace_command as command
from testbed.traces.loader import iter_trace
from testbed.traces.types import TraceError, TraceRequest

pytestmark = pytest.mark.pure

FUZZ = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
BOM = b"\xef\xbb\xbf"
EOLS = (b"\n", b"\n", b"\n", b"\r\n", b"\r\n", b"\r")

HUGE = [
    2**63 - 1,
    2**63,
    2**64,
    -(2**63),
    -(2**64),
    10**30,
    10**300,
    MAX_INPUT_TOKENS,
    MAX_INPUT_TOKENS + 1,
    MAX_OUTPUT_TOKENS + 1,
    0,
    -1,
    1,
    2**53,
    2**53 + 1,
]
json_values = st.one_of(
    st.integers(),
    st.sampled_from(HUGE),
    st.floats(),
    st.booleans(),
    st.none(),
    st.text(max_size=30),
    st.lists(st.integers(), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
# Text a CSV field may hold instead of a number.
NUMBERISH = [
    "",
    " ",
    "-1",
    "+5",
    "1e5",
    "1E5",
    "0x10",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "Infinity",
    "1.5",
    ".5",
    "5.",
    "1.0.0",
    "٣",
    "²",
    "５",
    "1_000",
    " 7",
    "7 ",
    "0" * 40 + "7",
    "9" * 20,
    "9" * 5000,
    "1" + "0" * 400,
    str(2**63),
    str(2**64),
    str(MAX_INPUT_TOKENS + 1),
    "\x00",
    "\ufeff5",
    "５.0",
    "7\r",
    "\u00a07",
]
fields = st.one_of(st.sampled_from(NUMBERISH), st.text(max_size=40))


def _valid(reqs: list[TraceRequest]) -> None:
    prev = 0.0
    for r in reqs:
        assert type(r.input_tokens) is int and 1 <= r.input_tokens <= MAX_INPUT_TOKENS
        assert type(r.output_tokens) is int and 1 <= r.output_tokens <= MAX_OUTPUT_TOKENS
        assert math.isfinite(r.timestamp) and r.timestamp >= prev
        assert all(type(h) is int and 0 <= h <= MAX_HASH_ID for h in r.hash_ids)
        prev = r.timestamp


def _cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    command.register(p.add_subparsers(dest="command"))
    args = p.parse_args(argv)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc: int = args.func(args)
    return rc


def _check(path: Path, data: bytes, fmt: str, rnd: random.Random, **kw: Any) -> None:
    """The invariants, for one file: strict and collecting loads agree, requests are valid,
    errors are TraceErrors naming the file and a line in it, and the commands exit 0 or 2."""
    path.write_bytes(data)
    physical = data.count(b"\n") + data.count(b"\r") + 1
    strict: TraceError | None = None
    try:
        _valid(list(iter_trace(path, fmt, **kw)))
    except TraceError as e:
        strict = e
    errors: list[TraceError] = []
    try:
        got = list(iter_trace(path, fmt, on_error=errors.append, **kw))
    except TraceError as e:  # the file as a whole is unreadable (header, format)
        assert strict is not None and str(e) == str(strict) and not errors
        assert e.path == str(path) and e.line in (None, 1)
        return
    _valid(got)
    for e in errors:
        assert isinstance(e, TraceError) and e.path == str(path)
        assert e.line is not None and 1 <= e.line <= physical, (e.line, physical)
    assert (strict is None) == (not errors)
    if strict is not None:
        assert str(strict) == str(errors[0])
    if fmt == "mooncake":
        nonblank = sum(1 for raw in io.BytesIO(data) if raw.strip())
        assert len(got) + len(errors) == nonblank
    if not kw:
        assert _cli(["trace", "validate", str(path), "--format", fmt]) == (2 if errors else 0)
        if rnd.random() < 0.25:
            assert _cli(["trace", "info", str(path), "--format", fmt]) == (2 if errors else 0)


def _join(lines: list[bytes], rnd: random.Random) -> bytes:
    out = bytearray()
    for line in lines:
        out += line + rnd.choice(EOLS)
    if out and rnd.random() < 0.2:
        out = out.rstrip(b"\r\n")  # no final line end
    return bytes(out)


# --- Mooncake ------------------------------------------------------------------------------


def _mooncake_lines(
    rnd: random.Random, n: int, values: list[Any], blobs: list[bytes], texts: list[str]
) -> Iterator[bytes]:
    ts = rnd.choice([0, 5, 10**6, 1.5])
    for _ in range(n):
        ts += rnd.choice([0, 0, 1, 7, 250, 0.25])
        k = rnd.randrange(6)
        ids: list[Any] = [rnd.randrange(1000) for _ in range(rnd.randrange(8))]
        rec: dict[str, Any] = {
            "timestamp": ts,
            "input_length": rnd.randint(1, MAX_INPUT_TOKENS),
            "output_length": rnd.choice([1, 2, 300, MAX_OUTPUT_TOKENS]),
            "hash_ids": ids,
        }
        kind = rnd.randrange(16)
        if kind == 0:
            rec[rnd.choice(list(rec))] = rnd.choice(values)
        elif kind == 1:
            del rec[rnd.choice(list(rec))]
        elif kind == 2 and ids:
            ids[rnd.randrange(len(ids))] = rnd.choice(values)
        elif kind == 3:
            rec[rnd.choice(texts)] = rnd.choice(values)  # extra keys, unicode ones too
        elif kind == 4:
            rec["timestamp"] = rnd.choice([-1, ts - 1, 1e308, 2**70, 10**400 if k else -0.0])
        elif kind == 5:
            yield rnd.choice(blobs)
            continue
        elif kind == 6:
            yield rnd.choice(texts).encode(rnd.choice(["utf-8", "utf-8", "utf-16", "latin-1"]), "replace")
            continue
        elif kind == 7:
            yield rnd.choice([b"[", b'{"a":']) * rnd.randrange(1000, 60_000)
            continue
        elif kind == 8:
            yield b'{"timestamp": 1' + b"0" * rnd.randrange(4000, 6000) + b', "input_length": 1}'
            continue
        elif kind == 9:
            rec["hash_ids"] = list(range(rnd.randrange(5000, 30_000)))  # a very long line
        elif kind == 10:
            yield rnd.choice([b"NaN", b"Infinity", b"-Infinity", b"null", b"[]", b"1", b'"x"', b"", b"  \t"])
            continue
        elif kind == 11:
            yield json.dumps(rec).encode()[: rnd.randrange(1, 40)]  # cut short
            continue
        elif kind == 12:
            yield json.dumps(rec).replace(str(ts), rnd.choice(["NaN", "Infinity", "-Infinity"]), 1).encode()
            continue
        line = json.dumps(rec, ensure_ascii=rnd.random() < 0.5).encode()
        yield (BOM + line) if rnd.random() < 0.05 else line


def test_mooncake_hostile_lines() -> None:
    lines_per_example = 100
    total = 0
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "fuzz.jsonl"

        @FUZZ
        @given(
            rnd=st.randoms(use_true_random=True),
            values=st.lists(json_values, min_size=1, max_size=12),
            blobs=st.lists(st.binary(max_size=300), min_size=1, max_size=4),
            texts=st.lists(st.text(max_size=80), min_size=1, max_size=4),
        )
        def run(rnd: random.Random, values: list[Any], blobs: list[bytes], texts: list[str]) -> None:
            nonlocal total
            lines = list(_mooncake_lines(rnd, lines_per_example, values, blobs, texts))
            _check(path, _join(lines, rnd), "mooncake", rnd)
            total += len(lines)

        run()
    assert total >= FUZZ.max_examples * lines_per_example


# --- CSV -----------------------------------------------------------------------------------


def _azure_stamp(rnd: random.Random, t: float, style: str) -> str:
    """`t` seconds after 2024-05-10 00:00, in microseconds, in the style's layout."""
    sec, us = divmod(round(t * 1e6), 1_000_000)
    day, sec = divmod(sec, 86400)
    sep = "T" if rnd.random() < 0.05 else " "
    stamp = f"2024-05-{10 + day:02d}{sep}{sec // 3600:02d}:{sec // 60 % 60:02d}:{sec % 60:02d}"
    if style == "2023":
        return f"{stamp}.{us:06d}0"
    return f"{stamp}.{us:06d}{rnd.choice(['+00:00', '+00:00', '+00:00', 'Z', '+0000'])}"


def _csv_rows(
    rnd: random.Random,
    n: int,
    ncols: int,
    good: Callable[[float], list[str]],
    time_col: int,
    texts: list[str],
    blobs: list[bytes],
) -> Iterator[bytes]:
    t = rnd.uniform(0, 1000)
    for _ in range(n):
        t += rnd.choice([0.0, 0.0, 0.5, 3.0, 61.0])
        row = good(t)
        kind = rnd.randrange(14)
        if kind == 0:
            row[rnd.randrange(ncols)] = rnd.choice(texts + NUMBERISH)
        elif kind == 1:
            row[time_col] = good(max(0.0, t - rnd.choice([1.0, 100.0])))[time_col]  # goes backwards
        elif kind == 2:
            row = row[: rnd.randrange(ncols)] if rnd.random() < 0.5 else row + ["x"] * rnd.randint(1, 3)
        elif kind == 3:
            i = rnd.randrange(ncols)
            row[i] = '"' + row[i].replace('"', '""') + '"'  # quoted: still fine
        elif kind == 4:
            row[rnd.randrange(ncols)] = rnd.choice(['"unterminated', 'a"b', '"a"b', '"multi\nline"', '""'])
        elif kind == 5:
            yield rnd.choice(blobs)
            continue
        elif kind == 6:
            row[rnd.randrange(ncols)] = "x" * rnd.choice([140_000, 200_000])  # past csv's field limit
        elif kind == 7:
            yield ",".join(row).encode() + rnd.choice([b"\xff", b"\xe9", b"\xc3", b"\xed\xa0\x80"])
            continue
        elif kind == 8:
            yield BOM + ",".join(row).encode()
            continue
        elif kind == 9:
            yield b"\x00" * rnd.randint(1, 3) + ",".join(row).encode()
            continue
        yield ",".join(row).encode()


def _csv_file(rnd: random.Random, header: list[str], rows: Iterator[bytes], blobs: list[bytes], mode: int) -> bytes:
    """The file with its header as is (mode 0-5), after a BOM (6) or made hostile (7-)."""
    head = ",".join(header).encode()
    hostile = [
        rnd.choice(blobs),
        b'"' + b"x" * 140_000 + b'",a',
        b'"unterminated,' + head,
        b"",
        BOM,
        head.replace(b",", b"\r", 1),
        head + b"\xff",
        head.replace(b",", b",,", 1),
    ]
    head = head if mode < 6 else BOM + head if mode == 6 else hostile[mode - 7]
    return _join([head, *rows], rnd)


HEADER_MODES = st.integers(0, 14)
CSV_ROWS = 100


def test_azure_hostile_rows() -> None:
    total = 0
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "fuzz.csv"

        @FUZZ
        @given(
            rnd=st.randoms(use_true_random=True),
            texts=st.lists(fields, min_size=1, max_size=6),
            blobs=st.lists(st.binary(max_size=200), min_size=1, max_size=3),
            style=st.sampled_from(["2023", "2024"]),
            mode=HEADER_MODES,
        )
        def run(rnd: random.Random, texts: list[str], blobs: list[bytes], style: str, mode: int) -> None:
            nonlocal total
            header = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
            if rnd.random() < 0.3:
                header.append("NumImages")
            if rnd.random() < 0.2:
                header = [h.lower() for h in header]

            def good(t: float) -> list[str]:
                row = [
                    _azure_stamp(rnd, t, style),
                    str(rnd.choice([0, 1, 7, 4000, MAX_INPUT_TOKENS])),
                    str(rnd.choice([0, 1, 250, MAX_OUTPUT_TOKENS])) + rnd.choice(["", "", ".0"]),
                ]
                return row + ["0"] * (len(header) - 3)

            rows = list(_csv_rows(rnd, CSV_ROWS, len(header), good, 0, texts, blobs))
            window = {"window": (rnd.uniform(0, 50), rnd.uniform(50, 500))} if rnd.random() < 0.15 else {}
            _check(path, _csv_file(rnd, header, iter(rows), blobs, mode), "azure", rnd, **window)
            total += len(rows) + 1

        run()
    assert total >= FUZZ.max_examples * (CSV_ROWS + 1)


def test_burstgpt_hostile_rows() -> None:
    total = 0
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "fuzz.csv"

        @FUZZ
        @given(
            rnd=st.randoms(use_true_random=True),
            texts=st.lists(fields, min_size=1, max_size=6),
            blobs=st.lists(st.binary(max_size=200), min_size=1, max_size=3),
            v2=st.booleans(),
            mode=HEADER_MODES,
        )
        def run(rnd: random.Random, texts: list[str], blobs: list[bytes], v2: bool, mode: int) -> None:
            nonlocal total
            header = [
                "Timestamp",
                "Session ID",
                "Elapsed time",
                "Model",
                "Request tokens",
                "Response tokens",
                "Total tokens",
                "Log Type",
            ]
            if not v2:
                header = [h for h in header if h not in ("Session ID", "Elapsed time")]
            if rnd.random() < 0.2:
                rnd.shuffle(header)
            ti = header.index("Timestamp")

            def good(t: float) -> list[str]:
                values = {
                    "Timestamp": f"{19_440_110 + t:.1f}" if v2 else str(19_440_110 + int(t)),
                    "Session ID": rnd.choice(["", "1722ac82-0a46-4bf0-aa08-89794e7a2b3f"]),
                    "Elapsed time": "43",
                    "Model": rnd.choice(["ChatGPT", "GPT-4", "ChatGPT"]),
                    "Request tokens": str(rnd.choice([0, 1, 906, MAX_INPUT_TOKENS])),
                    "Response tokens": str(rnd.choice([0, 1, 446, MAX_OUTPUT_TOKENS])),
                    "Total tokens": "1352",
                    "Log Type": "Conversation log",
                }
                return [values[h] for h in header]

            rows = list(_csv_rows(rnd, CSV_ROWS, len(header), good, ti, texts, blobs))
            kw: dict[str, Any] = {}
            if rnd.random() < 0.3:
                kw["keep_failed"] = True
            if rnd.random() < 0.2:
                kw["models"] = {rnd.choice(["GPT-4", "ChatGPT"])}
            _check(path, _csv_file(rnd, header, iter(rows), blobs, mode), "burstgpt", rnd, **kw)
            total += len(rows) + 1

        run()
    assert total >= FUZZ.max_examples * (CSV_ROWS + 1)


# --- valid files load exactly ------------------------------------------------------------------


@FUZZ
@given(
    recs=st.lists(
        st.tuples(
            st.integers(0, 10**4),
            st.integers(1, MAX_INPUT_TOKENS),
            st.integers(1, MAX_OUTPUT_TOKENS),
            st.lists(st.integers(0, MAX_HASH_ID), max_size=6),
            st.dictionaries(st.text(max_size=8), json_values, max_size=2),
        ),
        min_size=1,
        max_size=60,
    ),
    rnd=st.randoms(use_true_random=True),
)
def test_valid_mooncake_lines_load_exactly(
    recs: list[tuple[int, int, int, list[int], dict[str, Any]]], rnd: random.Random
) -> None:
    lines, want, ts = [], [], 0
    for gap, inp, out, ids, extra in recs:
        ts += gap
        rec = {
            **{k: v for k, v in extra.items() if k not in ("timestamp", "input_length", "output_length", "hash_ids")},
            "timestamp": ts,
            "input_length": inp,
            "output_length": out,
            "hash_ids": ids,
        }
        lines.append(json.dumps(rec, ensure_ascii=rnd.random() < 0.5).encode())
        want.append(((ts - recs[0][0]) / 1000, inp, out, tuple(ids)))
        if rnd.random() < 0.1:
            lines.append(b"  ")
    data = b"".join(line + rnd.choice((b"\n", b"\r\n")) for line in lines)  # a lone CR ends no JSONL line
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "ok.jsonl"
        path.write_bytes((BOM if rnd.random() < 0.3 else b"") + data)
        got = [(r.timestamp, r.input_tokens, r.output_tokens, r.hash_ids) for r in iter_trace(path)]
    assert got == want


@FUZZ
@given(
    recs=st.lists(
        st.tuples(st.integers(0, 10**7), st.integers(0, MAX_INPUT_TOKENS), st.integers(0, MAX_OUTPUT_TOKENS)),
        min_size=1,
        max_size=60,
    ),
    rnd=st.randoms(use_true_random=True),
    style=st.sampled_from(["2023", "2024"]),
)
def test_valid_azure_rows_load_exactly(recs: list[tuple[int, int, int]], rnd: random.Random, style: str) -> None:
    rows, want, t = [], [], 0.0
    for gap, inp, out in recs:
        t += gap / 1e4
        cells = [_azure_stamp(rnd, t, style), str(inp), str(out)]
        if rnd.random() < 0.2:
            i = rnd.randrange(3)
            cells[i] = f'"{cells[i]}"'
        rows.append(",".join(cells).encode())
        want.append((max(inp, 1), max(out, 1)))
    header = b"TIMESTAMP,ContextTokens,GeneratedTokens"
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "ok.csv"
        path.write_bytes((BOM if rnd.random() < 0.3 else b"") + _join([header, *rows], rnd))
        got = list(iter_trace(path))
    assert [(r.input_tokens, r.output_tokens) for r in got] == want
    _valid(got)
