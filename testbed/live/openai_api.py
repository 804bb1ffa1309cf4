"""OpenAI-style request parsing and response chunks (completions and chat completions).

Prompt length: token ids count as given; text is estimated at one token per 4 UTF-8 bytes
(the mock nodes never see text, only lengths). The `testbed` extension field carries a trace's
exact length and prefix block hashes: {"input_tokens": N, "hash_ids": [...], "request_id": "..."}.
Without hashes, a prompt's own content gives them (`block_hashes`): chained hashes of its
token-id or text blocks, so real clients that resend a conversation's history hit the prefix
cache as a serving engine's would. The final chunk (or the whole response) carries the same
field back: the request's record as the serving side saw it (`record_extension`).

What vLLM-compatible load generators look at is answered as vLLM does: `usage` with
`prompt_tokens_details.cached_tokens`, `ignore_eos` and `min_tokens` accepted (plain text is
always `max_tokens` long: the mock has no EOS), and generated text that common tokenizers count
as `completion_tokens` tokens (`TOKEN_TEXT`). `stop`, `logprobs`, `tools` and `response_format`
shape the generated text (`testbed.live.openai_options`, `testbed.live.mock_output`); the
request then asks the decode node for the tokens the text takes.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from testbed.core.json_types import JSONObject, JSONValue
from testbed.core.record import RequestRecord, record_to_wire
from testbed.core.router.request_ids import client_id
from testbed.core.schema.limits import MAX_INPUT_TOKENS, MAX_OUTPUT_TOKENS
from testbed.live.mock_output import BYTES_PER_TOKEN, TOKEN_TEXT, Output, plan, token_logprobs
from testbed.live.openai_options import RequestError, generation

__all__ = [
    "BYTES_PER_TOKEN",
    "EXTENSION",
    "TOKEN_TEXT",
    "Limits",
    "ParsedRequest",
    "RequestError",
    "block_hashes",
    "chunk",
    "full_response",
    "load_body",
    "parse",
    "record_extension",
    "usage",
    "usage_chunk",
]

EXTENSION = "testbed"
DEFAULT_MAX_TOKENS = 16
MAX_TOKENS_LIMIT = MAX_OUTPUT_TOKENS


@dataclass(frozen=True)
class ParsedRequest:
    kind: str  # completions | chat
    model: str
    input_tokens: int
    output_tokens: int
    stream: bool
    include_usage: bool
    hash_ids: tuple[int, ...] = ()
    client_request_id: str | None = None
    extra: JSONObject = field(default_factory=dict)
    content: bytes | tuple[int, ...] = b""  # what the prompt is made of, for block hashes
    logprobs: int | None = None  # top alternatives per token; None: no logprobs asked
    planned: Output | None = None  # what is generated; None: `output_tokens` of plain text
    # stream_options.continuous_usage_stats (vLLM, SGLang): usage in every streamed chunk
    continuous_usage: bool = False

    @property
    def output(self) -> Output:
        return self.planned if self.planned is not None else plan(self.output_tokens)


def block_hashes(content: bytes | tuple[int, ...], block_tokens: int) -> tuple[int, ...]:
    """One 63-bit hash per block of the prompt (the last may be partial), each chained to the
    one before, so equal hashes at a position mean equal prefixes (the Mooncake convention)."""
    if isinstance(content, tuple):
        data = b"".join(i.to_bytes(8, "little", signed=True) for i in content)
        step = 8 * block_tokens
    else:
        data, step = content, BYTES_PER_TOKEN * block_tokens
    out: list[int] = []
    prev = b""
    for off in range(0, len(data), step):
        prev = hashlib.blake2b(prev + data[off : off + step], digest_size=8).digest()
        out.append(int.from_bytes(prev, "little") >> 1)
    return tuple(out)


def estimate_tokens(text: str) -> int:
    return max(1, math.ceil(len(text.encode()) / BYTES_PER_TOKEN))


def _prompt_tokens(prompt: Any) -> tuple[int, bytes | tuple[int, ...]]:
    if isinstance(prompt, str):
        return estimate_tokens(prompt), prompt.encode()
    if isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        if not all(0 <= x < 1 << 63 for x in prompt):
            raise RequestError("field 'prompt': token ids must be in [0, 2^63)")
        return len(prompt), tuple(prompt)
    if isinstance(prompt, list) and len(prompt) == 1:
        return _prompt_tokens(prompt[0])
    raise RequestError("field 'prompt' must be a string, a list of token ids, or a one-element list of either")


def _last_is_tool_result(messages: Any) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and isinstance(messages[-1], dict)
        and messages[-1].get("role") in ("tool", "function")
    )


def _chat_tokens(messages: Any) -> tuple[int, bytes]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("field 'messages' must be a non-empty list")
    total = 0
    parts: list[bytes] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"field 'messages[{i}]' must be an object")
        content = m.get("content") or ""  # null content (e.g. an assistant turn with tool calls) is empty
        if isinstance(content, list):  # content parts
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise RequestError(f"field 'messages[{i}].content' must be a string or a list of parts")
        total += estimate_tokens(content) + 4  # role and separators, as chat templates add
        parts.append(f"<{m.get('role', '')}>{content}\n".encode())
    return total, b"".join(parts)


@dataclass(frozen=True)
class Limits:
    """What the served model accepts (from the scenario): prompt plus output, and output alone."""

    max_context_tokens: int = MAX_INPUT_TOKENS + MAX_OUTPUT_TOKENS
    max_output_tokens: int = MAX_TOKENS_LIMIT


def _flag(body: Mapping[str, object], name: str) -> bool:
    # "false" must not mean True: clients that send JSON strings get the boolean they meant.
    v = body.get(name, False)
    if v is None or isinstance(v, bool):
        return bool(v)
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise RequestError(f"field {name!r} must be true or false")


# How deep a request body's arrays and objects may nest: an OpenAI body is a few levels deep
# (messages, content parts, tool schemas); the parser and the prompt's one-element lists recurse.
MAX_BODY_DEPTH = 64


# A JSON escape of a UTF-16 surrogate (\ud800-\udfff): only through one can a lone surrogate get
# into a body, since the raw text was decoded as UTF-8, which has none.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def load_body(text: str) -> Any:
    """The JSON value of a request body; `RequestError` if it is not JSON, nests more than
    MAX_BODY_DEPTH deep or holds a lone surrogate (a valid JSON escape such as \\udc80 but no
    Unicode character: encoding it for hashing or for records.csv fails).

    Both checks run only when the raw text could fail them (counted and searched in C): walking
    every value of a 128k-token prompt on each request cost the router ~40 ms."""
    try:
        body = json.loads(text)
    except RecursionError:
        raise RequestError(f"body is nested more than {MAX_BODY_DEPTH} deep") from None
    except ValueError:
        raise RequestError("body is not JSON") from None
    if text.count("[") + text.count("{") > MAX_BODY_DEPTH and _nests_deeper(body, MAX_BODY_DEPTH):
        raise RequestError(f"body is nested more than {MAX_BODY_DEPTH} deep")
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")  # keys and strings alike
        except UnicodeEncodeError:
            raise RequestError(
                "body holds a lone surrogate (an unpaired \\ud800-\\udfff escape): not valid Unicode"
            ) from None
    return body


def _nests_deeper(body: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` deep in `body`, without recursion."""
    todo: list[tuple[Any, int]] = [(body, 1)] if isinstance(body, (list, dict)) else []
    while todo:
        v, d = todo.pop()
        if d > limit:
            return True
        items = v.values() if isinstance(v, dict) else v
        todo.extend((x, d + 1) for x in items if isinstance(x, (list, dict)))
    return False


