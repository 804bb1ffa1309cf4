"""Read scenario YAML files: `extends` chains, deep merge, validation errors naming file and field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from testbed.core.scenario import ModelProfile, Scenario

SCENARIO_DIR = Path(__file__).resolve().parent.parent / "scenarios"
MODEL_DIR = SCENARIO_DIR / "models"


class ScenarioError(ValueError):
    """An invalid scenario: the message names the file and each offending field."""


def resolve_path(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.exists():
        return p
    for cand in (SCENARIO_DIR / f"{p}.yaml", SCENARIO_DIR / str(p)):
        if cand.exists():
            return cand
    known = sorted(f.stem for f in SCENARIO_DIR.glob("*.yaml")) if SCENARIO_DIR.is_dir() else []
    raise ScenarioError(f"scenario {str(name_or_path)!r} not found (a path, or one of: {', '.join(known)})")


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _read_raw(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    if path.resolve() in seen:
        raise ScenarioError(f"{path}: 'extends' loops back to itself")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ScenarioError(f"{path}: not valid YAML: {e}") from None
    except OSError as e:
        raise ScenarioError(f"{path}: cannot read: {e.strerror}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    out: dict[str, Any] = data
    parents = out.pop("extends", None)
    if parents is not None:
        # One parent, or a list merged left to right (a later one wins), then this file on top:
        # e.g. [base/paper.yaml, models/minimax-m2.5.yaml] swaps the model into a deployment.
        names = [parents] if isinstance(parents, str) else parents
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise ScenarioError(f"{path}: field 'extends' must be a file name or a list of file names")
        merged: dict[str, Any] = {}
        for name in names:
            ppath = (path.parent / name) if not Path(name).is_absolute() else Path(name)
            merged = _deep_merge(merged, _read_raw(ppath, seen + (path.resolve(),)))
        out = _deep_merge(merged, out)
    return out


def format_validation_error(source: str, err: ValidationError) -> str:
    lines = [f"{source}: invalid scenario ({err.error_count()} error{'s' if err.error_count() != 1 else ''})"]
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        lines.append(f"  field '{loc}': {e['msg']}")
    return "\n".join(lines)


def validate(data: dict[str, Any], source: str = "<scenario>") -> Scenario:
    try:
        return Scenario.model_validate(data)
    except ValidationError as e:
        raise ScenarioError(format_validation_error(source, e)) from None


def load_scenario(name_or_path: str | Path, overrides: dict[str, Any] | None = None) -> Scenario:
    """Load, merge `extends` parents and `overrides` (a nested dict), validate."""
    path = resolve_path(name_or_path)
    data = _read_raw(path)
    if overrides:
        data = _deep_merge(data, overrides)
    return validate(data, str(path))


def dump_scenario(sc: Scenario) -> str:
    return yaml.safe_dump(sc.model_dump(mode="json"), sort_keys=False)


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`a.b.c=value` pairs (value parsed as YAML) -> nested dict."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ScenarioError(f"override {pair!r} must look like field.path=value")
        key, raw = pair.split("=", 1)
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(raw)
    return out


def model_profiles() -> list[str]:
    """Names of the shipped model profiles (scenarios/models/NAME.yaml)."""
    return sorted(f.stem for f in MODEL_DIR.glob("*.yaml")) if MODEL_DIR.is_dir() else []


def load_model_profile(name_or_path: str | Path) -> ModelProfile:
    """A model profile on its own (its `model` and `hardware` blocks), validated."""
    p = Path(name_or_path)
    if not p.exists():
        p = MODEL_DIR / f"{name_or_path}.yaml"
        if not p.exists():
            raise ScenarioError(f"model profile {str(name_or_path)!r} not found (a path, or one of: "
                                f"{', '.join(model_profiles())})")
    data = _read_raw(p)
    try:
        return ModelProfile.model_validate(data)
    except ValidationError as e:
        msg = format_validation_error(str(p), e).replace("invalid scenario", "invalid model profile", 1)
        raise ScenarioError(msg) from None
