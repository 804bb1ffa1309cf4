"""BurstGPT traces (github HPMLL/BurstGPT), CSV.

Two header layouts, columns found by name: the first releases' `Timestamp,Model,Request tokens,
Response tokens,Total tokens,Log Type` (BurstGPT_1/_2, with and without fails) and v2.0's, which
inserts `Session ID,Elapsed time` after `Timestamp` (BurstGPT_3). Only `Timestamp` (seconds; the
files count from the first day's midnight, so the first row is far from 0), `Request tokens` and
`Response tokens` are required; `Model` is needed to filter by model. The others are ignored.

Failed requests have 0 `Response tokens` (about 2% of the first files, 7% of BurstGPT_3). They
are skipped by default (they never produced output, so replaying them would add decode work that
did not happen) and counted; `keep_failed` replays them with 1 output token, the router's minimum.
A zero `Request tokens` is raised to 1 token and counted.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from pathlib import Path

import numpy as np

from testbed.core.schema.limits import MAX_INPUT_TOKENS, MAX_OUTPUT_TOKENS, MAX_TIMESTAMP_S
from testbed.traces import csvutil
from testbed.traces.csvutil import LoadStats, TokenCounts, Window, parse_seconds
from testbed.traces.types import Trace, TraceError, TraceRequest

TIMESTAMP, SESSION, ELAPSED, MODEL = "Timestamp", "Session ID", "Elapsed time", "Model"
REQUEST, RESPONSE, TOTAL, LOG_TYPE = "Request tokens", "Response tokens", "Total tokens", "Log Type"
REQUIRED = (TIMESTAMP, REQUEST, RESPONSE)
HEADER_V1 = (TIMESTAMP, MODEL, REQUEST, RESPONSE, TOTAL, LOG_TYPE)
HEADER_V2 = (TIMESTAMP, SESSION, ELAPSED, MODEL, REQUEST, RESPONSE, TOTAL, LOG_TYPE)
MODELS = ("ChatGPT", "GPT-4")
BLOCK_TOKENS = 512
_MAX_S = MAX_TIMESTAMP_S


def iter_burstgpt(
    path: str | Path,
    *,
    window: Window | None = None,
    limit: int | None = None,
    keep_failed: bool = False,
    models: Collection[str] | None = None,
    stats: LoadStats | None = None,
    on_error: Callable[[TraceError], None] | None = None,
) -> Iterator[TraceRequest]:
    """Stream requests from a BurstGPT CSV, validating each row read.

    See `csvutil.scan` for trace time, `window`, `limit`, ordering, ids and `on_error`. `models`
    keeps only rows whose `Model` is one of them (exact names, e.g. "ChatGPT", "GPT-4"). What is
    skipped or changed is counted in `stats`; counts above `testbed.core.schema.limits` are errors.
    """
    header = csvutil.read_header(path)
    cols = header.index((*REQUIRED, MODEL) if models is not None else REQUIRED, (MODEL,))
    ti, ri, oi = cols[TIMESTAMP], cols[REQUEST], cols[RESPONSE]
    mi = cols.get(MODEL, -1)
    wanted = frozenset(models) if models is not None else None
    st = stats if stats is not None else LoadStats()
    inputs, outputs = TokenCounts(MAX_INPUT_TOKENS), TokenCounts(MAX_OUTPUT_TOKENS)
    cached_input, count_input = inputs.cache.get, inputs.parse
    cached_output, count_output = outputs.cache.get, outputs.parse

    def parse(row: list[str]) -> tuple[float, int, int]:
        ts = row[ti]
        # parse_seconds' checks, inline: this runs once a row.
        if not (ts.isascii() and ts.replace(".", "", 1).isdigit()) or (t := float(ts)) > _MAX_S:
            t = parse_seconds(ts, TIMESTAMP)
        inp = cached_input(row[ri])
        if inp is None:
            inp = count_input(row[ri], REQUEST)
        out = cached_output(row[oi])
        if out is None:
            out = count_output(row[oi], RESPONSE)
        return t, inp, out

    def admit(row: list[str], inp: int, out: int) -> tuple[int, int] | None:
        if wanted is not None and row[mi] not in wanted:
            st.skipped_model += 1
            return None
        if out == 0:
            if not keep_failed:
                st.skipped_failed += 1
                return None
            out = 1
            st.kept_failed += 1
        if inp == 0:
            inp = 1
            st.raised_input += 1
        return inp, out

    return csvutil.scan(
        header,
        parse,
        admit,
        admit_all=wanted is not None,
        time_index=ti,
        time_field=TIMESTAMP,
        window=window,
        limit=limit,
        stats=st,
        on_error=on_error,
    )


BURSTGPT_VARIANTS = ("v1", "v2")


def write_burstgpt(
    path: str | Path, trace: Trace, variant: str = "v2", *, seed: int = 1, failed_share: float = 0.0
) -> None:
    """Write `trace` as BurstGPT CSV: "v1" (six columns, whole-second timestamps, as in
    BurstGPT_1) or "v2" (eight, with Session ID and Elapsed time, as in BurstGPT_3).

    Times start at 19,440,110 s, as BurstGPT_3 does. Model, log type, sessions and elapsed times
    are drawn from `seed`; a `failed_share` of the rows is written as failed (0 response tokens).
    Hash ids are dropped (the format has none).
    """
    if variant not in BURSTGPT_VARIANTS:
        raise ValueError(f"variant must be one of {BURSTGPT_VARIANTS}, got {variant!r}")
    if not 0.0 <= failed_share <= 1.0:
        raise ValueError(f"failed_share must be in [0, 1], got {failed_share}")
    n = len(trace)
    rng = np.random.default_rng(seed)
    gpt4 = rng.random(n) < 0.15
    conversation = rng.random(n) < 0.3
    failed = rng.random(n) < failed_share
    session = rng.integers(0, max(1, n // 4), size=n)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    cols = HEADER_V1 if variant == "v1" else HEADER_V2
    with p.open("w", encoding="utf-8", newline="") as f:
        f.write(",".join(cols) + "\n")
        for i, r in enumerate(trace.requests):
            model = "GPT-4" if gpt4[i] else "ChatGPT"
            log = "Conversation log" if conversation[i] else "API log"
            out = 0 if failed[i] else r.output_tokens
            ts = 19_440_110 + r.timestamp
            if variant == "v1":
                f.write(f"{int(ts)},{model},{r.input_tokens},{out},{r.input_tokens + out},{log}\n")
            else:
                sid = f"{int(session[i]):08x}-0000-4000-8000-{seed:012x}" if conversation[i] else ""
                elapsed = max(1, round(out / 40))
                f.write(f"{ts:.1f},{sid},{elapsed},{model},{r.input_tokens},{out},{r.input_tokens + out},{log}\n")


def is_burstgpt_header(columns: list[str]) -> bool:
    return csvutil.has_columns(columns, REQUIRED)
