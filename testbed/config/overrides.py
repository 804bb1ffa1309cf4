"""Field overrides (`--set a.b.c=value`): dotted paths into the scenario, list elements by
index (`clusters.0.prefill=2`), values parsed as YAML."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from testbed.config.scenarios import ScenarioError


def _index(part: str, lst: list[Any], path: str) -> int:
    if not re.fullmatch(r"\d+", part):
        raise ScenarioError(f"field {path!r}: {part!r} indexes a list and must be a number")
    i = int(part)
    if i >= len(lst):
        raise ScenarioError(f"field {path!r}: index {i} out of range (the list has {len(lst)} elements)")
    return i


def set_path(overrides: dict[str, object], resolved: Mapping[str, object], path: str, value: object) -> None:
    """Set dotted `path` to `value` in a sparse override dict meant for `load_scenario`.

    Dictionaries stay sparse (load_scenario deep-merges them). The first list on the path is copied
    whole from `resolved` (the scenario as loaded, e.g. `Scenario.model_dump(mode="json")`),
    because a merge would replace it whole; below it the copy is edited in place.
    """
    parts = path.split(".")
    if not all(parts):
        raise ScenarioError(f"field {path!r}: empty path component")
    dst: Any = overrides
    src: Any = resolved
    for part in parts[:-1]:
        if isinstance(dst, list):
            dst, src = dst[_index(part, dst, path)], None
            continue
        if not isinstance(dst, dict):
            raise ScenarioError(f"field {path!r}: {part!r} is below a value that is neither a mapping nor a list")
        src_child = src.get(part) if isinstance(src, dict) else None
        if part in dst and not isinstance(dst[part], (dict, list)):
            raise ScenarioError(f"field {path!r}: {part!r} was set to a value, it cannot also hold fields")
        if part not in dst:
            dst[part] = copy.deepcopy(src_child) if isinstance(src_child, list) else {}
        dst, src = dst[part], src_child
    last = parts[-1]
    if isinstance(dst, list):
        dst[_index(last, dst, path)] = value
    elif isinstance(dst, dict):
        dst[last] = value
    else:
        raise ScenarioError(f"field {path!r}: {last!r} is below a value that is neither a mapping nor a list")


def build_overrides(resolved: Mapping[str, object], assignments: Sequence[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for path, value in assignments:
        set_path(out, resolved, path, value)
    return out


class Overrides(dict[str, object]):
    """A sparse override dict that remembers which `--set` gave each dotted path (`origins`),
    so that an error in a value names the override rather than the scenario file."""

    def __init__(self) -> None:
        super().__init__()
        self.origins: dict[str, str] = {}


def parse_assignments(pairs: Sequence[str]) -> list[tuple[str, Any]]:
    """`--set a.b=value` pairs as (path, YAML-parsed value), kept flat so that indexed paths can
    be resolved against the scenario."""
    out: list[tuple[str, Any]] = []
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ScenarioError(f"--set {pair!r}: must look like field.path=value")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ScenarioError(f"--set {pair!r}: the value is not valid YAML ({problem})") from None
        out.append((key.strip(), value))
    return out


def overrides_for(name_or_path: str, pairs: Sequence[str]) -> dict[str, object]:
    """`--set` pairs as a sparse override dict for `load_scenario(name_or_path, ...)`; indexed
    paths are resolved against that scenario as loaded."""
    from testbed.config.scenarios import load_scenario

    assignments = parse_assignments(pairs)
    out = Overrides()
    if not assignments:
        return out
    resolved = load_scenario(name_or_path).model_dump(mode="json")
    for pair, (path, value) in zip(pairs, assignments):
        try:
            set_path(out, resolved, path, value)
        except ScenarioError as e:
            raise ScenarioError(f"--set {pair}: {e}") from None
        out.origins[path] = f"--set {pair}"
    return out
