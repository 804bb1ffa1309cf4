"""Records of the requests outside clients send to a held deployment (`testbed up --hold`).

A replay's client writes records.csv itself; an outside load generator does not, so when the
deployment is held the router writes one record per request it answered, success or failure,
in the run directory. What the client observes (arrival, first and last token) is stamped at the
router: when the request came in and when its first and last token chunks went out. Times are
relative to the hold's t0, which the hold posts once every service is up (`POST /testbed/hold`);
a request that ends before that waits in memory, and at shutdown without one the router's own
start is the base.

Behind a foreign router (`router.kind`) nothing is stamped at the router: at the end of the hold
`write_stage_records` writes the records from the nodes' own stage logs joined by the request id
the nodes saw (`testbed.metrics.node_stages`). The client's stamps come from the serving edge in
front of the router (`testbed.live.edge`: arrival when the request came in, first and last token
when they went out); a request the edge did not see (a client that reached the router directly)
takes its arrival at the first node it reached and its tokens at the decode node.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from pathlib import Path

from aiohttp import web

from testbed.core.failures import Failure
from testbed.core.failures import FailureKind as K
from testbed.core.record import RequestRecord
from testbed.live.clock import now
from testbed.live.edge import EDGE_LOG, EdgeLine, read_edge_log
from testbed.metrics.node_stages import NodeStages, StageLine, fill_record
from testbed.metrics.records import RecordWriter

log = logging.getLogger("testbed.held")
# Deployment.extra[HOLD_KEY] = {"records": "records.csv"} (relative to the run directory)
HOLD_KEY = "hold"
HOLD_PATH = "/testbed/hold"
MAX_PENDING = 10_000  # records kept while the t0 has not come (a client racing the hold's start)


def hold_records_path(extra: Mapping[str, object], run_dir: str | None) -> Path | None:
    """Where the router writes records, when the deployment is held and has a run directory."""
    cfg = extra.get(HOLD_KEY)
    if not isinstance(cfg, dict) or not run_dir:
        return None
    name = cfg.get("records", "records.csv")
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise ValueError(f"deployment extra {HOLD_KEY}.records must be a relative file name, got {name!r}")
    return Path(run_dir) / name


class HeldRecords:
    """One CSV row per request, times relative to t0 (unix seconds)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.started = now()
        self.t0: float | None = None
        self._writer: RecordWriter | None = None
        self._pending: list[RequestRecord] = []
        self.count = 0
        self._turns: dict[str, int] = {}  # session -> turns that arrived so far

    def next_turn(self, session: str) -> int:
        """The turn index (1, 2, ...) of a request of `session` arriving now; 0 without a session."""
        if not session:
            return 0
        self._turns[session] = turn = self._turns.get(session, 0) + 1
        return turn

    def set_t0(self, t0: float) -> None:
        if self.t0 is not None and self.t0 != t0:
            raise ValueError(f"t0 is already {self.t0}")
        self.t0 = t0
        self._open()

    def _open(self) -> None:
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._writer = RecordWriter(self.path)
        pending, self._pending = self._pending, []
        for rec in pending:
            self._write(rec)

    def _write(self, rec: RequestRecord) -> None:
        assert self._writer is not None and self.t0 is not None
        self._writer.write(dataclasses.replace(rec, times=rec.times.since(self.t0)))
        self.count += 1

    def add(self, rec: RequestRecord) -> None:
        """Record a finished request (unix-second stamps); the caller's record is not changed."""
        if self._writer is not None:
            self._write(rec)
        elif len(self._pending) < MAX_PENDING:
            self._pending.append(rec)
        else:
            log.warning("request %s: not recorded, the hold never sent its t0", rec.request_id)

    def close(self) -> None:
        if self._pending or self._writer is None:
            if self.t0 is None:
                self.t0 = self.started
                if self._pending:
                    log.warning(
                        "the hold never sent its t0: %d records relative to the router's start", len(self._pending)
                    )
            self._open()
        assert self._writer is not None
        self._writer.close()


HELD_KEY = web.AppKey("held_records", HeldRecords)


