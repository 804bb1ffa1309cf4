"""The client's side of one OpenAI response: server-sent events opened before the first token
(`data: <json>` frames, `[DONE]` last; the Responses API's `event:` / `data:` pairs), or one JSON
body at the end; a failure is an error event on an open stream and a 502 body otherwise. The
chunks' contents are `testbed.live.openai_api`'s and `testbed.live.responses_api`'s; the error
bodies are OpenAI's (`{"error": {"message", "type", "param", "code"}}`)."""

from __future__ import annotations

import json

from aiohttp import web

from testbed.core.json_types import JSONObject
from testbed.live.openai_api import ParsedRequest, chunk, full_response, usage_chunk
from testbed.live.responses_api import ResponseEvents

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def sse_frame(obj: JSONObject | str, event: str | None = None) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj)
    return (f"event: {event}\n" if event else "").encode() + f"data: {data}\n\n".encode()


def openai_error(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | int | None = None
) -> JSONObject:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.json_response(openai_error(message, type_, param, code), status=status, headers=headers)


def error_body(message: str, extra: JSONObject) -> JSONObject:
    return {**openai_error(message, "server_error", None, 502), **extra}


class Reply:
    """One response to one client (completions and chat): streamed when the request asked for it."""

    def __init__(self, req: ParsedRequest, cid: str, model: str) -> None:
        self.req, self.cid, self.model = req, cid, model
        self.stream: web.StreamResponse | None = None  # open while streaming

    async def open(self, request: web.Request) -> None:
        """Start the event stream if the client asked for one (the headers go out now)."""
        if self.req.stream:
            self.stream = web.StreamResponse(headers=SSE_HEADERS)
            await self.stream.prepare(request)

    async def _send(self, obj: JSONObject | str, event: str | None = None) -> None:
        assert self.stream is not None
        await self.stream.write(sse_frame(obj, event))

    async def _end(self) -> web.StreamResponse:
        assert self.stream is not None
        await self.stream.write_eof()
        return self.stream

    def _silent(self, new: int, before: int) -> bool:
        """Tokens past a stop sequence's start: generated, nothing to show (vLLM sends no chunk)."""
        return before > 0 and not self.req.output.text(before, before + new)

    async def tokens(self, new: int, before: int) -> None:
        """One chunk of `new` tokens after `before` (streaming only)."""
        if not self._silent(new, before):
            await self._send(chunk(self.req, self.cid, self.model, before, new, None))

    async def finish(self, sent: int, ext: JSONObject, cached: int) -> web.StreamResponse:
        """The end of a completed request: the final chunk with the record (and usage if asked),
        or the whole response."""
        req, cid, model = self.req, self.cid, self.model
        if self.stream is None:
            return web.json_response(full_response(req, cid, model, sent, ext, cached))
        await self._send(chunk(req, cid, model, sent, 0, req.output.finish, ext))
        if req.include_usage:
            await self._send(usage_chunk(req, cid, model, sent, cached))
        await self._send("[DONE]")
        return await self._end()

    async def _stream_error(self, obj: JSONObject) -> None:
        await self._send(obj)
        await self._send("[DONE]")

    async def fail(self, message: str, ext: JSONObject) -> web.StreamResponse:
        if self.stream is None:
            return web.json_response(error_body(message, ext), status=502)
        try:
            await self._stream_error(error_body(message, ext))
            await self.stream.write_eof()
        except ConnectionError:
            pass  # the client has gone; its request is over everywhere already
        return self.stream


class ResponsesReply(Reply):
    """One Responses API response: the `response` object, or its event stream."""

    def __init__(self, req: ParsedRequest, cid: str, model: str) -> None:
        super().__init__(req, cid, model)
        self.events = ResponseEvents(req, cid, model)

    async def _emit(self, evs: list[JSONObject]) -> None:
        for ev in evs:
            await self._send(ev, str(ev["type"]))

    async def open(self, request: web.Request) -> None:
        await super().open(request)
        if self.stream is not None:
            await self._emit(self.events.opening())

    async def tokens(self, new: int, before: int) -> None:
        if not self._silent(new, before):
            await self._emit(self.events.tokens(before, new))

    async def finish(self, sent: int, ext: JSONObject, cached: int) -> web.StreamResponse:
        if self.stream is None:
            return web.json_response({**self.events.response(sent, cached), **ext})
        await self._emit(self.events.closing(sent, cached, ext))
        return await self._end()

    async def _stream_error(self, obj: JSONObject) -> None:
        ext = {k: v for k, v in obj.items() if k != "error"}
        err = obj["error"]
        await self._emit([self.events.failed(str(err["message"] if isinstance(err, dict) else err), ext)])


def make_reply(req: ParsedRequest, cid: str, model: str) -> Reply:
    return ResponsesReply(req, cid, model) if req.kind == "responses" else Reply(req, cid, model)
