"""One YAML + pydantic loader and one error formatter for every file the user writes."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from testbed.config.input_files import MAX_CONFIG_BYTES, InputFileError, read_text_capped

M = TypeVar("M", bound=BaseModel)


# What an error may quote from a file. A file named as a scenario or profile may be anything
# readable (`--scenario /etc/shadow` under sudo), so its text is quoted only where it is
# recognisably the expected kind: a mapping holding at least one of the kind's fields. Then a
# field path is quoted where each part is a short name (a field, a hardware profile's name);
# any other part is shown as `<key>`. Otherwise the file is named with a position, no content.
# YAML's own messages quote the offending lines; only its line and column are kept.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,63}")
# The quoted parts of a YAML problem that are syntax, not content: one character or a token kind.
_SYNTAX_QUOTE = re.compile(r"'(.{0,2}|<[a-z ]+>)'")


def yaml_problem(path: Path, e: yaml.YAMLError) -> str:
    """`FILE: not valid YAML (line N, column M: problem)`, the problem kept only when all it
    quotes is syntax (YAML quotes aliases, tags and escapes from the text too)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "position unknown"
    problem = getattr(e, "problem", None)
    if isinstance(problem, str) and "'" in _SYNTAX_QUOTE.sub("", problem):
        problem = None
    return f"{path}: not valid YAML ({where}{': ' + problem if problem else ''})"


def _first_key_line(text: str) -> str:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return ""
    if isinstance(node, yaml.MappingNode) and node.value:
        return f"; its first key is on line {node.value[0][0].start_mark.line + 1}"
    return ""


def read_mapping(path: Path, error: type[Exception], what: str = "", fields: Collection[str] = ()) -> dict[str, object]:
    """A YAML file whose top level is a mapping (an empty file is an empty mapping): a regular
    UTF-8 file of at most MAX_CONFIG_BYTES. With `fields` (the kind's top-level fields, `what`
    its name), a non-empty mapping holding none of them is refused as not that kind, its keys
    unquoted."""
    try:
        text = read_text_capped(path, MAX_CONFIG_BYTES)
        data = yaml.safe_load(text)
    except InputFileError as e:
        raise error(str(e)) from None
    except yaml.YAMLError as e:
        raise error(yaml_problem(path, e)) from None
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise error(f"{path}: top level must be a mapping, got {type(data).__name__}")
    if fields and data and not any(k in fields for k in data):
        raise error(
            f"{path}: not a {what or 'valid file'}: none of its {len(data)} top-level keys is one of its "
            f"fields ({', '.join(fields)}){_first_key_line(text)}"
        )
    return data


def loc_text(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as `a.b.0.c`, a part that is no short name shown as `<key>`."""
    parts = [str(x) if isinstance(x, int) or _NAME.fullmatch(str(x)) else "<key>" for x in loc]
    return ".".join(parts) or "(top level)"


def format_validation_error(
    source: str, what: str, err: ValidationError, label: Callable[[tuple[int | str, ...]], str | None] | None = None
) -> str:
    """One line naming `source`, then one per error; `label(loc)` may name where an error's
    value came from instead (a `--set` override)."""
    n = err.error_count()
    errors = err.errors()
    origins = [label(e["loc"]) if label is not None else None for e in errors]
    if origins and all(origins):
        # Every error is in what the overrides set: they are to blame, not the file.
        named = ", ".join(dict.fromkeys(o for o in origins if o))
        lines = [f"{named}: invalid {what} field{'s' if n != 1 else ''} (over {source})"]
        origins = [None] * n
    else:
        lines = [f"{source}: invalid {what} ({n} error{'s' if n != 1 else ''})"]
    for e, origin in zip(errors, origins):
        lines.append(f"  {origin + ': ' if origin else ''}field '{loc_text(e['loc'])}': {e['msg']}")
    return "\n".join(lines)


def origin_of(origins: dict[str, str], loc: tuple[int | str, ...]) -> str | None:
    """The override (`origins`: dotted path -> how it was given) that set `loc` or a field
    above it, the deepest first; None when the file set it."""
    parts = [str(x) for x in loc]
    for n in range(len(parts), 0, -1):
        hit = origins.get(".".join(parts[:n]))
        if hit is not None:
            return hit
    return None


def validate(
    model: type[M],
    data: Mapping[str, object],
    source: str,
    what: str,
    error: type[Exception],
    label: Callable[[tuple[int | str, ...]], str | None] | None = None,
) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise error(format_validation_error(source, what, e, label)) from None