async def post_hold(request: web.Request) -> web.Response:
    """POST /testbed/hold {"t0": unix seconds}: the base of every record's times."""
    held = request.app[HELD_KEY]
    try:
        body = await request.json()
        t0 = body["t0"]
        if isinstance(t0, bool) or not isinstance(t0, (int, float)):
            raise TypeError
        held.set_t0(float(t0))
    except (ValueError, KeyError, TypeError) as e:
        raise web.HTTPBadRequest(text=f'expected {{"t0": unix seconds}}: {e}') from None
    return web.json_response({"records": str(held.path), "written": held.count})


def _num(line: StageLine, key: str) -> float:
    v = line.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def _first(lines: list[StageLine], stage: str, key: str) -> float:
    return next((v for x in lines if x.get("stage") == stage and not math.isnan(v := _num(x, key))), math.nan)


def stage_record(
    request_id: str, index: int, lines: list[StageLine], t0: float, edge: EdgeLine | None = None
) -> RequestRecord:
    """One request of a held deployment behind a foreign router, from what the nodes logged
    (unix-second stamps; the record's relative to `t0`) and, when the serving edge passed it,
    the client's stamps from there."""
    rec = RequestRecord(request_id, index, 0, 0)
    error = fill_record(rec, lines, t0)
    inp = _first(lines, "prefill", "input_tokens")
    if math.isnan(inp):
        inp = _first(lines, "decode", "input_tokens")
    out = _first(lines, "decode", "output_tokens")
    rec.input_tokens = 0 if math.isnan(inp) else int(inp)
    rec.output_tokens = rec.tokens_received = 0 if math.isnan(out) else int(out)
    arrivals = (_first(lines, "prefill", "prefill_arrival"), _first(lines, "decode", "decode_arrival"))
    known = [v for v in arrivals if not math.isnan(v)]
    t = rec.times
    t.arrival = min(known) - t0 if known else math.nan
    t.first_token, t.last_token = t.decode_first_token, t.decode_last_token
    if edge is not None:
        t.arrival = edge.arrival - t0
        if edge.first_token is not None and edge.last_token is not None:
            t.first_token, t.last_token = edge.first_token - t0, edge.last_token - t0
    stages = {x.get("stage") for x in lines}
    if not lines:  # the edge passed it, no node logged it
        rec.fail(Failure(K.ROUTER_ERROR), (edge.error if edge is not None else "") or "no node logged it")
    elif error is not None:
        rec.fail(Failure(K.KV_TRANSFER if "kv " in error.lower() else K.DECODE_ERROR), error)
    elif "decode" not in stages:
        why = "its KV expired unpulled" if "kv_expired" in stages else "no decode node logged it"
        rec.fail(Failure(K.ROUTER_ERROR), f"prefilled, never decoded: {why}")
    elif "prefill" not in stages:
        rec.fail(Failure(K.ROUTER_ERROR), "decoded, but no prefill node logged it")
    elif math.isnan(t.first_token):
        rec.fail(Failure(K.CLIENT_GONE), "the decode node sent no token")
    else:
        rec.outcome = "completed"
    return rec


def stage_records(run_dir: Path, t0: float) -> list[RequestRecord]:
    """Every request the nodes of `run_dir` logged or its serving edge passed, in arrival order."""
    by_id = NodeStages(run_dir).requests()
    edge = read_edge_log(run_dir / EDGE_LOG)
    recs = [stage_record(rid, 0, lines, t0, edge.get(rid)) for rid, lines in by_id.items()]
    recs += [stage_record(rid, 0, [], t0, e) for rid, e in edge.items() if rid not in by_id]
    recs.sort(key=lambda r: (math.inf if math.isnan(r.times.arrival) else r.times.arrival, r.request_id))
    for i, r in enumerate(recs):
        r.trace_index = i
    return recs


def write_stage_records(run_dir: Path, t0: float, name: str = "records.csv") -> int:
    """records.csv of a held deployment behind a foreign router; returns how many."""
    recs = stage_records(run_dir, t0)
    w = RecordWriter(run_dir / name)
    try:
        for r in recs:
            w.write(r)
    finally:
        w.close()
    return len(recs)
