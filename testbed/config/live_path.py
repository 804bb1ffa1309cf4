"""Where the simulator's live-path costs come from (`sim.live_path` of a scenario): nothing, this
host's figures (measured by `testbed bench live-path` and kept per host), a figures file, or
the figures written into the scenario (`testbed.core.schema.live_path`)."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from testbed.config.scenarios import ScenarioError
from testbed.core.schema.live_path import LivePathCosts
from testbed.core.schema.scenario import LivePathSpec, Scenario


def host_file() -> Path:
    """This host's figures: `$XDG_CACHE_HOME/prfaas-testbed/live-path-<host>.json` (default ~/.cache)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "prfaas-testbed" / f"live-path-{socket.gethostname()}.json"


def read_costs(path: Path, where: str) -> LivePathCosts:
    try:
        data: Any = json.loads(path.read_text())
    except OSError as e:
        raise ScenarioError(f"{where}: cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ScenarioError(f"{where}: {path} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ScenarioError(f"{where}: {path}: not a JSON object")
    try:
        return LivePathCosts.from_dict(data, str(path))
    except ValueError as e:
        raise ScenarioError(f"{where}: {path}: {e}") from None


def live_path_costs(spec: Scenario, source: str = "") -> LivePathCosts:
    """The costs `spec.sim.live_path` names (a UserError naming the field if they cannot be had)."""
    lp = spec.sim.live_path
    where = f"{source or spec.name}: field 'sim.live_path'"
    if isinstance(lp, LivePathSpec):
        d = lp.model_dump()
        if "relay_last_s" not in lp.model_fields_set:  # one relay given: both tokens pay it
            d["relay_last_s"] = d["relay_s"]
        return LivePathCosts(**d, source="scenario")
    if lp == "none":
        return LivePathCosts()
    if lp == "host":
        f = host_file()
        if not f.is_file():
            raise ScenarioError(f"{where}: 'host', but this host has no figures ({f}): run `testbed bench live-path`")
        return read_costs(f, where)
    p = Path(lp)
    if not p.is_absolute() and source:
        rel = Path(source).parent / p
        p = rel if rel.exists() else p
    return read_costs(p, where)


def save_host_costs(figures: Mapping[str, object]) -> Path:
    f = host_file()
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(figures, indent=1) + "\n")
    return f
