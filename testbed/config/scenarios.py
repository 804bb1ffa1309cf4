"""Read scenario YAML files: `extends` chains, deep merge, validation errors naming file and field."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import yaml

from testbed.config.loader import origin_of, read_mapping
from testbed.config.loader import validate as validate_model
from testbed.core.errors import UserError
from testbed.core.schema.scenario import ModelProfile, Scenario

SCENARIO_DIR = Path(__file__).resolve().parents[2] / "scenarios"
MODEL_DIR = SCENARIO_DIR / "models"
# Where each source's model profiles live, by the source's name: the paper-derived ones (back-solved
# from its Table 3) and those sampled from a measured-kernel database (`testbed profile`).
PROFILE_SOURCES: dict[str, Path] = {"paper": MODEL_DIR, "aiconfigurator": MODEL_DIR / "aiconfigurator"}


class ScenarioError(UserError, ValueError):
    """An invalid scenario: the message names the file and each offending field."""


# The top-level keys a scenario file (or a part it extends, such as a model profile) may hold.
_SCENARIO_KEYS = (*Scenario.model_fields, "extends")


def resolve_path(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.exists():
        return p
    for cand in (SCENARIO_DIR / f"{p}.yaml", SCENARIO_DIR / str(p)):
        if cand.exists():
            return cand
    known = sorted(f.stem for f in SCENARIO_DIR.glob("*.yaml")) if SCENARIO_DIR.is_dir() else []
    raise ScenarioError(f"scenario {str(name_or_path)!r} not found (a path, or one of: {', '.join(known)})")


def _same_kind(a: Mapping[str, object], b: Mapping[str, object]) -> bool:
    return "kind" not in a or "kind" not in b or a["kind"] == b["kind"]


def _deep_merge(base: Mapping[str, object], over: Mapping[str, object]) -> dict[str, object]:
    """`over` on top of `base`, mappings merged key by key. A mapping of another `kind` (a prefill
    table over a polynomial) replaces the one below: the other kind's fields would not fit it."""
    out = dict(base)
    for k, v in over.items():
        below = out.get(k)
        if isinstance(v, dict) and isinstance(below, dict) and _same_kind(below, v):
            out[k] = _deep_merge(below, v)
        else:
            out[k] = v
    return out


def _read_raw(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, object]:
    if path.resolve() in seen:
        raise ScenarioError(f"{path}: 'extends' loops back to itself")
    out = read_mapping(path, ScenarioError, "scenario", _SCENARIO_KEYS)
    parents = out.pop("extends", None)
    if parents is not None:
        # One parent, or a list merged left to right (a later one wins), then this file on top:
        # e.g. [base/paper.yaml, models/minimax-m2.5.yaml] swaps the model into a deployment.
        names = [parents] if isinstance(parents, str) else parents
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise ScenarioError(f"{path}: field 'extends' must be a file name or a list of file names")
        merged: dict[str, object] = {}
        for name in names:
            ppath = (path.parent / name) if not Path(name).is_absolute() else Path(name)
            merged = _deep_merge(merged, _read_raw(ppath, seen + (path.resolve(),)))
        out = _deep_merge(merged, out)
    return out


def validate(data: Mapping[str, object], source: str = "<scenario>", origins: dict[str, str] | None = None) -> Scenario:
    """`data` as a Scenario; `origins` (dotted path -> `--set a.b=v`) names the override an
    error is in instead of `source`."""
    found = origins or {}
    return validate_model(
        Scenario, data, source, "scenario", ScenarioError, (lambda loc: origin_of(found, loc)) if found else None
    )


def override_origins(overrides: Mapping[str, object] | None) -> dict[str, str]:
    """What `overrides` says of where its values came from (`overrides.Overrides`), else nothing."""
    return dict(getattr(overrides, "origins", None) or {})


def load_scenario(name_or_path: str | Path, overrides: Mapping[str, object] | None = None) -> Scenario:
    """Load, merge `extends` parents and `overrides` (a nested dict), validate."""
    path = resolve_path(name_or_path)
    data = _read_raw(path)
    if overrides:
        data = _deep_merge(data, overrides)
    return validate(data, str(path), override_origins(overrides))


def dump_scenario(sc: Scenario) -> str:
    return yaml.safe_dump(sc.model_dump(mode="json"), sort_keys=False)


def _source_dir(source: str) -> Path:
    if source not in PROFILE_SOURCES:
        raise ScenarioError(f"profile source {source!r} is not one of: {', '.join(PROFILE_SOURCES)}")
    return PROFILE_SOURCES[source]


def model_profiles(source: str = "paper") -> list[str]:
    """Names of the shipped model profiles of a source (scenarios/models/NAME.yaml for the paper's)."""
    d = _source_dir(source)
    return sorted(f.stem for f in d.glob("*.yaml")) if d.is_dir() else []


def profile_sources(name: str) -> list[str]:
    """The sources that ship a profile of model `name`, in PROFILE_SOURCES' order."""
    return [s for s, d in PROFILE_SOURCES.items() if (d / f"{name}.yaml").is_file()]


def load_model_profile(name_or_path: str | Path, source: str = "paper") -> ModelProfile:
    """A model profile on its own (its `model` and `hardware` blocks), validated: a path, or the
    name of one that `source` ships."""
    p = Path(name_or_path)
    if not p.exists():
        p = _source_dir(source) / f"{name_or_path}.yaml"
        if not p.exists():
            raise ScenarioError(
                f"model profile {str(name_or_path)!r} not found (a path, or one of the {source} "
                f"profiles: {', '.join(model_profiles(source)) or 'none'})"
            )
    return validate_model(ModelProfile, _read_raw(p), str(p), "model profile", ScenarioError)