def parse(body: Any, kind: str, limits: Limits = Limits()) -> ParsedRequest:
    if not isinstance(body, dict):
        raise RequestError("body must be a JSON object")
    model = body.get("model", "")
    if not isinstance(model, str):
        raise RequestError("field 'model' must be a string")
    n = body.get("n", 1)
    if n != 1:
        raise RequestError("field 'n': only n=1 is supported")
    ext = body.get(EXTENSION) or {}
    if not isinstance(ext, dict):
        raise RequestError("field 'testbed' must be an object")
    content: bytes | tuple[int, ...] = b""
    if "input_tokens" in ext:
        tokens = ext["input_tokens"]
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
            raise RequestError("field 'testbed.input_tokens' must be an integer >= 1")
    elif kind == "chat":
        tokens, content = _chat_tokens(body.get("messages"))
    else:
        if "prompt" not in body:
            raise RequestError("field 'prompt' is required (or 'testbed.input_tokens')")
        tokens, content = _prompt_tokens(body["prompt"])
    hash_ids = ext.get("hash_ids", [])
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and -(1 << 63) <= h < 1 << 63 for h in hash_ids
    ):
        raise RequestError("field 'testbed.hash_ids' must be a list of 64-bit integers")
    gen = generation(body, kind, kind == "chat" and _last_is_tool_result(body.get("messages")))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    top = limits.max_output_tokens
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= top
    ):
        raise RequestError(f"field 'max_tokens' must be an integer in [1, {top}]", "max_tokens")
    if max_tokens is None:
        # Structured output ends where its JSON does (a model's EOS), within what the model allows.
        max_tokens = (
            DEFAULT_MAX_TOKENS if gen.structured is None else max(min(top, limits.max_context_tokens - tokens), 1)
        )
    min_tokens = body.get("min_tokens", 0)
    if min_tokens is None:
        min_tokens = 0
    if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or not 0 <= min_tokens <= max_tokens:
        raise RequestError(f"field 'min_tokens' must be an integer in [0, max_tokens={max_tokens}]", "min_tokens")
    # The mock has no EOS: plain text is always max_tokens long, so ignore_eos changes only
    # structured output (padded to max_tokens, as a model kept from ending would pad it).
    ignore_eos = _flag(body, "ignore_eos")
    if tokens + max_tokens > limits.max_context_tokens:
        raise RequestError(
            f"this model's maximum context length is {limits.max_context_tokens} tokens; the "
            f"request asks for {tokens + max_tokens} ({tokens} in the prompt, {max_tokens} in the "
            "completion)"
        )
    out = plan(
        max_tokens,
        structured=gen.structured,
        tool=gen.tool,
        stops=gen.stops,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
    )
    stream = _flag(body, "stream")
    so = body.get("stream_options") or {}
    include_usage = bool(so.get("include_usage", False)) if isinstance(so, dict) else False
    continuous = bool(so.get("continuous_usage_stats", False)) if isinstance(so, dict) else False
    rid = ext.get("request_id")
    return ParsedRequest(
        kind,
        model,
        tokens,
        out.n,
        stream,
        include_usage,
        tuple(hash_ids),
        client_id(rid) if isinstance(rid, str) and rid else None,
        content=content,
        logprobs=gen.logprobs,
        planned=out if (gen.stops or gen.structured is not None) else None,
        continuous_usage=continuous,
    )


