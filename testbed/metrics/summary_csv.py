"""`testbed compare --csv`: the summaries of several runs as one CSV, a row per run, for a
spreadsheet or pandas: the run's label, directory and validity, then every figure of its
summary.json flattened to dotted columns (lists and per-name dicts, e.g. `links`, are left out:
their keys differ from run to run)."""

from __future__ import annotations

import csv
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from testbed.core.errors import UserError
from testbed.core.json_types import JSONObject
from testbed.metrics.verdict import RunOutcome

# Sections keyed by names (their columns would differ from run to run) or holding lists.
SKIPPED = frozenset(
    {
        "links",
        "link_phases",
        "requests.failure_reasons",
        "control.changes",
        "long_term.changes",
        "long_term.decisions",
        "wan_link.links",
        "timeseries.metrics",
        "validity.reasons",
    }
)


def flatten(d: JSONObject, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in d.items():
        key = f"{prefix}{k}"
        if key in SKIPPED or isinstance(v, list):
            continue
        if isinstance(v, dict):
            yield from flatten(v, key + ".")
        else:
            yield key, v


def write_summary_csv(path: Path, runs: Sequence[RunOutcome]) -> Path:
    """One row per run; columns in the order of first appearance, blank where a run lacks one."""
    rows: list[JSONObject] = []
    for r in runs:
        row: JSONObject = {
            "label": r.label,
            "run_dir": str(r.run_dir),
            "valid": r.summary.valid,
            "invalid_reasons": "; ".join(r.reasons),
        }
        row.update(flatten(r.summary.to_json_dict()))
        rows.append(row)
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(columns))
            w.writeheader()
            w.writerows(rows)
    except OSError as e:
        raise UserError(f"{path}: cannot write the CSV ({e.strerror or e})") from None
    return path
