"""Read link profiles from `netem_profiles/` (or a path), with errors naming file and field."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from testbed.core.linkprofile import LinkProfile

PROFILE_DIR = Path(__file__).resolve().parent.parent / "netem_profiles"


class ProfileError(ValueError):
    pass


def profile_path(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.exists():
        return p
    cand = PROFILE_DIR / f"{p}.yaml"
    if cand.exists():
        return cand
    known = sorted(f.stem for f in PROFILE_DIR.glob("*.yaml"))
    raise ProfileError(f"link profile {str(name_or_path)!r} not found (a path, or one of: {', '.join(known)})")


def load_profile(name_or_path: str | Path) -> LinkProfile:
    path = profile_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ProfileError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: top level must be a mapping")
    try:
        return LinkProfile.model_validate(data)
    except ValidationError as e:
        lines = [f"{path}: invalid link profile"]
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
            lines.append(f"  field '{loc}': {err['msg']}")
        raise ProfileError("\n".join(lines)) from None


def all_profiles() -> list[str]:
    return sorted(f.stem for f in PROFILE_DIR.glob("*.yaml"))
