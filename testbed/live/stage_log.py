"""A node's own stage stamps, one JSON line per request and stage group, keyed by request id
(`<run_dir>/stages/<node>.jsonl`). Under a foreign router the run's records are these lines
joined by request id: nothing a record holds comes from the router."""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO

from testbed.live.common import ServiceConfig

StageValue = float | int | str | None
# The field of the testbed router's final chunk naming the id the nodes logged a request under,
# when they speak an engine's protocol (the join key of its stage lines).
NODE_REQUEST_ID = "testbed_node_request_id"


class StageLog:
    def __init__(self, cfg: ServiceConfig) -> None:
        self.node = cfg.node_id
        n = cfg.deployment.nodes.get(cfg.node_id)
        self.where = {"cluster": n.cluster, "datacenter": n.datacenter} if n is not None else {}
        rd = cfg.deployment.run_dir
        self._f: IO[str] | None = None
        if rd:
            path = Path(rd) / "stages" / f"{cfg.node_id}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._f = path.open("a", buffering=1)  # line-buffered: a crash loses no finished line
        self.lines: list[dict[str, StageValue]] = []  # kept for tests when there is no run directory

    def write(self, request_id: str, **stamps: StageValue) -> None:
        line: dict[str, StageValue] = {"request_id": request_id, "node": self.node, **self.where, **stamps}
        if self._f is not None:
            self._f.write(json.dumps(line) + "\n")
        else:
            self.lines.append(line)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
