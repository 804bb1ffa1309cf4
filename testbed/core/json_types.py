"""What a JSON document can hold, for values the code passes on without reading them.

A shape the project defines itself (a request body, a status payload, a spec) gets a TypedDict or
a dataclass of its own; these aliases are for the rest: details logged as they come, bodies
relayed, documents another program wrote.
"""

from __future__ import annotations

from typing import TypeAlias

# Spelled so that they also evaluate at run time (a `Callable[[JSONObject | None], ...]` alias).
JSONValue: TypeAlias = str | int | float | bool | None | list["JSONValue"] | dict[str, "JSONValue"]
JSONObject: TypeAlias = dict[str, JSONValue]
