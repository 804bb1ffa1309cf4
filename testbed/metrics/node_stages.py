"""A request's record from the nodes' own stage logs (`<run_dir>/stages/<node>.jsonl`, one JSON
line per request and stage group, written by `testbed.live.stage_log`), joined by the request id
the nodes saw. Under a foreign router nothing in a record comes from the router: the client
knows when it sent and what it received, the nodes know the rest."""

from __future__ import annotations

import json
import math
from pathlib import Path

from testbed.core.record import CLIENT_TIMES, TIME_NAMES, RequestRecord

StageLine = dict[str, float | int | str | None]


class NodeStages:
    """Reads the stage logs as they grow (each file from where it stopped), so that the record
    of a request that just finished can be built while the run goes on."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "stages"
        self._offsets: dict[Path, int] = {}
        self._by_request: dict[str, list[StageLine]] = {}

    def _refresh(self) -> None:
        if not self.dir.is_dir():
            return
        for path in sorted(self.dir.glob("*.jsonl")):
            start = self._offsets.get(path, 0)
            with path.open("rb") as f:
                f.seek(start)
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line being written is read next time
            for raw in data[:end].splitlines():
                line = json.loads(raw)
                if isinstance(line, dict) and isinstance(line.get("request_id"), str):
                    self._by_request.setdefault(line["request_id"], []).append(line)
            self._offsets[path] = start + end

    def requests(self) -> dict[str, list[StageLine]]:
        """Every request id the logs hold so far, with its lines, in the order first read."""
        self._refresh()
        return dict(self._by_request)

    def lines(self, request_id: str, last_stage: str = "decode") -> list[StageLine]:
        """What the nodes logged for `request_id`, read afresh unless `last_stage` is there (its
        earlier stages may have been read while the request was still running)."""
        if not any(x.get("stage") == last_stage for x in self._by_request.get(request_id, [])):
            self._refresh()
        return self._by_request.get(request_id, [])


def _f(v: float | int | str | None) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def _i(v: float | int | str | None) -> int:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else 0


def fill_record(rec: RequestRecord, lines: list[StageLine], t0: float) -> str | None:
    """Put what the nodes logged for one request into `rec` (stamps relative to `t0`); returns
    the first error a node logged, or None."""
    error: str | None = None
    for line in lines:
        stage = line.get("stage")
        for name in TIME_NAMES:
            if name in line and name not in CLIENT_TIMES:
                v = _f(line[name])
                if not math.isnan(v):
                    setattr(rec.times, name, v - t0)
        node, cluster = str(line.get("node", "")), str(line.get("cluster", ""))
        if stage == "prefill":
            rec.prefill_node, rec.prefill_cluster = node, cluster
            rec.prefill_modelled = _f(line.get("prefill_modelled"))
            rec.kv_bytes_paper = _i(line.get("kv_bytes_paper"))
        elif stage == "decode":
            rec.decode_node, rec.decode_cluster = node, cluster
            rec.kv_bytes_wire = _i(line.get("kv_bytes_received"))
        if error is None and isinstance(line.get("error"), str) and line["error"]:
            error = f"{node}: {line['error']}"
    dcs = {str(x.get("datacenter", "")) for x in lines if x.get("stage") in ("prefill", "decode")}
    rec.crossed_wan = len(dcs) == 2
    return error
