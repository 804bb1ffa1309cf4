"""aiperf's multi-turn custom dataset (`aiperf profile --custom-dataset-type multi_turn`) as a trace.

The format, as aiperf 0.13 defines it (`aiperf.dataset.loader.models.MultiTurn`, `SingleTurn`):
one JSON object a line, `session_id` (optional: lines sharing one make one conversation, their
turns in file order) and `turns`, a non-empty list of objects, each with its prompt as `text` (or
`texts`: strings, or objects whose `contents` are strings), `output_length` (max tokens), and its
timing as `timestamp` (ms on a fixed schedule) or `delay` (ms to wait after the previous turn's
answer before sending it), never both. A leading `role: "system"` turn with text alone is sent by
aiperf as every turn's system message, not as a turn. Over a chat endpoint aiperf sends each turn
with the conversation so far (earlier prompts and answers), so a turn's prompt is its parent's
prompt, the parent's answer and its own text.

What this reader makes of it:
- input tokens: the parent's input + the parent's output + the turn's new tokens, counted as
  its text's UTF-8 bytes / 4 (what the router estimates for text; aiperf counts with its own
  tokenizer) or, where given, `input_length`: the testbed's own key (aiperf ignores keys it
  does not know), the whole prompt's tokens, which `write_aiperf` writes so a round trip is exact;
- arrivals: a turn's `arrival_ms` (the testbed's own key: the trace time `write_aiperf` keeps),
  else its `timestamp`, else its parent's arrival + its `delay` (a first turn: its delay after
  0); the file's first arrival is then 0. Without timestamps every conversation starts at 0:
  aiperf starts them by its own `--request-rate`/`--concurrency`, which the file does not hold;
- sessions: each turn follows the one before it in its conversation; its `delay` is its think
  time (exactly aiperf's closed loop: sent `delay` after the answer it follows);
- prefix blocks (512 tokens): a turn reuses its parent's full prompt blocks, the rest are fresh,
  as the history aiperf resends is its parent's prompt; texts are not compared, so conversations
  that open with the same text share no blocks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from testbed.config.input_files import json_kind
from testbed.core.schema.limits import MAX_INPUT_TOKENS, MAX_OUTPUT_TOKENS, MAX_TIMESTAMP_MS, MIN_TOKENS
from testbed.core.sessions import ROOT
from testbed.traces.files import open_trace, plain_name
from testbed.traces.sessions import session_plan
from testbed.traces.types import Trace, TraceError, TraceRequest

AIPERF_BLOCK_TOKENS = 512
BYTES_PER_TOKEN = 4  # the router's estimate of a text prompt's length
_SMALL_JSON = 60


def _show(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= _SMALL_JSON else text[: _SMALL_JSON - 3] + "..."


def looks_like_aiperf(obj: object) -> bool:
    """A JSON object that is one of aiperf's multi-turn conversations (detection)."""
    return isinstance(obj, dict) and isinstance(obj.get("turns"), list)


def _text_bytes(turn: dict[str, object]) -> int | None:
    """UTF-8 bytes of a turn's text (None: it has none)."""
    text = turn.get("text")
    if isinstance(text, str):
        return len(text.encode("utf-8"))
    texts = turn.get("texts")
    if not isinstance(texts, list):
        return None
    total = 0
    for t in texts:
        if isinstance(t, str):
            total += len(t.encode("utf-8"))
        elif isinstance(t, dict) and isinstance(t.get("contents"), list):
            total += sum(len(c.encode("utf-8")) for c in t["contents"] if isinstance(c, str))
        else:
            raise TraceError(f"expected strings or objects with 'contents', got {_show(t)}", field="texts")
    return total


def _ms(turn: dict[str, object], key: str) -> float | None:
    v = turn.get(key)
    if v is None:
        return None
    if type(v) not in (int, float) or not 0 <= v <= MAX_TIMESTAMP_MS:  # type: ignore[operator]
        raise TraceError(f"expected milliseconds from 0 to {MAX_TIMESTAMP_MS:,}, got {_show(v)}", field=key)
    return float(v)  # type: ignore[arg-type]


def _tokens(turn: dict[str, object], key: str, most: int) -> int | None:
    v = turn.get(key)
    if v is None:
        return None
    if type(v) is not int or not MIN_TOKENS <= v <= most:
        raise TraceError(f"expected a token count from {MIN_TOKENS} to {most:,}, got {_show(v)}", field=key)
    return v


