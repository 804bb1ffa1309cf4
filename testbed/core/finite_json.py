"""Strict JSON for what a run writes: every float finite or null.

`json.dumps` writes `Infinity`/`NaN` by default (not JSON: other readers refuse the file) and
raises mid-write with `allow_nan=False` (a half-made run directory). A value with no finite
figure (a rate over no time, a mean of nothing) means "undefined", which JSON spells null.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """`value` with every non-finite float inside (dict values, list/tuple items) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(value: Any, **kw: Any) -> str:
    """`json.dumps` of `finite(value)`; `allow_nan=False` stays as the guard that nothing slipped."""
    return json.dumps(finite(value), allow_nan=False, **kw)
