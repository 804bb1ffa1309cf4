"""The OpenAI request fields that shape what is generated: `stop`, `logprobs` / `top_logprobs`,
`tools` / `tool_choice` and `response_format`, checked and turned into `Generation`.

With `tool_choice` "auto" the mock calls the first tool unless the conversation's last message
is a tool's result, when it answers in text, as a model that has what it asked for would (an
agent loop against the mock ends). "required" calls the first tool, a named function that one,
"none" none. One call per turn (`parallel_tool_calls` is accepted, never needed). The call's
arguments are a minimal instance of the function's `parameters` (`json_instance`); text
answers follow `response_format` (json_object: `{}`; json_schema: a minimal instance).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from testbed.live.json_instance import SchemaError, instance
from testbed.live.mock_output import MAX_TOP_LOGPROBS


class RequestError(ValueError):
    """Client error; the message names the field (`param` too, as OpenAI's error body does)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


MAX_STOPS = 16
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class Generation:
    stops: tuple[str, ...] = ()
    logprobs: int | None = None  # top alternatives per token; None: no logprobs asked
    tool: str | None = None  # the function called
    structured: str | None = None  # the JSON text generated (a call's arguments or the content)


def _stops(body: Mapping[str, object]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items) or len(items) > MAX_STOPS:
        raise RequestError(f"field 'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop")
    return tuple(items)


def _int_in(body: Mapping[str, object], name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise RequestError(f"field {name!r} must be an integer in [{lo}, {hi}]", name)
    return v


def _logprobs(body: Mapping[str, object], kind: str) -> int | None:
    if kind == "completions":
        return _int_in(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    v = body.get("logprobs")
    if v is not None and not isinstance(v, bool):
        raise RequestError("field 'logprobs' must be true or false", "logprobs")
    top = _int_in(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not v:
        raise RequestError("field 'top_logprobs' requires 'logprobs': true", "top_logprobs")
    return (top or 0) if v else None


def _schema_text(schema: Any, field: str) -> str:
    try:
        return json.dumps(instance(schema))
    except SchemaError as e:
        raise RequestError(f"field {field!r}: {e}", field) from None


def _response_format(body: Mapping[str, object]) -> str | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    t = rf.get("type") if isinstance(rf, dict) else None
    if t == "text":
        return None
    if t == "json_object":
        return "{}"
    if t == "json_schema":
        js = rf.get("json_schema") if isinstance(rf, dict) else None
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
            raise RequestError(
                "field 'response_format.json_schema' must be an object with a 'schema'", "response_format"
            )
        return _schema_text(js.get("schema", {}), "response_format.json_schema.schema")
    raise RequestError("field 'response_format.type' must be text, json_object or json_schema", "response_format")


def _tools(body: Mapping[str, object]) -> list[tuple[str, Any]]:
    """(name, parameters schema) of each function tool."""
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("field 'tools' must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise RequestError(
                f"field 'tools[{i}]' must be a function tool with a name of 1-64 letters, digits, '_' or '-'",
                f"tools[{i}]",
            )
        assert isinstance(fn, dict)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise RequestError(
                f"field 'tools[{i}].function.parameters' must be a JSON schema object",
                f"tools[{i}].function.parameters",
            )
        out.append((name, params))
    return out


def _called(body: Mapping[str, object], tools: list[tuple[str, Any]], last_is_tool_result: bool) -> int | None:
    """Which tool is called (its index), if any."""
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise RequestError("field 'tool_choice' is only allowed when 'tools' are given", "tool_choice")
    if choice == "auto":
        return None if last_is_tool_result else 0
    if choice == "required":
        return 0
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise RequestError(
            'field \'tool_choice\' must be none, auto, required or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    for i, (n, _) in enumerate(tools):
        if n == name:
            return i
    raise RequestError(f"field 'tool_choice': no tool named {name!r} in 'tools'", "tool_choice")


def generation(body: Mapping[str, object], kind: str, last_is_tool_result: bool = False) -> Generation:
    """What `body` asks of the generated text (`kind`: completions or chat)."""
    stops = _stops(body)
    logprobs = _logprobs(body, kind)
    if kind == "completions" and (body.get("tools") is not None or body.get("tool_choice") is not None):
        raise RequestError(
            "fields 'tools' and 'tool_choice' are for /v1/chat/completions, not /v1/completions", "tools"
        )
    tools = _tools(body)
    called = _called(body, tools, last_is_tool_result)
    if called is not None:
        name, params = tools[called]
        return Generation(stops, logprobs, name, _schema_text(params, f"tools[{called}].function.parameters"))
    return Generation(stops, logprobs, None, _response_format(body))
