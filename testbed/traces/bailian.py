"""Alibaba Bailian usage traces (qwen-bailian-usagetraces-anon), as aiperf's `bailian_trace`
reads them: Mooncake-like JSONL whose sessions are stated.

One JSON object a line: `chat_id` (an integer naming the request), `parent_chat_id` (the
`chat_id` of the turn it follows; -1 for a first turn), `turn` (1 for a first turn),
`timestamp` in **seconds**, `input_length`, `output_length`, `type` (text, search, image, file)
and `hash_ids` of **16-token** blocks. Read by the Mooncake reader (`iter_mooncake`, which
takes the same session fields) with seconds for ms; the 16-token blocks are the format's
`block_tokens`. `turn` and `type` are not needed: the parents give the turns.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

from testbed.core.schema.limits import MAX_HASH_ID
from testbed.traces.mooncake import iter_mooncake
from testbed.traces.sessions import session_plan
from testbed.traces.types import Trace, TraceError, TraceRequest

BAILIAN_BLOCK_TOKENS = 16
# The keys that tell a Bailian line from a Mooncake one with sessions (which has no `turn`).
BAILIAN_KEYS = ("chat_id", "parent_chat_id", "turn")


def looks_like_bailian(obj: object) -> bool:
    return isinstance(obj, dict) and all(k in obj for k in BAILIAN_KEYS)


def iter_bailian(path: str | Path, *, on_error: Callable[[TraceError], None] | None = None) -> Iterator[TraceRequest]:
    """Stream a Bailian trace's requests (see `iter_mooncake`: ids, rebasing, errors)."""
    return iter_mooncake(path, on_error=on_error, seconds=True)


def refine_hashes(ids: tuple[int, ...], factor: int, tokens: int) -> list[int]:
    """Block ids `factor` times finer: block h becomes h*factor .. h*factor+factor-1, cut to the
    blocks of `tokens` (equal blocks stay equal, different ones stay different)."""
    need = -(-tokens // BAILIAN_BLOCK_TOKENS)
    return [h * factor + j for h in ids for j in range(factor)][:need]


def write_bailian(path: str | Path, trace: Trace) -> None:
    """Write `trace` as a Bailian trace: chat ids are 0, 1, ... in arrival order; hash ids of a
    trace whose blocks are a multiple of 16 tokens are split into 16-token ones (`refine_hashes`),
    any other block size is refused (its hash ids would be misread)."""
    factor, rest = divmod(trace.block_tokens, BAILIAN_BLOCK_TOKENS)
    if rest or not factor:
        raise ValueError(
            f"Bailian traces use {BAILIAN_BLOCK_TOKENS}-token blocks; this trace has {trace.block_tokens}, "
            "not a multiple of them"
        )
    if factor > 1 and any(h > MAX_HASH_ID // factor for r in trace.requests for h in r.hash_ids):
        raise ValueError(f"hash ids too large to split {trace.block_tokens}-token blocks into 16-token ones")
    plan, _ = session_plan(trace)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8", newline="\n") as f:
        for i, r in enumerate(trace.requests):
            rec: dict[str, object] = {
                "chat_id": i,
                "parent_chat_id": plan.parent[i],  # ROOT is -1, as the format has it
                "timestamp": round(r.timestamp, 6),
                "input_length": r.input_tokens,
                "output_length": r.output_tokens,
                "type": "text",
                "turn": plan.turn[i],
                "hash_ids": list(r.hash_ids) if factor == 1 else refine_hashes(r.hash_ids, factor, r.input_tokens),
            }
            if math.isfinite(r.think_s):
                rec["think_time"] = round(r.think_s, 6)
            f.write(json.dumps(rec))
            f.write("\n")
