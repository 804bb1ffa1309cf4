"""Azure and BurstGPT CSV traces: parsing, validation messages, detection, window and limit
pushdown, the `trace` command on them, the shipped samples, and the replay CLI's trace flags."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest

from testbed.traces import csvutil, transforms
from testbed.traces.azure import azure_clock, write_azure
from testbed.traces.burstgpt import HEADER_V1, HEADER_V2, write_burstgpt
from testbed.traces.loader import detect_format, iter_trace, load_trace
from testbed.traces.synthetic import synth_with_prefixes
from testbed.traces.trace_command import parse_window
from testbed.traces.types import Trace, TraceError, TraceRequest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "traces" / "samples"
AZ = "TIMESTAMP,ContextTokens,GeneratedTokens"
V1 = ",".join(HEADER_V1)
V2 = ",".join(HEADER_V2)


def _csv(tmp_path: Path, name: str, lines: list[str], newline: str = "\n") -> Path:
    p = tmp_path / name
    p.write_bytes((newline.join(lines) + newline).encode())
    return p


def _err(path: Path, fmt: str = "auto", **kw: object) -> TraceError:
    with pytest.raises(TraceError) as ei:
        load_trace(path, fmt, **kw)  # type: ignore[arg-type]
    return ei.value


# --- Azure: timestamps ----------------------------------------------------------------------


def test_azure_2023_layout(tmp_path: Path) -> None:
    # The first rows of the published AzureLLMInferenceTrace_conv.csv.
    p = _csv(
        tmp_path,
        "AzureLLMInferenceTrace_conv.csv",
        [
            AZ,
            "2023-11-16 18:15:46.6805900,374,44",
            "2023-11-16 18:15:50.9951690,396,109",
            "2023-11-16 18:15:51.2224670,879,55",
            "2023-11-16 18:16:00.7401400,181,154",
        ],
    )
    assert detect_format(p) == "azure"
    t = load_trace(p)
    assert [r.request_id for r in t] == [f"AzureLLMInferenceTrace_conv-{i}" for i in (2, 3, 4, 5)]
    assert [r.timestamp for r in t] == pytest.approx([0.0, 4.314579, 4.541877, 14.05955], abs=1e-9)
    assert [(r.input_tokens, r.output_tokens, r.hash_ids) for r in t][:2] == [(374, 44, ()), (396, 109, ())]
    assert t.notes == ()


def test_azure_2024_layout(tmp_path: Path) -> None:
    p = _csv(
        tmp_path,
        "AzureLLMInferenceTrace_code_1week.csv",
        [
            AZ,
            "2024-05-10 00:00:00.009930+00:00,2162,5",
            "2024-05-10 00:00:00.996000+00:00,100,7",
            "2024-05-10 00:01:00+00:00,3,4",  # pandas leaves the fraction out when it is zero
            "2024-05-10 23:59:59.995460+00:00,4,5",
            "2024-05-11 00:00:00.000001+00:00,4,5",
        ],
    )
    t = load_trace(p)
    assert [r.timestamp for r in t] == pytest.approx([0.0, 0.98607, 59.99007, 86399.98553, 86399.990071], abs=1e-6)


@pytest.mark.parametrize(
    ("a", "b", "gap"),
    [
        ("2024-05-10 05:30:00+05:30", "2024-05-10 00:00:01+00:00", 1.0),  # offsets are applied
        ("2024-05-10T00:00:00Z", "2024-05-10T00:00:02.5Z", 2.5),
        ("2024-05-09 16:00:00-0800", "2024-05-10 00:00:03.25+0000", 3.25),
        ("2023-12-31 23:59:59.9", "2024-01-01 00:00:00.1", 0.2),
        ("2024-02-28 23:59:00", "2024-02-29 00:00:00", 60.0),  # leap day
        ("2023-11-16 18:15:46", "2023-11-16 18:15:46.123456789", 0.123456789),
    ],
)
def test_azure_timestamp_variants(tmp_path: Path, a: str, b: str, gap: float) -> None:
    t = load_trace(_csv(tmp_path, "x.csv", [AZ, f"{a},1,1", f"{b},1,1"]))
    assert t.requests[1].timestamp == pytest.approx(gap, abs=1e-9)


def test_clock_layout_change_and_precision() -> None:
    clock = azure_clock()
    base = clock("2023-11-16 18:15:46.6805900")
    assert clock("2023-11-16 18:15:46.6805901") - base == pytest.approx(1e-7, abs=1e-12)
    # A different layout mid-file (no fraction) goes through the general path and back.
    assert clock("2023-11-16 18:16:00") - base == pytest.approx(13.31941, abs=1e-9)
    assert clock("2023-11-16 18:16:00.5000000") - base == pytest.approx(13.81941, abs=1e-9)


@pytest.mark.parametrize(
    ("ts", "fragment"),
    [
        ("2023-11-16 18:15", "expected a datetime like"),
        ("", "expected a datetime like"),
        ("yesterday", "expected a datetime like"),
        ("2023-11-16 18:15:4x.1", "expected a datetime like"),
        ("2023-11-16 18:15:46.12+05", "expected a datetime like"),
        ("2023-13-16 18:15:46", "month must be in 1..12"),
        ("2023-02-30 18:15:46", "day is out of range"),
        ("2023-11-16 18:15:61", "seconds out of range"),
        ("2023-11-16 25:15:46", "hour must be in 0..23"),
        ("2023-11-16 18:15:46+24:00", "UTC offset out of range"),
        ("2023-11-16 18:15:50+00:00", "has a UTC offset and the rows before do not"),
    ],
)
def test_azure_bad_timestamp(tmp_path: Path, ts: str, fragment: str) -> None:
    p = _csv(tmp_path, "bad.csv", [AZ, "2023-11-16 18:15:46.6805900,1,1", "2023-11-16 18:15:47,1,1", f"{ts},5,5"])
    e = _err(p)
    assert str(e).startswith(f"{p}:4: field 'TIMESTAMP': "), str(e)
    assert fragment in str(e)
    assert (e.line, e.field) == (4, "TIMESTAMP")


def test_azure_naive_after_aware_rejected(tmp_path: Path) -> None:
    p = _csv(tmp_path, "mix.csv", [AZ, "2024-05-10 00:00:00+00:00,1,1", "2024-05-10 00:00:01,1,1"])
    assert "lacks a UTC offset and the rows before do" in str(_err(p))


# --- Azure: rows, columns, order, zero counts ------------------------------------------------


@pytest.mark.parametrize(
    ("row", "field", "message"),
    [
        ("2023-11-16 18:15:49,abc,1", "ContextTokens", "expected a non-negative integer, got 'abc'"),
        ("2023-11-16 18:15:49,-5,1", "ContextTokens", "got '-5'"),
        ("2023-11-16 18:15:49,12.5,1", "ContextTokens", "got '12.5'"),
        ("2023-11-16 18:15:49,12,", "GeneratedTokens", "got ''"),
        ("2023-11-16 18:15:49,12,1e3", "GeneratedTokens", "got '1e3'"),
        (
            "2023-11-16 18:15:40,12,3",
            "TIMESTAMP",
            "goes backwards: '2023-11-16 18:15:40' is earlier than the row "
            "before ('2023-11-16 18:15:47'); rows must be in arrival order",
        ),
    ],
)
def test_azure_bad_row_names_file_line_field(tmp_path: Path, row: str, field: str, message: str) -> None:
    # Line 1 header, 2-3 good, 4 blank, 5 bad: the message points at physical line 5.
    p = _csv(tmp_path, "rows.csv", [AZ, "2023-11-16 18:15:46,1,1", "2023-11-16 18:15:47,1,1", "", row])
    e = str(_err(p))
    assert e.startswith(f"{p}:5: field '{field}': ") and message in e, e


def test_azure_field_count_and_quotes(tmp_path: Path) -> None:
    p = _csv(tmp_path, "n.csv", [AZ, "2023-11-16 18:15:46,1,1", "2023-11-16 18:15:47,1"])
    assert str(_err(p)) == f"{p}:3: expected 3 fields (as in the header), got 2"
    quoted = _csv(tmp_path, "q.csv", [AZ, '"2023-11-16 18:15:46","10","2"'])
    assert load_trace(quoted).requests[0].input_tokens == 10


def test_azure_integral_float_counts_accepted(tmp_path: Path) -> None:
    # pandas writes an int column with a missing value as floats: "18.0".
    t = load_trace(_csv(tmp_path, "f.csv", [AZ, "2023-11-16 18:15:46,18.0,7.00"]))
    assert (t.requests[0].input_tokens, t.requests[0].output_tokens) == (18, 7)


@pytest.mark.parametrize(
    ("header", "missing"),
    [("TIMESTAMP,ContextTokens", "GeneratedTokens"), ("Time,ContextTokens,GeneratedTokens", "TIMESTAMP")],
)
def test_azure_missing_column(tmp_path: Path, header: str, missing: str) -> None:
    p = _csv(tmp_path, "m.csv", [header, "2023-11-16 18:15:46,1"])
    e = _err(p, "azure")
    assert str(e) == f"{p}:1: field '{missing}': missing column (header: {header.replace(',', ', ')})"


def test_azure_columns_by_name_extra_ignored_bom_crlf(tmp_path: Path) -> None:
    # The 2025 multimodal layout puts NumImages second; a BOM and CRLF line ends are tolerated.
    p = tmp_path / "mm.csv"
    p.write_bytes(
        "\ufeffTIMESTAMP,NumImages,ContextTokens,GeneratedTokens\r\n"
        "2024-10-15 00:00:00.0000000,2,900,120\r\n2024-10-15 00:00:01.0000000,0,5,6\r\n".encode()
    )
    t = load_trace(p)
    assert [(r.input_tokens, r.output_tokens, r.timestamp) for r in t] == [(900, 120, 0.0), (5, 6, 1.0)]
    assert t.requests[1].request_id == "mm-3"


def test_azure_zero_counts_raised_to_one(tmp_path: Path) -> None:
    p = _csv(tmp_path, "z.csv", [AZ, "2023-11-16 18:15:46,0,5", "2023-11-16 18:15:47,5,0", "2023-11-16 18:15:48,0,0"])
    t = load_trace(p)
    assert [(r.input_tokens, r.output_tokens) for r in t] == [(1, 5), (5, 1), (1, 1)]
    assert t.notes == ("raised 2 zero ContextTokens to 1 token", "raised 2 zero GeneratedTokens to 1 token")


def test_equal_timestamps_and_empty_file(tmp_path: Path) -> None:
    t = load_trace(_csv(tmp_path, "eq.csv", [AZ, "2023-11-16 18:15:46,1,1", "2023-11-16 18:15:46,2,2"]))
    assert [r.timestamp for r in t] == [0.0, 0.0]
    assert len(load_trace(_csv(tmp_path, "empty.csv", [AZ]))) == 0


def test_no_final_newline(tmp_path: Path) -> None:
    # The published 2023 code trace ends without one.
    p = tmp_path / "nl.csv"
    p.write_bytes(f"{AZ}\n2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 19:14:19.9280160,549,173".encode())
    assert load_trace(p).requests[-1].output_tokens == 173


# --- BurstGPT ---------------------------------------------------------------------------------


def test_burstgpt_v1_header(tmp_path: Path) -> None:
    p = _csv(
        tmp_path,
        "BurstGPT_1.csv",
        [
            V1,
            "5,ChatGPT,472,18,490,Conversation log",
            "45,ChatGPT,1087,230,1317,Conversation log",
            "118,GPT-4,417,276,693,Conversation log",
            "120,GPT-4,300,0,300,API log",
        ],
    )
    assert detect_format(p) == "burstgpt"
    t = load_trace(p)
    assert [(r.request_id, r.timestamp, r.input_tokens, r.output_tokens) for r in t] == [
        ("BurstGPT_1-2", 0.0, 472, 18),
        ("BurstGPT_1-3", 40.0, 1087, 230),
        ("BurstGPT_1-4", 113.0, 417, 276),
    ]
    assert t.notes == ("skipped 1 failed request (Response tokens 0; keep them with keep_failed=True / --keep-failed)",)


def test_burstgpt_v2_header(tmp_path: Path) -> None:
    # The first rows of BurstGPT_3.csv (release v2.0), then a failed API call without a session.
    p = _csv(
        tmp_path,
        "BurstGPT_3.csv",
        [
            V2,
            "19440110.0,1722ac82-0a46-4bf0-aa08-89794e7a2b3f,43,GPT-4,906,446,1352,Conversation log",
            "19440161.0,d5983bf9-4b48-497b-892b-a58995247443,2,ChatGPT,36,29,65,Conversation log",
            "19440192.0,,8,ChatGPT,1779,0,1779,API log",
            "19440254.5,8b74c7d8-1643-4bba-8c69-91cb4548c506,3,ChatGPT,0,178,178,Conversation log",
        ],
    )
    t = load_trace(p)
    assert [(r.timestamp, r.input_tokens, r.output_tokens) for r in t] == [
        (0.0, 906, 446),
        (51.0, 36, 29),
        (144.5, 1, 178),
    ]
    assert t.notes == (
        "skipped 1 failed request (Response tokens 0; keep them with keep_failed=True / --keep-failed)",
        "raised 1 zero Request tokens to 1 token",
    )
    kept = load_trace(p, keep_failed=True)
    assert [(r.timestamp, r.output_tokens) for r in kept][2] == (82.0, 1)
    assert kept.notes[0] == "kept 1 failed request (Response tokens 0) with 1 output token"


def test_burstgpt_first_row_failed_rebases_to_first_kept(tmp_path: Path) -> None:
    p = _csv(
        tmp_path, "f.csv", [V1, "10,ChatGPT,5,0,5,API log", "12,ChatGPT,5,6,11,API log", "15,GPT-4,5,6,11,API log"]
    )
    assert [r.timestamp for r in load_trace(p)] == [0.0, 3.0]
    # The window is on the file's axis (0 = its first row), whatever is skipped.
    assert [r.request_id for r in load_trace(p, window=(2.5, 10))] == ["f-4"]


def test_burstgpt_model_filter(tmp_path: Path) -> None:
    p = _csv(tmp_path, "m.csv", [V1, "1,ChatGPT,5,5,10,API log", "2,GPT-4,6,6,12,API log", "3,GPT-4,7,0,7,API log"])
    t = load_trace(p, models={"GPT-4"})
    assert [r.input_tokens for r in t] == [6]
    assert t.notes == (
        "skipped 1 failed request (Response tokens 0; keep them with keep_failed=True / --keep-failed)",
        "skipped 1 request of other models",
    )
    assert "models(GPT-4)" in t.source
    assert len(load_trace(p, models={"Claude"})) == 0
    az = _csv(tmp_path, "a.csv", [AZ, "2023-11-16 18:15:46,1,1"])
    assert "model filter needs a format with a Model column" in str(_err(az, models={"GPT-4"}))
    no_model = _csv(tmp_path, "nm.csv", ["Timestamp,Request tokens,Response tokens", "1,2,3"])
    assert len(load_trace(no_model)) == 1
    assert "field 'Model': missing column" in str(_err(no_model, models={"GPT-4"}))


@pytest.mark.parametrize(
    ("row", "field", "message"),
    [
        ("x,ChatGPT,5,5,10,API log", "Timestamp", "expected a non-negative number of seconds, got 'x'"),
        ("-3,ChatGPT,5,5,10,API log", "Timestamp", "got '-3'"),
        ("nan,ChatGPT,5,5,10,API log", "Timestamp", "got 'nan'"),
        ("7,ChatGPT,five,5,10,API log", "Request tokens", "expected a non-negative integer, got 'five'"),
        ("7,ChatGPT,5,,10,API log", "Response tokens", "got ''"),
        ("1,ChatGPT,5,5,10,API log", "Timestamp", "goes backwards: '1' is earlier than the row before ('5')"),
    ],
)
def test_burstgpt_bad_row(tmp_path: Path, row: str, field: str, message: str) -> None:
    p = _csv(tmp_path, "b.csv", [V1, "5,ChatGPT,5,5,10,API log", row])
    e = _err(p)
    assert str(e).startswith(f"{p}:3: field '{field}': ") and message in str(e), str(e)


def test_burstgpt_columns_by_name_any_order(tmp_path: Path) -> None:
    p = _csv(tmp_path, "o.csv", ["Log Type, response tokens ,Request Tokens,TIMESTAMP", "API log,7,8,3.5"])
    assert detect_format(p) == "burstgpt"  # names match case- and space-insensitively
    r = load_trace(p).requests[0]
    assert (r.input_tokens, r.output_tokens) == (8, 7)


# --- Detection --------------------------------------------------------------------------------


def test_detection(tmp_path: Path) -> None:
    assert detect_format(_csv(tmp_path, "a.CSV", [AZ])) == "azure"
    assert detect_format(_csv(tmp_path, "b.csv", [V2])) == "burstgpt"
    assert detect_format(tmp_path / "x.jsonl") == "mooncake"
    e = _err(_csv(tmp_path, "c.csv", ["time,prompt,completion", "1,2,3"]))
    assert str(e).startswith(
        f"{tmp_path / 'c.csv'}:1: unsupported format: the header (3 fields, none of them a column it names)"
    )
    # An explicit format wins over the suffix.
    assert len(load_trace(_csv(tmp_path, "az.txt", [AZ, "2023-11-16 18:15:46,1,1"]), "azure")) == 1
    assert "cannot open" in str(_err(tmp_path / "missing.csv", "azure"))


# --- Window and limit pushdown -----------------------------------------------------------------


def _azure_file(tmp_path: Path, n: int, style: str = "2024", name: str = "big.csv") -> Path:
    t = synth_with_prefixes(n, 2.0, seed=3)
    p = tmp_path / name
    write_azure(p, t, style)
    return p


@pytest.fixture
def small_bisect(monkeypatch: pytest.MonkeyPatch) -> None:
    # Bisect even small files, and down to a few rows, so the tests cover it.
    monkeypatch.setattr(csvutil, "BISECT_MIN_BYTES", 256)
    monkeypatch.setattr(csvutil, "_BISECT_STOP", 64)


@pytest.mark.usefixtures("small_bisect")
@pytest.mark.parametrize("style", ["2023", "2024"])
def test_window_pushdown_equals_transform(tmp_path: Path, style: str) -> None:
    p = _azure_file(tmp_path, 1500, style)
    full = load_trace(p)
    last = full.requests[-1].timestamp
    for start, end in [
        (0.0, 10.0),
        (3.0, 50.0),
        (100.0, 100.5),
        (200.0, math.inf),
        (last, math.inf),
        (last + 1, math.inf),
        (full.requests[700].timestamp, full.requests[900].timestamp),
    ]:
        want = transforms.window(full, start, end)
        got = load_trace(p, window=(start, end))
        assert got.requests == want.requests, (start, end)
        assert transforms.head(want, 7).requests == load_trace(p, window=(start, end), limit=7).requests
    assert load_trace(p, limit=5).requests == transforms.head(full, 5).requests
    assert load_trace(p, limit=0).requests == []


@pytest.mark.usefixtures("small_bisect")
def test_window_pushdown_ties_crlf_and_burstgpt_filters(tmp_path: Path) -> None:
    # Runs of equal whole-second times (v1 layout) straddle the probes; CRLF line ends.
    t = synth_with_prefixes(1200, 6.0, seed=5)
    p = tmp_path / "ties.csv"
    write_burstgpt(p, t, "v1", seed=4, failed_share=0.1)
    p.write_bytes(p.read_bytes().replace(b"\n", b"\r\n"))
    # The window's axis starts at the file's first row: the same as the loaded trace's if it is kept.
    assert load_trace(p, keep_failed=True).requests[0].output_tokens > 1
    for keep in (False, True):
        full = load_trace(p, keep_failed=keep)
        for start, end in [(10.0, 20.0), (37.0, 38.0), (55.0, 120.0), (150.0, math.inf)]:
            got = load_trace(p, window=(start, end), keep_failed=keep)
            assert got.requests == transforms.window(full, start, end).requests, (keep, start, end)
            assert got.requests and got.requests[0].timestamp == 0.0


@pytest.mark.usefixtures("small_bisect")
def test_window_does_not_read_rows_before_it_or_limit_after(tmp_path: Path) -> None:
    p = _azure_file(tmp_path, 1200)
    lines = p.read_text().splitlines()
    lines[3] = "not a row,1,1"  # line 4
    lines[-10] = "2024-05-10 00:00:00+00:00,x,1"
    (tmp_path / "b").mkdir()
    bad = _csv(tmp_path / "b", p.name, lines)  # same stem, so the same request ids
    assert _err(bad).line == 4
    mid = load_trace(p).requests[600].timestamp
    got = load_trace(bad, window=(mid, mid + 30))
    assert got.requests == transforms.window(load_trace(p), mid, mid + 30).requests
    assert _err(bad, window=(0.0, mid)).line == 4  # a window from 0 reads from the first row
    assert _err(bad, window=(mid, math.inf)).line == len(lines) - 9
    # A limit stops reading: the bad row after it is never seen (with no window, line 4 is read).
    assert len(load_trace(bad, window=(mid, math.inf), limit=20)) == 20


def test_window_without_bisect_on_small_file(tmp_path: Path) -> None:
    p = _azure_file(tmp_path, 300)
    full = load_trace(p)
    assert load_trace(p, window=(20.0, 40.0)).requests == transforms.window(full, 20.0, 40.0).requests


def test_window_and_limit_on_mooncake() -> None:
    sample = SAMPLES / "mooncake-sample.jsonl"
    full = load_trace(sample)
    got = load_trace(sample, window=(30.0, 90.0), limit=10)
    assert got.requests == transforms.head(transforms.window(full, 30.0, 90.0), 10).requests
    assert got.source.endswith("| window(30, 90) | head(10)")


def test_window_argument_checks(tmp_path: Path) -> None:
    p = _azure_file(tmp_path, 10)
    with pytest.raises(ValueError, match="start <= end"):
        load_trace(p, window=(5.0, 1.0))
    with pytest.raises(ValueError, match="limit must be >= 0"):
        load_trace(p, limit=-1)


def test_iter_trace_streams(tmp_path: Path) -> None:
    p = _azure_file(tmp_path, 200)
    it = iter_trace(p)
    first = next(it)
    assert isinstance(first, TraceRequest) and first.timestamp == 0.0
    assert sum(1 for _ in it) == 199


# --- Writers, samples, the `trace` command -------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "variant"), [("azure", "2023"), ("azure", "2024"), ("burstgpt", "v1"), ("burstgpt", "v2")]
)
def test_writers_round_trip(tmp_path: Path, fmt: str, variant: str) -> None:
    t = synth_with_prefixes(80, 3.0, seed=9)
    p = tmp_path / f"rt-{variant}.csv"
    if fmt == "azure":
        write_azure(p, t, variant)
    else:
        write_burstgpt(p, t, variant)
    back = load_trace(p)
    assert [(r.input_tokens, r.output_tokens) for r in back] == [(r.input_tokens, r.output_tokens) for r in t]
    tol = 1.0 if variant == "v1" else 0.06  # v1 keeps whole seconds, v2 tenths
    assert all(abs(a.timestamp - b.timestamp) <= tol for a, b in zip(back, t))
    assert all(r.hash_ids == () for r in back)


def _run(argv: list[str]) -> int:
    from testbed.traces import trace_command as command

    p = argparse.ArgumentParser(prog="testbed")
    command.register(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    rc: int = args.func(args)
    return rc


def test_samples_reproducible(tmp_path: Path) -> None:
    for name, argv in [
        (
            "azure-sample.csv",
            ["--format", "azure", "--variant", "2024", "--requests", "300", "--rate", "2", "--seed", "7"],
        ),
        (
            "burstgpt-sample.csv",
            [
                "--format",
                "burstgpt",
                "--variant",
                "v2",
                "--requests",
                "300",
                "--rate",
                "2",
                "--seed",
                "7",
                "--failed-share",
                "0.05",
            ],
        ),
        (
            "mooncake-sample.jsonl",
            ["--format", "mooncake", "--requests", "300", "--rate", "1.0", "--seed", "7", "--prefix-reuse"],
        ),
        (
            "mooncake-agent-sample.jsonl",
            ["--format", "mooncake", "--requests", "400", "--rate", "1.0", "--seed", "11", "--prefix-reuse", "agent"],
        ),
    ]:
        out = tmp_path / name
        assert _run(["trace", "synth", *argv, "--out", str(out)]) == 0
        assert out.read_bytes() == (SAMPLES / name).read_bytes(), name


def test_command_on_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    az = tmp_path / "a.csv"
    assert (
        _run(
            [
                "trace",
                "synth",
                "--format",
                "azure",
                "--variant",
                "2023",
                "--requests",
                "40",
                "--rate",
                "2",
                "--out",
                str(az),
            ]
        )
        == 0
    )
    assert az.read_text().splitlines()[1].startswith("2023-11-16 18:15:46.0000000,")
    bg = tmp_path / "b.csv"
    assert (
        _run(
            [
                "trace",
                "synth",
                "--format",
                "burstgpt",
                "--variant",
                "v1",
                "--requests",
                "200",
                "--rate",
                "2",
                "--failed-share",
                "0.2",
                "--out",
                str(bg),
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert _run(["trace", "info", str(bg), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert 120 < info["requests"] < 200 and info["blocks"] == 0
    assert info["notes"][0].startswith("skipped ") and "failed" in info["notes"][0]
    assert _run(["trace", "info", str(bg), "--keep-failed", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 200
    assert _run(["trace", "info", str(az), "--window", "5:10"]) == 0
    out = capsys.readouterr().out
    assert "window(5, 10)" in out and "no prefix block hashes" in out
    assert _run(["trace", "info", str(bg), "--model", "GPT-4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] < 60
    assert _run(["trace", "validate", str(bg)]) == 0
    assert "failed" in capsys.readouterr().out
    lines = az.read_text().splitlines()
    lines[7] = lines[7].replace(",", ",x", 1)
    bad = _csv(tmp_path, "bad.csv", lines)
    assert _run(["trace", "validate", str(bad)]) == 2
    assert f"{bad}:8: field 'ContextTokens'" in capsys.readouterr().err
    assert (
        _run(
            [
                "trace",
                "synth",
                "--format",
                "azure",
                "--prefix-reuse",
                "--requests",
                "5",
                "--rate",
                "1",
                "--out",
                str(tmp_path / "x.csv"),
            ]
        )
        == 2
    )
    assert (
        _run(
            [
                "trace",
                "synth",
                "--format",
                "azure",
                "--variant",
                "v2",
                "--requests",
                "5",
                "--rate",
                "1",
                "--out",
                str(tmp_path / "x.csv"),
            ]
        )
        == 2
    )


# --- The --window syntax and the replay CLI ------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "window"),
    [
        ("3600:7200", (3600.0, 7200.0)),
        ("1h:2h", (3600.0, 7200.0)),
        ("2d:", (172800.0, math.inf)),
        (":10m", (0.0, 600.0)),
        (" 1.5h : 90m5 ", None),
        ("0.5:1.25s", (0.5, 1.25)),
        (".5:1", (0.5, 1.0)),
    ],
)
def test_parse_window(text: str, window: tuple[float, float] | None) -> None:
    if window is None:
        with pytest.raises(ValueError, match="bad time"):
            parse_window(text)
    else:
        assert parse_window(text) == window


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("3600", "expected START:END"),
        ("a:b", "bad time 'a'"),
        ("-5:10", "bad time '-5'"),
        ("10:5", "END must be after START"),
        ("5:5", "END must be after START"),
        ("inf:", "bad time"),
        ("1x:2", "bad time '1x'"),
    ],
)
def test_parse_window_errors(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_window(text)


def _replay_args(argv: list[str]) -> argparse.Namespace:
    from testbed.cli import build_parser

    return build_parser().parse_args(["replay", "--scenario", "paper-prfaas", *argv])


def test_cli_window_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert _replay_args(["--trace", "x.csv", "--window", "1h:2h"]).window == (3600.0, 7200.0)
    with pytest.raises(SystemExit) as ei:
        _replay_args(["--trace", "x.csv", "--window", "1h-2h"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "argument --window" in err and "expected START:END" in err
    with pytest.raises(SystemExit):
        _replay_args(["--trace", "x.csv", "--format", "parquet"])


def test_cli_trace_for_order(tmp_path: Path) -> None:
    from testbed.run.run_args import RunArgs, run_overrides, trace_for

    def _overrides(ns: argparse.Namespace) -> dict[str, Any]:
        return run_overrides(RunArgs.from_args(ns))

    def _trace_for(sc: None, ns: argparse.Namespace) -> Trace:
        return trace_for(sc, RunArgs.from_args(ns))

    p = _azure_file(tmp_path, 400)
    full = load_trace(p)
    args = _replay_args(["--trace", str(p), "--window", "20:120", "--requests", "30", "--rate", "4"])
    _overrides(args)
    tr: Trace = _trace_for(None, args)
    ref = transforms.rescale_rate(transforms.head(transforms.window(full, 20, 120), 30), 4.0)
    assert tr.requests == ref.requests
    assert "window(20, 120) | head(30) | rescale_rate(4)" in tr.source

    args = _replay_args(["--trace", str(p), "--window", "20:120", "--sample", "25", "--seed", "3", "--requests", "10"])
    tr = _trace_for(None, args)
    assert tr.requests == transforms.head(transforms.sample(transforms.window(full, 20, 120), 25, 3), 10).requests

    with pytest.raises(TraceError, match="--sample 9999: the trace has"):
        _trace_for(None, _replay_args(["--trace", str(p), "--window", "20:120", "--sample", "9999"]))
    with pytest.raises(TraceError, match="no requests to replay in the window"):
        _trace_for(None, _replay_args(["--trace", str(p), "--window", "1d:"]))
    with pytest.raises(TraceError, match="only with --trace"):
        _overrides(_replay_args(["--window", "0:10"]))
    with pytest.raises(TraceError, match="seeds --sample"):
        _overrides(_replay_args(["--trace", str(p), "--seed", "4"]))
    assert _overrides(_replay_args(["--seed", "4", "--requests", "9"]))["workload"] == {"requests": 9, "seed": 4}
