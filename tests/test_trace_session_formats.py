"""Trace formats that state sessions: Bailian (seconds, 16-token blocks) and aiperf's multi-turn
JSONL (conversations, delays), their detection beside Mooncake, `trace info` and `trace convert`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from testbed.cli import main
from testbed.traces.aiperf_multiturn import BYTES_PER_TOKEN
from testbed.traces.formats import FORMATS, WriteOptions, detect_format
from testbed.traces.loader import load_trace
from testbed.traces.sessions import session_plan, session_stats
from testbed.traces.synthetic import synth_profile
from testbed.traces.types import TraceError

pytestmark = pytest.mark.pure

BAILIAN = [
    {"chat_id": 159, "parent_chat_id": -1, "timestamp": 61.114, "input_length": 521, "output_length": 132,
     "type": "text", "turn": 1, "hash_ids": [1089, 1090, 1091]},
    {"chat_id": 160, "parent_chat_id": 159, "timestamp": 62.5, "input_length": 700, "output_length": 80,
     "type": "text", "turn": 2, "hash_ids": [1089, 1090, 1091, 1092]},
    {"chat_id": 161, "parent_chat_id": -1, "timestamp": 63.25, "input_length": 40, "output_length": 8,
     "type": "search", "turn": 1, "hash_ids": [7, 8, 9]},
]  # fmt: skip


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bailian_reads_seconds_16_token_blocks_and_stated_parents(tmp_path: Path) -> None:
    p = _jsonl(tmp_path / "bailian.jsonl", BAILIAN)  # type: ignore[arg-type]
    assert detect_format(p) == "bailian"
    t = load_trace(p)
    assert t.block_tokens == 16
    assert [round(r.timestamp, 6) for r in t] == [0.0, 1.386, 2.136]  # seconds, not ms
    assert [r.parent_id for r in t] == ["", t.requests[0].request_id, ""]
    assert session_stats(t).sessions == 2 and session_stats(t).source == "stated"


def test_mooncake_with_session_fields_but_no_turn_stays_mooncake(tmp_path: Path) -> None:
    rows = [{k: v for k, v in r.items() if k not in ("turn", "type")} for r in BAILIAN]
    for r in rows:
        r["timestamp"] = int(float(r["timestamp"]) * 1000)  # type: ignore[arg-type]
    p = _jsonl(tmp_path / "m.jsonl", rows)
    assert detect_format(p) == "mooncake"
    t = load_trace(p)
    assert t.block_tokens == 512 and [round(r.timestamp, 3) for r in t] == [0.0, 1.386, 2.136]


def test_bailian_write_splits_512_token_blocks_and_keeps_the_reuse(tmp_path: Path) -> None:
    trace = synth_profile("chat", 60, 2.0, seed=3)
    p = tmp_path / "b.jsonl"
    FORMATS["bailian"].write(p, trace, WriteOptions())
    got = load_trace(p)
    assert [(r.input_tokens, math.ceil(r.input_tokens / 16)) for r in got] == [
        (r.input_tokens, len(r.hash_ids)) for r in got
    ]
    assert session_plan(got)[0].parent == session_plan(trace)[0].parent
    # A follow-up shares its parent's full 512-token blocks, 32 of its 16-token blocks each.
    first_follow = next(i for i, r in enumerate(trace) if r.parent_id)
    par = session_plan(trace)[0].parent[first_follow]
    shared = trace.requests[par].input_tokens // 512 * 32
    assert got.requests[first_follow].hash_ids[:shared] == got.requests[par].hash_ids[:shared]


MULTI_TURN = [
    {"session_id": "a", "turns": [
        {"role": "system", "text": "You are a helpful assistant."},  # aiperf's system message: no turn
        {"text": "What is deep learning?", "output_length": 20},
        {"text": "Explain it for a five year old.", "delay": 1500, "output_length": 30}]},
    {"session_id": "b", "turns": [{"text": "Hi", "delay": 250, "output_length": 5}]},
    {"session_id": "a", "turns": [{"text": "And again", "delay": 100, "output_length": 7}]},
]  # fmt: skip


def _tok(text: str) -> int:
    return -(-len(text.encode()) // BYTES_PER_TOKEN)


def test_aiperf_multi_turn_conversations_delays_and_history(tmp_path: Path) -> None:
    p = _jsonl(tmp_path / "mt.jsonl", MULTI_TURN)  # type: ignore[arg-type]
    assert detect_format(p) == "aiperf-multi-turn"
    t = load_trace(p)
    assert [r.request_id for r in t] == ["a#1", "b#1", "a#2", "a#3"]
    assert [r.timestamp for r in t] == [0.0, 0.25, 1.5, 1.6]  # parent's arrival + delay
    assert [r.parent_id for r in t] == ["", "", "a#1", "a#2"]
    assert [r.session_id for r in t] == ["a", "b", "a", "a"]
    assert math.isnan(t.requests[0].think_s) and [r.think_s for r in t.requests[2:]] == [1.5, 0.1]
    # Each turn resends the conversation so far: its parent's prompt and answer, then its text.
    a1 = _tok("You are a helpful assistant.") + _tok("What is deep learning?")
    a2 = a1 + 20 + _tok("Explain it for a five year old.")
    assert [r.input_tokens for r in t] == [a1, 1, a2, a2 + 30 + _tok("And again")]
    assert [r.output_tokens for r in t] == [20, 5, 30, 7]
    ss = session_stats(t)
    assert (ss.sessions, ss.multi_turn_sessions, ss.turns_per_session[3]) == (2, 1, 3)
    assert ss.think_s is not None and ss.think_s[0] == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("turn", "message"),
    [
        ({"text": "x"}, "field 'output_length': turn 0: missing"),
        ({"text": "x", "output_length": 3, "delay": 5, "timestamp": 9}, "cannot both be set"),
        ({"image": "a.png", "output_length": 3}, "expected a prompt"),
        ({"text": "x", "output_length": 0}, "field 'output_length': turn 0: expected a token count"),
    ],
)
def test_aiperf_bad_turns_name_line_and_field(tmp_path: Path, turn: dict[str, object], message: str) -> None:
    p = _jsonl(tmp_path / "bad.jsonl", [{"session_id": "s", "turns": [turn]}])
    with pytest.raises(TraceError, match=message) as e:
        load_trace(p)
    assert str(e.value).startswith(f"{p}:1: ")


@pytest.mark.parametrize("profile", ["chat", "agent"])
def test_a_session_trace_exported_for_aiperf_reads_back_the_same(tmp_path: Path, profile: str) -> None:
    trace = synth_profile(profile, 120, 3.0, seed=5)
    p = tmp_path / "x.jsonl"
    FORMATS["aiperf-multi-turn"].write(p, trace, WriteOptions())
    got = load_trace(p)
    assert [(r.timestamp, r.input_tokens, r.output_tokens) for r in got] == [
        (pytest.approx(r.timestamp, abs=1e-6), r.input_tokens, r.output_tokens) for r in trace
    ]
    want, have = session_plan(trace)[0], session_plan(got)[0]
    assert have.parent == want.parent and have.turn == want.turn
    assert session_stats(got).sessions == session_stats(trace).sessions
    # What aiperf reads: the text is the turn's new tokens; a follow-up waits its think time.
    rows = [json.loads(line) for line in p.read_text().splitlines()]
    for row in rows:
        for k, turn in enumerate(row["turns"]):
            assert ("delay" in turn) == (k > 0) and ("timestamp" in turn) == (k == 0)
    by_id = {r.request_id: r for r in trace}
    follow = [r for r in trace if r.parent_id]
    new = sum(r.input_tokens - by_id[r.parent_id].input_tokens - by_id[r.parent_id].output_tokens for r in follow)
    sent = sum(len(t["text"]) for row in rows for t in row["turns"][1:]) // BYTES_PER_TOKEN
    assert sent == new
    if profile == "agent":  # stated think times become the delays
        delays = sorted(t["delay"] / 1000 for row in rows for t in row["turns"][1:])
        assert delays == pytest.approx(sorted(r.think_s for r in follow), abs=1e-6)


def test_trace_info_and_convert_report_the_aiperf_sessions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "agent.jsonl"
    assert (
        main(["trace", "synth", "--prefix-reuse", "agent", "--requests", "50", "--rate", "2", "--out", str(src)]) == 0
    )
    out = tmp_path / "agent-aiperf.jsonl"
    assert main(["trace", "convert", str(src), "--to", "aiperf-multi-turn", "--out", str(out)]) == 0
    assert "as aiperf-multi-turn" in capsys.readouterr().out
    assert main(["trace", "info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    want = session_stats(load_trace(src))
    assert info["sessions"]["sessions"] == want.sessions and info["sessions"]["source"] == "stated"
    assert info["sessions"]["think_s"] == pytest.approx(list(want.think_s or ()), abs=1e-6)
    assert main(["trace", "info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "turns/session" in text and "think time" in text
