"""The serving edge of a held deployment behind a foreign router reads the answer's events as
they pass: the id the nodes logged the request under, and when its first and last tokens went by."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.live.edge import AnswerScan, EdgeLine, read_edge_log


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@pytest.mark.pure
def test_a_streamed_answer_gives_its_id_and_token_times_across_split_chunks() -> None:
    scan = AnswerScan(streamed=True)
    raw = _sse({"id": "r1", "choices": [{"text": "a"}]}) + _sse({"id": "r1", "choices": [{"text": "b"}]})
    scan.feed(raw[:7], 1.0)  # an event cut mid-way is read when its end arrives
    scan.feed(raw[7:], 2.0)
    scan.feed(_sse({"id": "r1", "choices": [], "usage": {"completion_tokens": 2}}), 3.0)  # usage: no token
    scan.feed(b"data: [DONE]\n\n", 4.0)
    assert (scan.request_id, scan.first_token, scan.last_token) == ("r1", 2.0, 2.0)


@pytest.mark.pure
def test_sglang_generate_answers_carry_their_id_in_meta_info() -> None:
    scan = AnswerScan(streamed=True)
    scan.feed(_sse({"text": "x", "meta_info": {"id": "room-7"}}), 5.0)
    assert (scan.request_id, scan.first_token) == ("room-7", 5.0)
    whole = AnswerScan(streamed=False)
    whole.feed(json.dumps({"id": "r2", "choices": [{"text": "x"}]}).encode(), 1.0)
    whole.end()
    assert (whole.request_id, whole.first_token) == ("r2", None)


@pytest.mark.pure
def test_the_edge_log_skips_a_line_cut_short(tmp_path: Path) -> None:
    p = tmp_path / "edge.jsonl"
    line = EdgeLine("r1", "/v1/completions", 200, 10.0, 10.5, 11.0)
    p.write_text(json.dumps(line.as_json()) + "\n" + '{"request_id": "r2", "pa')
    assert read_edge_log(p) == {"r1": line}
