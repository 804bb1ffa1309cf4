"""Traces: Mooncake loading and validation, generators, transforms, the `trace` command."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest

from testbed.core.schema.scenario import LengthDist, WorkloadSpec
from testbed.traces import trace_command as command
from testbed.traces import transforms
from testbed.traces.loader import load_trace, trace_from_workload
from testbed.traces.mooncake import load_mooncake, write_mooncake
from testbed.traces.synthetic import synth_with_prefixes, synthetic_trace, truncated_lognormal_mean
from testbed.traces.trace_command import prefix_reuse_share
from testbed.traces.types import Trace, TraceError, TraceRequest

pytestmark = pytest.mark.pure

SAMPLE = Path(__file__).resolve().parent.parent / "traces" / "samples" / "mooncake-sample.jsonl"
GOOD = '{"timestamp": 1000, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}'


def _write(tmp_path: Path, name: str, lines: list[str]) -> Path:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def _trace(times: list[float], inputs: list[int] | None = None) -> Trace:
    inputs = inputs or [1000] * len(times)
    reqs = [TraceRequest(f"r{i}", t, inputs[i], 100 + i) for i, t in enumerate(times)]
    return Trace(reqs, source="test")


# --- Mooncake ------------------------------------------------------------------------------


def test_sample_loads() -> None:
    t = load_trace(SAMPLE)
    assert len(t) == 300
    assert t.block_tokens == 512
    assert t.requests[0].timestamp == 0.0
    assert t.requests[0].request_id == "mooncake-sample-1"
    assert len({r.request_id for r in t}) == 300
    assert all(len(r.hash_ids) == math.ceil(r.input_tokens / 512) for r in t)
    assert all(1000 <= r.input_tokens <= 60000 and 50 <= r.output_tokens <= 1000 for r in t)
    assert 0.5 < t.rate < 2.0
    share, blocks = prefix_reuse_share(t)
    assert blocks > 0 and 0.3 < share < 0.9


def test_error_message_shape(tmp_path: Path) -> None:
    lines = [GOOD] * 16 + ['{"timestamp": 1000, "input_length": "abc", "output_length": 1, "hash_ids": []}']
    p = _write(tmp_path, "x.jsonl", lines)
    with pytest.raises(TraceError) as ei:
        load_mooncake(p)
    assert str(ei.value) == f"{p}:17: field 'input_length': expected a non-negative integer, got \"abc\""
    assert (ei.value.line, ei.value.field, ei.value.path) == (17, "input_length", str(p))


def _rec(**over: object) -> str:
    rec: dict[str, object] = {"timestamp": 2000, "input_length": 700, "output_length": 5, "hash_ids": [1, 3]}
    for k, v in over.items():
        if v is _DROP:
            del rec[k]
        else:
            rec[k] = v
    return json.dumps(rec)


_DROP = object()


@pytest.mark.parametrize(
    ("bad", "field", "fragment"),
    [
        ('{"timestamp": 2000, "input_length": ', None, "invalid JSON"),
        # A whole object and then more: what json.loads says of the line (no fast path takes it).
        (_rec() + " x", None, "invalid JSON (Extra data at column 82)"),
        (_rec() + "\v", None, "invalid JSON (Extra data at column 81)"),
        ("[1, 2]", None, "expected a JSON object"),
        ('"just a string"', None, "expected a JSON object"),
        (_rec(timestamp=_DROP), "timestamp", "missing"),
        (_rec(input_length=_DROP), "input_length", "missing"),
        (_rec(output_length=_DROP), "output_length", "missing"),
        (_rec(hash_ids=_DROP), "hash_ids", "missing"),
        (_rec(timestamp="2000"), "timestamp", 'got "2000"'),
        (_rec(timestamp=True), "timestamp", "got true"),
        ('{"timestamp": NaN, "input_length": 1, "output_length": 1, "hash_ids": []}', "timestamp", "got NaN"),
        (_rec(timestamp=-5), "timestamp", "got -5"),
        (_rec(timestamp=500), "timestamp", "goes backwards: 500 ms after 1000 ms on line 2"),
        (_rec(input_length=12.0), "input_length", "got 12.0"),
        (_rec(input_length=-1), "input_length", "got -1"),
        (_rec(input_length=None), "input_length", "got null"),
        (_rec(output_length=False), "output_length", "got false"),
        (_rec(output_length=-3), "output_length", "got -3"),
        (_rec(hash_ids="1,2"), "hash_ids", 'got "1,2"'),
        (_rec(hash_ids=[1, "a"]), "hash_ids", 'element 1: expected a non-negative integer, got "a"'),
        (_rec(hash_ids=[1, 2, -7]), "hash_ids", "element 2: expected a non-negative integer, got -7"),
        (_rec(hash_ids=[1.5]), "hash_ids", "element 0"),
    ],
)
def test_malformed_line(tmp_path: Path, bad: str, field: str | None, fragment: str) -> None:
    # Lines: 1 good, 2 good, 3 blank, 4 bad -> the error must point at line 4.
    p = _write(tmp_path, "bad.jsonl", [GOOD, GOOD, "", bad, GOOD])
    with pytest.raises(TraceError) as ei:
        load_trace(p)
    e = ei.value
    msg = str(e)
    assert msg.startswith(f"{p}:4: "), msg
    assert e.line == 4 and e.field == field
    if field is not None:
        assert f"field {field!r}" in msg
    assert fragment in msg


def test_json_whitespace_around_a_line_is_taken(tmp_path: Path) -> None:
    p = _write(tmp_path, "spaced.jsonl", [GOOD, " \t" + _rec() + " \t\r", _rec(timestamp=3000) + "  "])
    t = load_trace(p)
    assert [r.timestamp for r in t.requests] == [0.0, 1.0, 2.0] and t.requests[1].hash_ids == (1, 3)


def test_not_utf8_names_line(tmp_path: Path) -> None:
    p = tmp_path / "bin.jsonl"
    p.write_bytes(GOOD.encode() + b"\n" + b'{"timestamp": 1\xff}\n')
    with pytest.raises(TraceError, match=r"bin\.jsonl:2: "):
        load_mooncake(p)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot open"):
        load_trace(tmp_path / "nope.jsonl")


def test_blank_lines_skipped_and_ids_count_physical_lines(tmp_path: Path) -> None:
    p = tmp_path / "gaps.jsonl"
    p.write_text("\n" + GOOD + "\n   \n\t\n" + GOOD.replace("1000", "1500") + "\n\n", encoding="utf-8")
    t = load_mooncake(p)
    assert [r.request_id for r in t] == ["gaps-2", "gaps-5"]
    assert [r.timestamp for r in t] == [0.0, 0.5]


def test_first_timestamp_normalised_and_equal_allowed(tmp_path: Path) -> None:
    lines = [_rec(timestamp=5000), _rec(timestamp=5000), _rec(timestamp=6500.5)]
    t = load_mooncake(_write(tmp_path, "t.jsonl", lines))
    assert [r.timestamp for r in t] == [0.0, 0.0, 1.5005]
    assert t.duration == pytest.approx(1.5005)
    assert t.rate == pytest.approx(2 / 1.5005)
    assert t.requests[0].hash_ids == (1, 3)


def test_extra_keys_ignored(tmp_path: Path) -> None:
    line = json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0], "extra": "x"})
    assert len(load_mooncake(_write(tmp_path, "e.jsonl", [line]))) == 1


def test_write_roundtrip(tmp_path: Path) -> None:
    t = synth_with_prefixes(40, 3.0, seed=5)
    p = tmp_path / "sub" / "rt.jsonl"
    write_mooncake(p, t)
    back = load_mooncake(p)
    assert len(back) == len(t)
    for a, b in zip(t, back):
        assert (a.input_tokens, a.output_tokens, a.hash_ids) == (b.input_tokens, b.output_tokens, b.hash_ids)
        assert b.timestamp == pytest.approx(a.timestamp, abs=1e-6)


def test_write_refuses_other_block_size(tmp_path: Path) -> None:
    t = Trace([TraceRequest("a", 0.0, 10, 1, (0,))], source="x", block_tokens=256)
    with pytest.raises(ValueError, match="512"):
        write_mooncake(tmp_path / "x.jsonl", t)


def test_full_size_file_loads(tmp_path: Path) -> None:
    # Mooncake's toolagent trace has 23,608 lines; 25k with realistic-length hash lists.
    rng = np.random.default_rng(0)
    gaps = rng.integers(0, 300, size=25_000)
    sizes = rng.integers(1, 60, size=25_000)
    ids = [", ".join(map(str, range(k))) for k in range(60)]  # reused text keeps generation cheap
    ts = np.cumsum(gaps)
    lines = [
        f'{{"timestamp": {ts[i]}, "input_length": {sizes[i] * 512 - 7}, "output_length": 300, '
        f'"hash_ids": [{ids[sizes[i]]}]}}'
        for i in range(25_000)
    ]
    t = load_trace(_write(tmp_path, "big.jsonl", lines))
    assert len(t) == 25_000
    assert t.requests[-1].request_id == "big-25000"
    assert t.duration == pytest.approx((ts[-1] - ts[0]) / 1000)
    assert len(t.requests[-1].hash_ids) == sizes[-1]


# --- Trace and loader -------------------------------------------------------------------------


def test_trace_basics() -> None:
    t = _trace([0.0, 1.0, 4.0])
    assert len(t) == 3 and [r.request_id for r in t] == ["r0", "r1", "r2"]
    assert t.duration == 4.0 and t.rate == 0.5
    assert _trace([]).rate == 0.0 and _trace([0.0]).duration == 0.0
    assert _trace([0.0, 0.0]).rate == math.inf
    with pytest.raises(ValueError, match="out of order"):
        _trace([0.0, 2.0, 1.0])
    with pytest.raises(ValueError, match="out of order"):
        _trace([0.0, float("nan")])


@pytest.mark.parametrize(("name", "fmt"), [("x.csv", "auto"), ("x", "auto"), ("x.txt", "auto"), ("x.jsonl", "parquet")])
def test_unsupported_format(tmp_path: Path, name: str, fmt: str) -> None:
    p = tmp_path / name
    p.write_text("", encoding="utf-8")
    with pytest.raises(TraceError, match="unsupported format"):
        load_trace(p, fmt)


def test_explicit_mooncake_format_any_suffix(tmp_path: Path) -> None:
    assert len(load_trace(_write(tmp_path, "x.txt", [GOOD]), "mooncake")) == 1


# --- Generators -------------------------------------------------------------------------------

PAPER = LengthDist(mu=9.90, sigma=1.00, min=128, max=131072)


def test_truncated_mean_closed_form_matches_numeric() -> None:
    # Integrate x * pdf(x) over [min, max] in log space (u = ln x) with a fine trapezoid rule.
    u = np.linspace(math.log(PAPER.min), math.log(PAPER.max), 200_001)
    dens = np.exp(-((u - PAPER.mu) ** 2) / (2 * PAPER.sigma**2))  # pdf in u, unnormalised
    numeric = float(np.trapezoid(np.exp(u) * dens, u) / np.trapezoid(dens, u))
    closed = truncated_lognormal_mean(PAPER)
    assert closed == pytest.approx(numeric, rel=1e-6)
    assert 26_000 < closed < 29_000  # the paper's "mean ~27K"


def test_synthetic_matches_paper_distribution() -> None:
    spec = WorkloadSpec(input=PAPER, requests=20_000, rate=2.0, seed=3, output_tokens=1024)
    t = synthetic_trace(spec)
    inp = np.array([r.input_tokens for r in t])
    assert len(t) == 20_000
    assert inp.min() >= 128 and inp.max() <= 131072
    assert abs(inp.mean() / truncated_lognormal_mean(PAPER) - 1) < 0.03
    assert all(r.output_tokens == 1024 for r in t)
    assert t.requests[0].timestamp == 0.0
    assert t.rate == pytest.approx(2.0, rel=0.03)
    assert all(len(r.hash_ids) == math.ceil(r.input_tokens / 512) for r in t)
    share, _ = prefix_reuse_share(t)
    assert share == 0.0


def test_synthetic_deterministic() -> None:
    spec = WorkloadSpec(requests=500, seed=11)
    a, b = synthetic_trace(spec), synthetic_trace(spec)
    assert a.requests == b.requests
    assert trace_from_workload(spec).requests == a.requests
    c = synthetic_trace(WorkloadSpec(requests=500, seed=12))
    assert [r.input_tokens for r in c] != [r.input_tokens for r in a]


def test_truncation_resamples_instead_of_clipping() -> None:
    narrow = LengthDist(mu=9.90, sigma=1.00, min=10_000, max=30_000)
    t = synthetic_trace(WorkloadSpec(input=narrow, requests=5_000, seed=1))
    inp = np.array([r.input_tokens for r in t])
    assert inp.min() >= 10_000 and inp.max() <= 30_000
    # Clipping would put ~30% of the mass exactly on the bounds.
    assert np.mean((inp == 10_000) | (inp == 30_000)) < 0.01


def test_prefix_generator_blocks_and_reuse() -> None:
    t = synth_with_prefixes(600, 2.0, seed=4, system_prompts=2, system_prompt_tokens=1024)
    assert len(t) == 600 and t.requests[0].timestamp == 0.0
    assert all(len(r.hash_ids) == math.ceil(r.input_tokens / 512) for r in t)
    assert len({r.request_id for r in t}) == 600
    by_session: dict[str, list[TraceRequest]] = {}
    for r in t:
        by_session.setdefault(r.request_id.split("-")[0], []).append(r)
    multi = 0
    for turns in by_session.values():
        for prev, cur in zip(turns, turns[1:]):
            if cur.input_tokens > prev.input_tokens:  # not a restart
                full = prev.input_tokens // 512
                assert cur.hash_ids[:full] == prev.hash_ids[:full]
                multi += 1
    assert multi > 100
    # Two shared system prompts of two blocks each: every request opens with one of them.
    openings = {r.hash_ids[:2] for r in t}
    assert openings == {(0, 1), (2, 3)}
    share, _ = prefix_reuse_share(t)
    assert 0.3 < share < 0.9
    assert synth_with_prefixes(600, 2.0, seed=4, system_prompts=2).requests == t.requests


def test_prefix_generator_other_block_size_and_cap() -> None:
    t = synth_with_prefixes(200, 1.0, seed=2, block_tokens=64, sessions=10, max_input=8000)
    assert t.block_tokens == 64
    assert all(r.input_tokens <= 8000 for r in t)
    assert all(len(r.hash_ids) == math.ceil(r.input_tokens / 64) for r in t)
    assert len({r.request_id.split("-")[0] for r in t}) == 10


# --- Transforms -------------------------------------------------------------------------------


def test_time_scale_and_rescale_rate() -> None:
    t = synth_with_prefixes(100, 1.0, seed=1)
    fast = transforms.time_scale(t, 4.0)
    assert [r.request_id for r in fast] == [r.request_id for r in t]
    assert fast.rate == pytest.approx(4 * t.rate)
    assert fast.requests[10].timestamp == pytest.approx(t.requests[10].timestamp / 4)
    for target in (0.25, 3.24, 50.0):
        r = transforms.rescale_rate(t, target)
        assert r.rate == pytest.approx(target, rel=1e-12)
        assert len(r) == len(t)
    with pytest.raises(ValueError):
        transforms.rescale_rate(_trace([0.0, 0.0]), 1.0)
    with pytest.raises(ValueError):
        transforms.time_scale(t, 0.0)


def test_sample_head_window_filter_cap() -> None:
    t = _trace([float(i) for i in range(10)], inputs=[100 * (i + 1) for i in range(10)])
    s = transforms.sample(t, 4, seed=9)
    ids = [r.request_id for r in s]
    assert len(s) == 4 and ids == sorted(ids, key=lambda x: int(x[1:]))
    assert s.requests[0].timestamp == 0.0
    assert transforms.sample(t, 4, seed=9).requests == s.requests
    assert len(transforms.sample(t, 10, seed=0)) == 10
    with pytest.raises(ValueError):
        transforms.sample(t, 11, seed=0)

    h = transforms.head(t, 3)
    assert [r.request_id for r in h] == ["r0", "r1", "r2"]
    assert len(transforms.head(t, 100)) == 10

    w = transforms.window(t, 2.5, 6.0)
    assert [r.request_id for r in w] == ["r3", "r4", "r5"]
    assert [r.timestamp for r in w] == [0.0, 1.0, 2.0]

    f = transforms.filter_lengths(t, min_input=300, max_input=500)
    assert [r.input_tokens for r in f] == [300, 400, 500]
    assert len(transforms.filter_lengths(t, max_input=200)) == 2
    assert len(transforms.filter_lengths(t)) == 10

    c = transforms.cap_output(t, 104)
    assert [r.output_tokens for r in c] == [100, 101, 102, 103, 104, 104, 104, 104, 104, 104]
    assert [r.input_tokens for r in c] == [r.input_tokens for r in t]
    # The input trace is untouched and provenance is recorded.
    assert [r.output_tokens for r in t][-1] == 109 and t.requests[3].timestamp == 3.0
    assert "cap_output(104)" in c.source


def test_transforms_keep_hashes_and_block_size() -> None:
    t = synth_with_prefixes(50, 1.0, seed=3, block_tokens=256)
    out = transforms.cap_output(transforms.window(transforms.time_scale(t, 2.0), 1.0, 20.0), 200)
    assert out.block_tokens == 256
    src = {r.request_id: r.hash_ids for r in t}
    assert all(src[r.request_id] == r.hash_ids for r in out)


# --- The `trace` command ----------------------------------------------------------------------


def _run(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="testbed")
    command.register(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    rc: int = args.func(args)
    return rc


def test_command_synth_info_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.jsonl"
    synth = ["trace", "synth", "--format", "mooncake", "--requests", "60", "--rate", "2", "--seed", "3"]
    assert _run([*synth, "--out", str(out), "--prefix-reuse"]) == 0
    assert len(load_trace(out)) == 60
    capsys.readouterr()
    assert _run(["trace", "info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["requests"] == 60 and info["prefix_reuse_share"] > 0
    assert set(info["input_tokens"]) == {"mean", "p50", "p90", "max"}
    assert _run(["trace", "info", str(out)]) == 0
    assert "prefix reuse" in capsys.readouterr().out
    assert _run(["trace", "validate", str(out)]) == 0

    plain = tmp_path / "p.jsonl"
    assert _run(["trace", "synth", "--requests", "30", "--rate", "1", "--out", str(plain)]) == 0
    assert prefix_reuse_share(load_trace(plain))[0] == 0.0

    bad = _write(tmp_path, "bad.jsonl", [GOOD, _rec(output_length=-1)])
    capsys.readouterr()
    assert _run(["trace", "validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: field 'output_length'" in err
