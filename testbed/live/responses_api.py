"""The Responses API (`POST /v1/responses`) on the chat path: a request is rewritten into the chat
completion it amounts to (`to_chat`: `input` and `instructions` become messages, `text.format`
the response format, flat function tools chat's nested ones) and parsed as one, so it is routed,
served and recorded like any chat request; its answer is a `response` object, or, streaming,
the Responses event stream (`response.created` ... `response.output_text.delta` ...
`response.completed`), one `event:` / `data:` pair per event and no `[DONE]`.

The mock keeps no responses: `previous_response_id` is refused, and so are tools other than
functions (web search, file search, ...), which it cannot emulate.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from testbed.core.json_types import JSONObject, JSONValue
from testbed.live.mock_output import Output, token_logprobs
from testbed.live.openai_api import EXTENSION, Limits, ParsedRequest, RequestError, parse

# What a response echoes of its request, as OpenAI's does.
ECHOED = (
    "instructions",
    "max_output_tokens",
    "metadata",
    "parallel_tool_calls",
    "temperature",
    "tool_choice",
    "tools",
    "top_p",
    "top_logprobs",
    "text",
)
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _messages(body: Mapping[str, object]) -> list[JSONValue]:
    inp = body.get("input")
    out: list[JSONValue] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("field 'instructions' must be a string", "instructions")
        out.append({"role": "system", "content": instructions})
    if isinstance(inp, str):
        return [*out, {"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise RequestError("field 'input' must be a string or a non-empty list of input items", "input")
    for i, item in enumerate(inp):
        if not isinstance(item, dict):
            raise RequestError(f"field 'input[{i}]' must be an object", f"input[{i}]")
        t = item.get("type", "message")
        if t == "message" or "role" in item:
            out.append({"role": str(item.get("role", "user")), "content": _text_of(item.get("content"))})
        elif t == "function_call":
            out.append({"role": "assistant", "content": str(item.get("arguments", ""))})
        elif t == "function_call_output":
            out.append({"role": "tool", "content": _text_of(item.get("output"))})
        else:
            out.append({"role": "user", "content": ""})  # images, files, reasoning: no text to count
    return out


def _tools(body: Mapping[str, object]) -> list[JSONValue] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("field 'tools' must be a list", "tools")
    out: list[JSONValue] = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise RequestError(f"field 'tools[{i}]': only function tools are emulated, not {kind!r}", f"tools[{i}]")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(body: Mapping[str, object]) -> JSONObject | None:
    text = body.get("text")
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise RequestError("field 'text.format' must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", ""), "schema": fmt.get("schema", {})}}
    return fmt


def to_chat(body: Any) -> JSONObject:
    """The chat completions body a Responses API body amounts to."""
    if not isinstance(body, dict):
        raise RequestError("body must be a JSON object")
    if body.get("previous_response_id") is not None:
        raise RequestError(
            "field 'previous_response_id': this server keeps no responses; send the whole conversation in 'input'",
            "previous_response_id",
        )
    include = body.get("include") or []
    chat: JSONObject = {
        "model": body.get("model", ""),
        "messages": _messages(body),
        "stream": body.get("stream", False),
    }
    for src, dst in (("max_output_tokens", "max_tokens"), (EXTENSION, EXTENSION)):
        if body.get(src) is not None:
            chat[dst] = body[src]
    tools = _tools(body)
    if tools is not None:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    rf = _response_format(body)
    if rf is not None:
        chat["response_format"] = rf
    if isinstance(include, list) and LOGPROBS_INCLUDE in include:
        chat["logprobs"] = True
        chat["top_logprobs"] = body.get("top_logprobs") or 0
    return chat


def parse_responses(body: Any, limits: Limits = Limits()) -> ParsedRequest:
    req = parse(to_chat(body), "chat", limits)
    assert isinstance(body, dict)
    echo = {k: body.get(k) for k in ECHOED}
    return dataclasses.replace(req, kind="responses", include_usage=True, extra=echo)


def _logprobs(req: ParsedRequest, start: int, end: int) -> list[JSONValue]:
    if req.logprobs is None:
        return []
    out: list[JSONValue] = []
    for i, tok in req.output.tokens(start, end):
        lp, top = token_logprobs(tok, i, req.logprobs)
        out.append(
            {
                "token": tok,
                "bytes": list(tok.encode()),
                "logprob": lp,
                "top_logprobs": [{"token": t, "bytes": list(t.encode()), "logprob": v} for t, v in top],
            }
        )
    return out


class ResponseEvents:
    """The event stream of one response, numbered in order; every method returns the events to send."""

    def __init__(self, req: ParsedRequest, rid: str, model: str) -> None:
        self.req, self.id, self.model = req, rid, model
        self.created = int(time.time())
        self.seq = 0
        suffix = rid.removeprefix("resp_")
        self.item_id = ("fc_" if req.output.tool is not None else "msg_") + suffix
        self.call_id = "call_" + suffix

    def _ev(self, type_: str, **fields: Any) -> JSONObject:
        ev = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def item(self, tokens: int, done: bool) -> JSONObject:
        out = self.req.output
        text = out.text(0, tokens)
        status = "in_progress" if not done else "incomplete" if out.finish == "length" else "completed"
        if out.tool is not None:
            return {
                "type": "function_call",
                "id": self.item_id,
                "call_id": self.call_id,
                "name": out.tool,
                "arguments": text,
                "status": status,
            }
        content: list[JSONValue] = [self.part(tokens)] if done else []
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def part(self, tokens: int) -> JSONObject:
        return {
            "type": "output_text",
            "text": self.req.output.text(0, tokens),
            "annotations": [],
            "logprobs": _logprobs(self.req, 0, tokens),
        }

    def response(self, tokens: int | None, cached: int = 0) -> JSONObject:
        """The response object: in progress (`tokens` None) or done with that many tokens."""
        out: Output = self.req.output
        resp: JSONObject = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "output": [],
            "usage": None,
            **{k: v for k, v in self.req.extra.items()},
        }
        resp["tools"] = resp.get("tools") or []
        resp["tool_choice"] = resp.get("tool_choice") or "auto"
        resp["parallel_tool_calls"] = (
            resp["parallel_tool_calls"] if resp.get("parallel_tool_calls") is not None else True
        )
        resp["text"] = resp.get("text") or {"format": {"type": "text"}}
        if tokens is not None:
            truncated = out.finish == "length"
            resp["status"] = "incomplete" if truncated else "completed"
            resp["incomplete_details"] = {"reason": "max_output_tokens"} if truncated else None
            resp["output"] = [self.item(tokens, True)]
            resp["usage"] = {
                "input_tokens": self.req.input_tokens,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.req.input_tokens + tokens,
            }
        return resp

    def opening(self) -> list[JSONObject]:
        resp = self.response(None)
        return [self._ev("response.created", response=resp), self._ev("response.in_progress", response=resp)]

    def tokens(self, start: int, new: int) -> list[JSONObject]:
        """The events of tokens [start, start + new): the output item's opening first."""
        evs = []
        where = {"item_id": self.item_id, "output_index": 0}
        if start == 0:
            evs.append(self._ev("response.output_item.added", output_index=0, item=self.item(0, False)))
            if self.req.output.tool is None:
                evs.append(self._ev("response.content_part.added", **where, content_index=0, part=self.part(0)))
        delta = self.req.output.text(start, start + new)
        if not delta:
            return evs
        if self.req.output.tool is not None:
            evs.append(self._ev("response.function_call_arguments.delta", **where, delta=delta))
        else:
            evs.append(
                self._ev(
                    "response.output_text.delta",
                    **where,
                    content_index=0,
                    delta=delta,
                    logprobs=_logprobs(self.req, start, start + new),
                )
            )
        return evs

    def closing(self, tokens: int, cached: int, ext: JSONObject) -> list[JSONObject]:
        """The last events: the item's, then `response.completed` (or `.incomplete`) carrying `ext`."""
        evs = self.tokens(0, 0) if not tokens else []
        where = {"item_id": self.item_id, "output_index": 0}
        out = self.req.output
        if out.tool is not None:
            evs.append(
                self._ev("response.function_call_arguments.done", **where, name=out.tool, arguments=out.text(0, tokens))
            )
        else:
            evs.append(
                self._ev(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=out.text(0, tokens),
                    logprobs=_logprobs(self.req, 0, tokens),
                )
            )
            evs.append(self._ev("response.content_part.done", **where, content_index=0, part=self.part(tokens)))
        evs.append(self._ev("response.output_item.done", output_index=0, item=self.item(tokens, True)))
        final = self.response(tokens, cached)
        evs.append({**self._ev(f"response.{final['status']}", response=final), **ext})
        return evs

    def failed(self, message: str, ext: JSONObject) -> JSONObject:
        resp = {**self.response(None), "status": "failed", "error": {"code": "server_error", "message": message}}
        return {**self._ev("response.failed", response=resp), **ext}
