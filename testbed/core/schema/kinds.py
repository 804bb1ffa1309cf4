"""Exhaustive dispatch over Literal kinds (policy names, fault kinds, trace formats, ...).

Every `match` over a kind ends in `case _: unknown_kind(what, x)`. Its parameter is `Never`, as
in `typing.assert_never`, so mypy rejects a match that leaves a member of the Literal or union
without a case; at run time a value from outside that is no member (a file's kind, a model
built without validation) fails with `UnknownKind` naming it instead of taking a default.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Never, NoReturn

from testbed.core.errors import UserError


class UnknownKind(UserError, ValueError):
    """A kind no case handles: `what` is the family (e.g. "fault kind"), `kind` the value's name,
    `known` the names that are handled (for the message)."""

    def __init__(self, what: str, kind: str, known: Iterable[str] = ()) -> None:
        self.what = what
        self.kind = kind
        self.known = tuple(known)
        super().__init__(f"unknown {what} {kind!r}" + (f"; known: {', '.join(self.known)}" if self.known else ""))


def kind_name(value: object) -> str:
    """The name to report: a string itself, else its `kind` or `name` field, else its type."""
    if isinstance(value, str):
        return value
    for attr in ("kind", "name"):
        v = getattr(value, attr, None)
        if isinstance(v, str):
            return v
    return type(value).__name__


def unknown_kind(what: str, value: Never, known: Iterable[str] = ()) -> NoReturn:
    raise UnknownKind(what, kind_name(value), known)
