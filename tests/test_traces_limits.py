"""Trace values that cannot be replayed or represented: every loader rejects them with a
TraceError naming file, line and field; `trace validate` lists every bad line (up to a cap) and
exits 2; nothing raises anything else."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from testbed.core.schema.limits import MAX_HASH_ID, MAX_INPUT_TOKENS, MAX_OUTPUT_TOKENS, MAX_TIMESTAMP_MS
from testbed.live import openai_api
from testbed.live.replayer import request_body
from testbed.traces import trace_command as command
from testbed.traces.loader import iter_trace, load_trace
from testbed.traces.types import TraceError, TraceRequest

pytestmark = pytest.mark.pure

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
BURST_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"


def _moon(ts: object = 1000, inp: object = 600, out: object = 10, ids: object = (1, 2)) -> str:
    ids = list(ids) if isinstance(ids, tuple) else ids
    return json.dumps({"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids})


def _file(tmp_path: Path, name: str, lines: list[str]) -> Path:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def _cli(argv: list[str]) -> tuple[int, str, str]:
    p = argparse.ArgumentParser()
    command.register(p.add_subparsers(dest="command"))
    args = p.parse_args(argv)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc: int = args.func(args)
    return rc, out.getvalue(), err.getvalue()


def _rejects(p: Path, line: int, field: str | None, fragment: str) -> None:
    """The loader, `trace info` and `trace validate` all refuse `p` with the same message."""
    with pytest.raises(TraceError) as ei:
        load_trace(p)
    e = ei.value
    assert (e.path, e.line, e.field) == (str(p), line, field), str(e)
    assert str(e).startswith(f"{p}:{line}: " + (f"field {field!r}: " if field else "")), str(e)
    assert fragment in str(e), str(e)
    rc, _, err = _cli(["trace", "info", str(p)])
    assert rc == 2 and str(e) in err
    rc, out, err = _cli(["trace", "validate", str(p)])
    assert rc == 2 and out == "" and str(e) in err


# --- Finding 1: integers too big to represent -------------------------------------------------


@pytest.mark.parametrize(
    ("line", "field", "fragment"),
    [
        (_moon(inp=2**63), "input_length", f"got {2**63}"),
        (_moon(out=2**64 + 5), "output_length", f"got {2**64 + 5}"),
        (_moon(inp=10**30), "input_length", "1,048,576"),
        (_moon(ts=2**70), "timestamp", f"got {2**70}"),
        (_moon(ts=10**400), "timestamp", "got 1000000"),  # int/float division would overflow
        (_moon(ids=(1, 2**63)), "hash_ids", "element 1"),
        (_moon(ids=(2**64,)), "hash_ids", "63 bits"),
    ],
)
def test_mooncake_huge_integers(tmp_path: Path, line: str, field: str, fragment: str) -> None:
    _rejects(_file(tmp_path, "big.jsonl", [_moon(), line, _moon()]), 2, field, fragment)


def test_mooncake_largest_representable_values_load(tmp_path: Path) -> None:
    p = _file(
        tmp_path,
        "edge.jsonl",
        [_moon(ts=0), _moon(ts=MAX_TIMESTAMP_MS, inp=MAX_INPUT_TOKENS, out=MAX_OUTPUT_TOKENS, ids=(0, MAX_HASH_ID))],
    )
    r = load_trace(p).requests[1]
    assert (r.input_tokens, r.output_tokens, r.hash_ids) == (MAX_INPUT_TOKENS, MAX_OUTPUT_TOKENS, (0, MAX_HASH_ID))
    assert r.timestamp == MAX_TIMESTAMP_MS / 1000
    assert _cli(["trace", "info", str(p), "--json"])[0] == 0
    assert _cli(["trace", "validate", str(p)])[0] == 0


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"timestamp": 1' + "0" * 5000 + ', "input_length": 1, "output_length": 1, "hash_ids": []}', "too long"),
        ("[" * 100_000, "nested too deeply"),
        ('{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [' + "[" * 50_000, "nested"),
    ],
)
def test_mooncake_json_the_parser_cannot_hold(tmp_path: Path, text: str, fragment: str) -> None:
    _rejects(_file(tmp_path, "deep.jsonl", [_moon(), text]), 2, None, fragment)


@pytest.mark.parametrize(
    ("header", "row", "field", "fragment"),
    [
        (AZURE_HEADER, "2024-05-10 00:00:01+00:00," + "9" * 30 + ",5", "ContextTokens", "1,048,576"),
        (AZURE_HEADER, "2024-05-10 00:00:01+00:00,5," + "9" * 5000, "GeneratedTokens", "at most"),
        (AZURE_HEADER, f"2024-05-10 00:00:01+00:00,5,{2**63}", "GeneratedTokens", "at most"),
        (BURST_HEADER, "2,ChatGPT," + "9" * 5000 + ",3,3,API log", "Request tokens", "at most"),
        (BURST_HEADER, f"2,ChatGPT,3,{2**64},3,API log", "Response tokens", "at most"),
        (BURST_HEADER, "1" + "0" * 300 + ",ChatGPT,3,3,3,API log", "Timestamp", "at most"),
        (BURST_HEADER, "1" + "0" * 400 + ",ChatGPT,3,3,3,API log", "Timestamp", "at most"),
    ],
)
def test_csv_huge_numbers(tmp_path: Path, header: str, row: str, field: str, fragment: str) -> None:
    first = "2024-05-10 00:00:00+00:00,5,5" if header == AZURE_HEADER else "1,ChatGPT,3,3,6,API log"
    _rejects(_file(tmp_path, "big.csv", [header, first, row]), 3, field, fragment)


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        ("TIMESTAMP,Context\rTokens,GeneratedTokens", "unsupported format: the header (TIMESTAMP, Context)"),
        ('"' + "x" * 200_000 + '",a', "bad CSV"),
    ],
)
def test_csv_header_the_reader_refuses(tmp_path: Path, header: str, fragment: str) -> None:
    p = tmp_path / "h.csv"
    p.write_text(header + "\n1,2,3\n", encoding="utf-8")
    _rejects(p, 1, None, fragment)


def test_csv_with_cr_line_ends_loads(tmp_path: Path) -> None:
    p = tmp_path / "mac.csv"
    p.write_bytes(
        b"TIMESTAMP,ContextTokens,GeneratedTokens\r2024-05-10 00:00:00+00:00,5,6\r2024-05-10 00:00:01+00:00,7,8\r"
    )
    t = load_trace(p)
    assert [(r.request_id, r.input_tokens, r.output_tokens) for r in t] == [("mac-2", 5, 6), ("mac-3", 7, 8)]


def test_csv_reader_error_names_its_own_line(tmp_path: Path) -> None:
    p = _file(
        tmp_path,
        "f.csv",
        [BURST_HEADER, "1,ChatGPT,3,3,6,API log", "2,ChatGPT," + "9" * 200_000 + ",3,3,x", "3,ChatGPT,3,3,6,API log"],
    )
    _rejects(p, 3, None, "field larger than field limit")


# --- Finding 3: values the router would refuse ----------------------------------------------------


@pytest.mark.parametrize(
    ("line", "field", "fragment"),
    [
        (_moon(inp=0), "input_length", "got 0"),
        (_moon(out=0), "output_length", "got 0"),
        (_moon(inp=MAX_INPUT_TOKENS + 1), "input_length", f"got {MAX_INPUT_TOKENS + 1}"),
        (_moon(out=MAX_OUTPUT_TOKENS + 1), "output_length", f"got {MAX_OUTPUT_TOKENS + 1}"),
        (_moon(ts=1e308), "timestamp", "got 1e+308"),
        (_moon(ts=MAX_TIMESTAMP_MS + 2048), "timestamp", "milliseconds"),
        ('{"timestamp": Infinity, "input_length": 1, "output_length": 1, "hash_ids": []}', "timestamp", "Infinity"),
        ('{"timestamp": -Infinity, "input_length": 1, "output_length": 1, "hash_ids": []}', "timestamp", "Infinity"),
        ('{"timestamp": NaN, "input_length": 1, "output_length": 1, "hash_ids": []}', "timestamp", "NaN"),
        (_moon(ts=-0.5), "timestamp", "got -0.5"),
        (_moon(ts=999.5), "timestamp", "goes backwards"),
    ],
)
def test_mooncake_unreplayable_values(tmp_path: Path, line: str, field: str, fragment: str) -> None:
    _rejects(_file(tmp_path, "z.jsonl", [_moon(), line]), 2, field, fragment)


@pytest.mark.parametrize(
    ("header", "row", "field"),
    [
        (AZURE_HEADER, f"2024-05-10 00:00:01+00:00,{MAX_INPUT_TOKENS + 1},5", "ContextTokens"),
        (AZURE_HEADER, f"2024-05-10 00:00:01+00:00,5,{MAX_OUTPUT_TOKENS + 1}", "GeneratedTokens"),
        (AZURE_HEADER, f"2024-05-10 00:00:01+00:00,5,{MAX_OUTPUT_TOKENS + 1}.0", "GeneratedTokens"),
        (BURST_HEADER, f"2,ChatGPT,{MAX_INPUT_TOKENS + 1},3,3,API log", "Request tokens"),
        (BURST_HEADER, f"2,ChatGPT,3,{MAX_OUTPUT_TOKENS + 1},3,API log", "Response tokens"),
        (BURST_HEADER, f"{MAX_TIMESTAMP_MS},ChatGPT,3,3,6,API log", "Timestamp"),
    ],
)
def test_csv_counts_above_the_router_limit(tmp_path: Path, header: str, row: str, field: str) -> None:
    first = "2024-05-10 00:00:00+00:00,5,5" if header == AZURE_HEADER else "1,ChatGPT,3,3,6,API log"
    _rejects(_file(tmp_path, "big.csv", [header, first, row]), 3, field, "at most")


def test_csv_limits_are_per_column(tmp_path: Path) -> None:
    # A count accepted (and cached) in one column is still checked against the other's limit.
    p = _file(
        tmp_path,
        "a.csv",
        [
            AZURE_HEADER,
            f"2024-05-10 00:00:00+00:00,{MAX_INPUT_TOKENS},{MAX_OUTPUT_TOKENS}",
            f"2024-05-10 00:00:01+00:00,{MAX_OUTPUT_TOKENS},{MAX_INPUT_TOKENS}",
        ],
    )
    assert [(r.input_tokens, r.output_tokens) for r in load_trace(p)] == [(MAX_INPUT_TOKENS, MAX_OUTPUT_TOKENS)] * 2


@pytest.mark.parametrize(
    ("inp", "out", "ok"),
    [
        (1, 1, True),
        (MAX_INPUT_TOKENS, MAX_OUTPUT_TOKENS, True),
        (0, 1, False),
        (1, 0, False),
        (1, MAX_OUTPUT_TOKENS + 1, False),
    ],
)
def test_validation_matches_what_the_router_parses(tmp_path: Path, inp: int, out: int, ok: bool) -> None:
    p = _file(tmp_path, "r.jsonl", [_moon(inp=inp, out=out)])
    loaded = _cli(["trace", "validate", str(p)])[0] == 0
    body = request_body(TraceRequest("r-1", 0.0, inp, out, (1, 2)), "m")
    try:
        parsed = openai_api.parse(body, "completions")
    except openai_api.RequestError:
        accepted = False
    else:
        accepted = (parsed.input_tokens, parsed.output_tokens) == (inp, out)
    assert loaded is accepted is ok
    assert openai_api.MAX_TOKENS_LIMIT == MAX_OUTPUT_TOKENS


# --- validate reports every bad line, up to a cap ---------------------------------------------


def test_validate_lists_bad_lines_up_to_a_cap(tmp_path: Path) -> None:
    lines = []
    bad_lines = []
    for i in range(1, 101):
        if i % 4 == 0:
            lines.append(_moon(ts=1000 + i, out=0))
            bad_lines.append(i)
        elif i == 50:
            lines.append("not json")
            bad_lines.append(i)
        else:
            lines.append(_moon(ts=1000 + i))
    p = _file(tmp_path, "many.jsonl", lines)
    rc, out, err = _cli(["trace", "validate", str(p)])
    assert rc == 2 and out == ""
    shown = [int(m[1]) for m in re.finditer(rf"^{re.escape(str(p))}:(\d+): ", err, re.M)]
    assert shown == bad_lines[: command.VALIDATE_SHOWN]
    assert f"{p}: field 'output_length'" not in err  # every line carries its number
    assert f"{len(bad_lines)} bad lines (the first {command.VALIDATE_SHOWN} shown)" in err
    assert f"; {100 - len(bad_lines)} good requests" in err


def test_validate_keeps_order_against_the_last_good_line(tmp_path: Path) -> None:
    # A bad line's timestamp does not count: line 3 is compared with line 1, not line 2.
    p = _file(tmp_path, "o.jsonl", [_moon(ts=1000), _moon(ts=5000, inp=0), _moon(ts=2000), _moon(ts=1500)])
    rc, _, err = _cli(["trace", "validate", str(p)])
    assert rc == 2
    assert f"{p}:2: field 'input_length'" in err
    assert f"{p}:4: field 'timestamp': goes backwards: 1500 ms after 2000 ms on line 3" in err
    assert f"{p}:3:" not in err
    assert "2 bad lines" in err


def test_validate_csv_lists_every_bad_row(tmp_path: Path) -> None:
    rows = [
        AZURE_HEADER,
        "2024-05-10 00:00:02+00:00,5,5",
        "2024-05-10 00:00:02+00:00,x,5",
        "2024-05-10 00:00:02+00:00,5",
        "2024-05-10 00:00:01+00:00,5,5",
        "2024-05-10 00:00:03+00:00,5,5",
    ]
    p = tmp_path / "a.csv"
    p.write_bytes(
        ("\n".join(rows) + "\n").encode() + b"2024-05-10 00:00:04+00:00,\xff,5\n2024-05-10 00:00:05+00:00,5,5\n"
    )
    rc, out, err = _cli(["trace", "validate", str(p)])
    assert rc == 2 and out == ""
    assert f"{p}:3: field 'ContextTokens'" in err
    assert f"{p}:4: expected 3 fields" in err
    assert f"{p}:5: field 'TIMESTAMP': goes backwards" in err
    assert f"{p}:7: not UTF-8 text (invalid start byte at byte 26)" in err
    assert "4 bad lines; 3 good requests" in err


def test_strict_load_still_stops_at_the_first_bad_line(tmp_path: Path) -> None:
    p = _file(tmp_path, "s.jsonl", [_moon(), _moon(out=0), "junk"])
    seen: list[TraceError] = []
    assert len(list(iter_trace(p, on_error=seen.append))) == 1
    assert [e.line for e in seen] == [2, 3]
    with pytest.raises(TraceError, match=r"s\.jsonl:2: "):
        list(iter_trace(p))


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_csv_bytes_not_utf8_deep_in_a_file(tmp_path: Path, eol: bytes) -> None:
    # Past the text reader's first chunks, so rows before the bad bytes were already read.
    rows = [f"{i},ChatGPT,{i % 50 + 1},7,8,API log".encode() for i in range(3000)]
    rows[1500] = b"1500,Chat\xe9GPT,3,7,8,API log"  # Latin-1 in a column the loader ignores
    rows[2200] = b"2200,ChatGPT,3\xff,7,8,API log"
    p = tmp_path / "b.csv"
    p.write_bytes(eol.join([BURST_HEADER.encode(), *rows]) + eol)
    seen: list[TraceError] = []
    got = list(iter_trace(p, on_error=seen.append))
    assert [(e.line, e.field) for e in seen] == [(1502, None), (2202, None)]
    assert str(seen[0]) == f"{p}:1502: not UTF-8 text (invalid continuation byte at byte 9)"
    assert "invalid start byte at byte 14" in str(seen[1])
    want = [i for i in range(3000) if i not in (1500, 2200)]
    assert [r.request_id for r in got] == [f"b-{i + 2}" for i in want]
    assert [r.input_tokens for r in got] == [i % 50 + 1 for i in want]
    with pytest.raises(TraceError) as ei:
        list(iter_trace(p))
    assert str(ei.value) == str(seen[0])
