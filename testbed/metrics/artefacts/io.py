"""Reading and writing the versioned JSON files of a run directory.

Every file carries `schema_version` (an int). A file without one was written before the files
were typed and reads as version 1; a file newer than `model.VERSION` is refused, naming the
file and version, because silently dropping what a newer writer added would misreport it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from testbed.core.errors import UserError
from testbed.core.finite_json import dumps as finite_dumps
from testbed.core.json_types import JSONObject

LEGACY_VERSION = 1  # what a file without `schema_version` is


class RunDirError(UserError, ValueError):
    """A run-directory file is missing, not JSON, or does not match its model; the message
    names the file (and the field). A ValueError too, for callers that catch those."""


class Artefact(BaseModel):
    """A versioned run-directory JSON file. Unknown keys are errors (`extra="forbid"`), so the
    model cannot drift from what the writers write; sections keyed by names (nodes, links,
    reasons) are plain dicts of typed values."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    VERSION: ClassVar[int]

    schema_version: int

    def to_json_dict(self) -> JSONObject:
        """The file's content: only the keys that were set, in field order, so a file read and
        written again keeps its keys (an absent section stays absent)."""
        out: JSONObject = self.model_dump(mode="json", by_alias=True, exclude_unset=True)
        return out


class Section(BaseModel):
    """A nested object of an artefact: its keys are fixed."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


A = TypeVar("A", bound=Artefact)


def field_path(err: ValidationError) -> str:
    """The first error as `dotted.field: message`, for a one-line UserError."""
    e = err.errors()[0]
    where = ".".join(str(p) for p in e["loc"]) or "(top level)"
    return f"{where}: {e['msg']}"


def parse_artefact(raw: Any, model: type[A], where: str) -> A:
    """Validate a decoded JSON value as `model`; `where` (the file) names it in errors."""
    if not isinstance(raw, dict):
        raise RunDirError(f"{where}: expected a JSON object")
    version = raw.get("schema_version", LEGACY_VERSION)
    if isinstance(version, bool) or not isinstance(version, int):
        raise RunDirError(f"{where}: schema_version: expected an integer, got {version!r}")
    if version > model.VERSION:
        raise RunDirError(
            f"{where}: schema_version {version} is newer than this testbed reads "
            f"(up to {model.VERSION}); update the testbed to read it"
        )
    data = {**raw, "schema_version": version}
    try:
        # Version 1 differs from 2 only by the missing key: one model reads both.
        return model.model_validate(data)
    except ValidationError as e:
        raise RunDirError(f"{where}: {field_path(e)}") from None


def read_artefact(path: Path, model: type[A]) -> A:
    """Read `path` as `model`: RunDirError (one line, naming the file) when it is missing,
    not JSON, newer than this code, or malformed."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise RunDirError(f"{path}: missing; is {Path(path).parent} a run directory?") from None
    except OSError as e:
        raise RunDirError(f"{path}: cannot read: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise RunDirError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    return parse_artefact(raw, model, str(path))


def write_artefact(path: Path, artefact: Artefact, indent: int = 2, atomic: bool = True) -> None:
    """Write `artefact` as strict JSON, a non-finite float as null; `atomic` writes then renames,
    so a reader never sees half a file."""
    text = finite_dumps(artefact.to_json_dict(), indent=indent) + ("\n" if atomic else "")
    path = Path(path)
    if not atomic:
        path.write_text(text)
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