def record_extension(rec: RequestRecord) -> JSONObject:
    """What the final chunk adds: the request's record, times in unix seconds."""
    return {EXTENSION: record_to_wire(rec)}


def call_id(cid: str) -> str:
    """The id of the tool call a response makes (one per response)."""
    return "call_" + cid.rsplit("-", 1)[-1]


def chat_logprobs(req: ParsedRequest, start: int, end: int) -> JSONObject | None:
    """Chat's `logprobs` for tokens [start, end) (`ChoiceLogprobs`), None when not asked."""
    if req.logprobs is None:
        return None
    content: list[JSONValue] = []
    for i, tok in req.output.tokens(start, end):
        lp, top = token_logprobs(tok, i, req.logprobs)
        content.append(
            {
                "token": tok,
                "bytes": list(tok.encode()),
                "logprob": lp,
                "top_logprobs": [{"token": t, "bytes": list(t.encode()), "logprob": v} for t, v in top],
            }
        )
    return {"content": content, "refusal": None}


def completion_logprobs(req: ParsedRequest, start: int, end: int) -> JSONObject | None:
    """The legacy completions `logprobs` for tokens [start, end): parallel lists, offsets into the text."""
    if req.logprobs is None:
        return None
    out = req.output
    tokens: list[JSONValue] = []
    lps: list[JSONValue] = []
    tops: list[JSONValue] = []
    offs: list[JSONValue] = []
    for i, tok in out.tokens(start, end):
        lp, top = token_logprobs(tok, i, req.logprobs)
        tokens.append(tok)
        lps.append(lp)
        tops.append({t: v for t, v in top})
        offs.append(out.offset(i))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def _tool_call(req: ParsedRequest, cid: str, arguments: str, first: bool) -> JSONObject:
    if not first:
        return {"index": 0, "function": {"arguments": arguments}}
    return {
        "index": 0,
        "id": call_id(cid),
        "type": "function",
        "function": {"name": req.output.tool, "arguments": arguments},
    }