@dataclass
class _Turn:
    session: str
    index: int  # 1-based within its conversation
    arrival_ms: float
    order: int  # file position, for ties
    input_tokens: int
    output_tokens: int
    think_s: float
    hash_ids: tuple[int, ...]


@dataclass
class _Conversation:
    """A conversation's state between its lines: its last turn and the system text's tokens."""

    turns: int = 0
    last_arrival_ms: float = 0.0
    last_input: int = 0
    last_output: int = 0
    last_ids: tuple[int, ...] = ()
    system_tokens: int = 0


def _turns_of(obj: dict[str, object], conv: _Conversation, sid: str, order: int, next_id: list[int]) -> list[_Turn]:
    turns = obj["turns"]
    assert isinstance(turns, list)
    if not turns:
        raise TraceError("expected at least one turn", field="turns")
    out: list[_Turn] = []
    for k, turn in enumerate(turns):
        if type(turn) is not dict:
            raise TraceError(f"turn {k}: expected a JSON object, got {json_kind(turn)}", field="turns")
        try:
            nbytes = _text_bytes(turn)
            stamp, delay, kept = _ms(turn, "timestamp"), _ms(turn, "delay"), _ms(turn, "arrival_ms")
            if stamp and delay:
                raise TraceError("timestamp and delay cannot both be set (aiperf refuses it too)")
            out_tokens = _tokens(turn, "output_length", MAX_OUTPUT_TOKENS)
            given_input = _tokens(turn, "input_length", MAX_INPUT_TOKENS)
            timed = stamp is not None or delay is not None or out_tokens is not None
            if turn.get("role") == "system" and conv.turns == 0 and not timed and nbytes:
                conv.system_tokens += -(-nbytes // BYTES_PER_TOKEN)  # aiperf's system message
                continue
            if nbytes is None and given_input is None:
                raise TraceError("expected a prompt: 'text' or 'texts' (or the testbed's 'input_length')")
            if out_tokens is None:
                raise TraceError(
                    "missing: the testbed needs each turn's answer length (aiperf takes --osl otherwise)",
                    field="output_length",
                )
        except TraceError as e:
            raise TraceError(f"turn {k}: {e.detail}", field=e.field) from None
        first = conv.turns == 0
        history = 0 if first else conv.last_input + conv.last_output
        new = max(MIN_TOKENS, -(-(nbytes or 0) // BYTES_PER_TOKEN)) + (conv.system_tokens if first else 0)
        inp = given_input if given_input is not None else min(history + new, MAX_INPUT_TOKENS)
        if kept is not None:
            at = kept
        elif stamp is not None:
            at = stamp
        else:
            at = (0.0 if first else conv.last_arrival_ms) + (delay or 0.0)
        if not first and at < conv.last_arrival_ms:
            raise TraceError(
                f"turn {k}: arrives at {at:g} ms, before the turn it follows ({conv.last_arrival_ms:g} ms)",
                field="timestamp",
            )
        keep = () if first else conv.last_ids[: conv.last_input // AIPERF_BLOCK_TOKENS]
        fresh = max(0, -(-inp // AIPERF_BLOCK_TOKENS) - len(keep))
        ids = keep + tuple(range(next_id[0], next_id[0] + fresh))
        next_id[0] += fresh
        conv.turns += 1
        think = math.nan if first or delay is None else delay / 1000.0
        out.append(_Turn(sid, conv.turns, at, order + k, inp, out_tokens, think, ids))
        conv.last_arrival_ms, conv.last_input, conv.last_output, conv.last_ids = at, inp, out_tokens, ids
    return out


def iter_aiperf(path: str | Path, *, on_error: Callable[[TraceError], None] | None = None) -> Iterator[TraceRequest]:
    """The requests of an aiperf multi-turn file in arrival order (read whole: a conversation's
    lines may be anywhere in the file). Request ids are `{session_id}#{turn}`; a line without a
    `session_id` is a conversation named `{file stem}-{line}`."""
    p = Path(path)
    stem = plain_name(p).stem
    convs: dict[str, _Conversation] = {}
    turns: list[_Turn] = []
    next_id = [0]
    with open_trace(p) as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                try:
                    obj = json.loads(raw)
                except (ValueError, RecursionError) as e:
                    raise TraceError(f"invalid JSON ({e})") from None
                if not looks_like_aiperf(obj):
                    got = json_kind(obj) if not isinstance(obj, dict) else "an object without a 'turns' list"
                    raise TraceError(f"expected an aiperf multi-turn conversation, got {got}")
                sid = obj.get("session_id")
                if sid is None:
                    sid = f"{stem}-{lineno}"
                elif type(sid) is not str or not sid:
                    raise TraceError(f"expected a non-empty string, got {_show(sid)}", field="session_id")
                conv = convs.setdefault(sid, _Conversation())
                turns.extend(_turns_of(obj, conv, sid, lineno << 20, next_id))
            except TraceError as e:
                located = TraceError(e.detail, path=p, line=lineno, field=e.field)
                if on_error is None:
                    raise located from None
                on_error(located)
    turns.sort(key=lambda t: (t.arrival_ms, t.order))
    t0 = turns[0].arrival_ms if turns else 0.0
    for t in turns:
        parent = f"{t.session}#{t.index - 1}" if t.index > 1 else ""
        yield TraceRequest(
            f"{t.session}#{t.index}",
            (t.arrival_ms - t0) / 1000.0,
            t.input_tokens,
            t.output_tokens,
            t.hash_ids,
            t.session,
            parent,
            t.think_s,
        )


# The text of a written turn: a tag naming it, so no two conversations share a leading block,
# then filler to its length (ASCII: one byte a character).
_FILLER = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "


def _text(tag: str, tokens: int) -> str:
    size = tokens * BYTES_PER_TOKEN
    head = f"[{tag}] "
    body = _FILLER * (size // len(_FILLER) + 1)
    return (head + body)[:size] if size > len(head) else head[:size]


def _round_ms(seconds: float) -> int | float:
    ms = round(seconds * 1000.0, 3)
    return int(ms) if ms.is_integer() else ms


def write_aiperf(path: str | Path, trace: Trace) -> None:
    """Write `trace` as aiperf multi-turn JSONL that aiperf replays closed loop.

    Each session becomes a conversation: its first turn with its trace time as `timestamp`, each
    follow-up with `delay` = its stated think time, else its trace gap from its parent (which
    holds the original answer time too: aiperf waits that long after the answer). A turn's `text`
    is its new tokens (its prompt less its parent's prompt and answer, which aiperf resends) at 4
    bytes a token. A turn that cannot continue its conversation so (a second follow-up of one
    parent: aiperf's conversations are chains; a prompt shorter than the history it would resend)
    starts a conversation of its own with its whole prompt. Every turn also carries the testbed's
    own `input_length` and `arrival_ms`, which aiperf ignores, so the file reads back exactly.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    plan, _ = session_plan(trace)
    reqs = trace.requests
    conv_of: list[int] = [0] * len(reqs)  # request -> its conversation's index in `convs`
    convs: list[tuple[str, list[dict[str, object]]]] = []
    continued: set[int] = set()  # requests a turn already follows in the file
    names: set[str] = set()
    for i, r in enumerate(reqs):
        par = plan.parent[i]
        new = r.input_tokens
        if par != ROOT and par not in continued:
            new = r.input_tokens - reqs[par].input_tokens - reqs[par].output_tokens
        turn: dict[str, object]
        if par != ROOT and par not in continued and new >= MIN_TOKENS:
            continued.add(par)
            c = conv_of[par]
            think = r.think_s if math.isfinite(r.think_s) else plan.gap[i]
            turn = {"text": _text(f"{convs[c][0]} {len(convs[c][1]) + 1}", new), "delay": _round_ms(think)}
        else:
            c = len(convs)
            name = r.session_id or r.request_id
            name = name if name not in names else f"{name}~{r.request_id}"
            names.add(name)
            convs.append((name, []))
            turn = {"text": _text(f"{convs[c][0]} 1", r.input_tokens), "timestamp": _round_ms(r.timestamp)}
        conv_of[i] = c
        turn.update(output_length=r.output_tokens, input_length=r.input_tokens, arrival_ms=_round_ms(r.timestamp))
        convs[c][1].append(turn)
    with p.open("w", encoding="utf-8", newline="\n") as f:
        for name, turns in convs:
            f.write(json.dumps({"session_id": name, "turns": turns}))
            f.write("\n")
