"""Per-session and per-turn figures of a run whose trace has sessions (records.csv version 3)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from testbed.core.record import RequestRecord
from testbed.core.sessions import early_turns
from testbed.metrics.artefacts.summary_file import Sessions, TurnFigures

# Turns from this index on share the last row (long agent sessions would make a row per turn).
LAST_TURN_ROW = 16


def _p90(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.9 * len(s)))]


def turn_figures(records: Sequence[RequestRecord], speedup: float) -> list[TurnFigures]:
    by: dict[int, list[RequestRecord]] = {}
    for r in records:
        if r.turn > 0:
            by.setdefault(min(r.turn, LAST_TURN_ROW), []).append(r)
    return _turn_rows(by, speedup)


def _turn_rows(by: dict[int, list[RequestRecord]], speedup: float) -> list[TurnFigures]:
    out: list[TurnFigures] = []
    for k in sorted(by):
        rs = by[k]
        completed = tokens = cached = 0
        ttft: list[float] = []
        for r in rs:  # one pass: each completed record's figures in turn
            if r.outcome != "completed":
                continue
            completed += 1
            t = r.times
            if _finite(v := t.first_token - t.arrival):  # the record's `ttft`
                ttft.append(v * speedup)
            tokens += r.input_tokens
            cached += r.cached_tokens
        out.append(
            TurnFigures(
                turn=k,
                requests=len(rs),
                completed=completed,
                ttft_mean_s=sum(ttft) / len(ttft) if ttft else None,
                ttft_p90_s=_p90(ttft) if ttft else None,
                cached_token_share=cached / tokens if tokens else None,
            )
        )
    return out


_finite = math.isfinite


def count_early_turns(records: Sequence[RequestRecord]) -> int:
    """Follow-ups sent before their parent had finished (answered or failed), from the records."""
    at = {r.trace_index: k for k, r in enumerate(records)}
    parent = [at.get(r.parent_index, -1) if r.parent_index >= 0 else -1 for r in records]
    sent = [r.times.arrival for r in records]
    # A failed parent finished when its failure was known: its last stamp.
    finished = [_finished(r) for r in records]
    return early_turns(parent, sent, finished)


def _finished(r: RequestRecord) -> float:
    t = r.times
    if r.outcome == "completed":
        return t.last_token
    stamps = [v for v in (t.last_token, t.first_token, t.arrival) if math.isfinite(v)]
    return max(stamps) if stamps and r.outcome == "failed" else math.nan


def sessions_summary(records: Sequence[RequestRecord], speedup: float, arrivals: str | None) -> Sessions | None:
    """None when no record belongs to a session."""
    if not any(r.session_id for r in records):
        return None
    # One pass over the records for every figure (a summary's largest share otherwise). Per
    # session: [turns, all completed, latest last token, earliest arrival].
    sessions: dict[str, list[Any]] = {}
    by_turn: dict[int, list[RequestRecord]] = {}
    follow_ups = 0
    for r in records:
        if sid := r.session_id:
            t = r.times
            m = sessions.get(sid)
            if m is None:
                sessions[sid] = [1, r.outcome == "completed", t.last_token, t.arrival]
            else:
                m[0] += 1
                if r.outcome != "completed":
                    m[1] = False
                if t.last_token > m[2]:  # max()'s and min()'s own tests, NaN included
                    m[2] = t.last_token
                if t.arrival < m[3]:
                    m[3] = t.arrival
        if r.turn > 0:
            k = r.turn if r.turn < LAST_TURN_ROW else LAST_TURN_ROW
            b = by_turn.get(k)
            if b is None:
                by_turn[k] = [r]
            else:
                b.append(r)
        if r.parent_index >= 0:
            follow_ups += 1
    spans = [m[2] - m[3] for m in sessions.values() if m[1]]
    return Sessions(
        arrivals=arrivals,
        sessions=len(sessions),
        follow_ups=follow_ups,
        early_turns=count_early_turns(records),
        turns_per_session_mean=sum(m[0] for m in sessions.values()) / len(sessions),
        session_duration_s_mean=sum(spans) / len(spans) * speedup if spans else None,
        by_turn=_turn_rows(by_turn, speedup),
    )


def session_rows(s: Sessions) -> list[tuple[str, str]]:
    """The report's session table: (what, value)."""
    dur = s.session_duration_s_mean
    return [
        ("Arrivals", s.arrivals or "open (before sessions were recorded)"),
        ("Sessions", f"{s.sessions:,}"),
        ("Turns per session (mean)", f"{s.turns_per_session_mean:.2f}"),
        ("Follow-up turns", f"{s.follow_ups:,}"),
        ("Turns sent before their parent finished", f"{s.early_turns:,}"),
        ("Session duration, mean (paper s)", "n/a" if dur is None else f"{dur:,.2f}"),
    ]


def turn_rows(s: Sessions) -> list[tuple[str, str, str, str, str]]:
    def f(x: float | None, spec: str) -> str:
        return "n/a" if x is None else format(x, spec)

    return [
        (
            f"{t.turn}+" if t.turn == LAST_TURN_ROW else str(t.turn),
            f"{t.requests:,}",
            f(t.ttft_mean_s, ".3f"),
            f(t.ttft_p90_s, ".3f"),
            f(None if t.cached_token_share is None else 100 * t.cached_token_share, ".1f"),
        )
        for t in s.by_turn
    ]
