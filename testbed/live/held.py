"""Records of the requests outside clients send to a held deployment (`testbed up --hold`).

A replay's client writes records.csv itself; an outside load generator does not, so when the
deployment is held the router writes one record per request it answered, success or failure,
in the run directory. What the client observes (arrival, first and last token) is stamped at the
router: when the request came in and when its first and last token chunks went out. Times are
relative to the hold's t0, which the hold posts once every service is up (`POST /testbed/hold`);
a request that ends before that waits in memory, and at shutdown without one the router's own
start is the base.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path

from aiohttp import web

from testbed.core.record import RequestRecord
from testbed.live.clock import now
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
