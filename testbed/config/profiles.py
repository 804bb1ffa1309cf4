"""Read link profiles from `netem_profiles/` (or a path), with errors naming file and field."""

from __future__ import annotations

from pathlib import Path

from testbed.config.loader import read_mapping, validate
from testbed.core.errors import UserError
from testbed.core.schema.linkprofile import LinkProfile

PROFILE_DIR = Path(__file__).resolve().parents[2] / "netem_profiles"


class ProfileError(UserError, ValueError):
    """An unknown or invalid link profile: the message names the file and each offending field."""


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
    return validate(LinkProfile, read_mapping(path, ProfileError), str(path), "link profile", ProfileError)