def chunk(
    req: ParsedRequest,
    cid: str,
    model: str,
    start: int,
    new_tokens: int,
    finish: str | None,
    extra: JSONObject | None = None,
) -> JSONObject:
    """The streamed chunk of tokens [start, start + new_tokens) (the first when start is 0)."""
    created = int(time.time())
    first, end = start == 0, start + new_tokens
    out_ = req.output
    text = out_.text(start, end)
    if req.kind == "chat":
        if out_.tool is not None:
            delta: JSONObject = {"tool_calls": [_tool_call(req, cid, text, first)]} if new_tokens else {}
            if first:
                delta = {"role": "assistant", "content": None, **delta}
        else:
            delta = {"content": text} if (text or not first) else {}
            if first:
                delta = {"role": "assistant", "content": text}
        logprobs = chat_logprobs(req, start, end) if new_tokens and out_.tool is None else None
        choice: JSONObject = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        out: JSONObject = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [choice],
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": completion_logprobs(req, start, end) if new_tokens else None,
            "finish_reason": finish,
        }
        out = {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    if extra:
        out.update(extra)
    return out


def usage(req: ParsedRequest, completion_tokens: int, cached_tokens: int = 0) -> JSONObject:
    """OpenAI usage as vLLM reports it; `cached_tokens`: the prompt's prefix served from cache."""
    return {
        "prompt_tokens": req.input_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": req.input_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def usage_chunk(req: ParsedRequest, cid: str, model: str, completion_tokens: int, cached_tokens: int = 0) -> JSONObject:
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {
        "id": cid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage(req, completion_tokens, cached_tokens),
    }


def full_response(
    req: ParsedRequest, cid: str, model: str, tokens: int, extra: JSONObject, cached_tokens: int = 0
) -> JSONObject:
    """The whole response to a request whose `tokens` tokens were generated."""
    created = int(time.time())
    out_ = req.output
    text = out_.text(0, tokens)
    if req.kind == "chat":
        message: JSONObject = {"role": "assistant", "content": text}
        logprobs = chat_logprobs(req, 0, tokens)
        if out_.tool is not None:
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": call_id(cid), "type": "function", "function": {"name": out_.tool, "arguments": text}}
                ],
            }
            logprobs = None
        choice: JSONObject = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": out_.finish}
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": completion_logprobs(req, 0, tokens),
            "finish_reason": out_.finish,
        }
        obj = "text_completion"
    out: JSONObject = {
        "id": cid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(req, tokens, cached_tokens),
    }
    out.update(extra)
    return out
