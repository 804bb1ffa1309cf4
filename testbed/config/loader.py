"""One YAML + pydantic loader and one error formatter for every file the user writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from testbed.config.input_files import MAX_CONFIG_BYTES, InputFileError, read_text_capped

M = TypeVar("M", bound=BaseModel)


def read_mapping(path: Path, error: type[Exception]) -> dict[str, Any]:
    """A YAML file whose top level is a mapping (an empty file is an empty mapping): a regular
    UTF-8 file of at most MAX_CONFIG_BYTES."""
    try:
        data = yaml.safe_load(read_text_capped(path, MAX_CONFIG_BYTES))
    except InputFileError as e:
        raise error(str(e)) from None
    except yaml.YAMLError as e:
        raise error(f"{path}: not valid YAML: {e}") from None
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise error(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def format_validation_error(source: str, what: str, err: ValidationError) -> str:
    n = err.error_count()
    lines = [f"{source}: invalid {what} ({n} error{'s' if n != 1 else ''})"]
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        lines.append(f"  field '{loc}': {e['msg']}")
    return "\n".join(lines)


def validate(model: type[M], data: dict[str, Any], source: str, what: str, error: type[Exception]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise error(format_validation_error(source, what, e)) from None
