"""The router's OpenAI routes: `/v1/completions`, `/v1/chat/completions` and `/v1/responses`
(parse, claim the request's id, route, run its `Attempts`, answer), `/v1/models` (with
`max_model_len`, as vLLM's) and `/v1/models/{id}`, `/version`, `/testbed/info` (what a client
should know of the deployment: the model, the speedup, tokens per streamed chunk), and an
OpenAI error body for every route or method not served (`openai_errors`)."""

from __future__ import annotations

import json
import math
import uuid
from typing import Any, TypedDict

import aiohttp
from aiohttp import web

from testbed.core.failures import FailureKind as K
from testbed.core.json_types import JSONObject
from testbed.core.lifecycle import Event, InvalidTransition, Lifecycle
from testbed.core.record import NO_TRACE_INDEX, RequestRecord
from testbed.core.router.request_ids import client_id
from testbed.core.routing.policy import NoCapacity
from testbed.live.clock import now
from testbed.live.openai_api import Limits, ParsedRequest, RequestError, load_body, parse
from testbed.live.responses_api import parse_responses
from testbed.live.router.attempts import Attempts
from testbed.live.router.drive import drive, note_decision, route
from testbed.live.router.engines import drive_for
from testbed.live.router.records import Seen, held_record, record_ext, replay_lifecycle, session_header
from testbed.live.router.reply import error_response, make_reply, openai_error
from testbed.live.router.state import STATE, Progress, RequestFailed, RouterState, log
from testbed.live.router.vllm_metrics import note_arrival, note_departure, observe_finished


async def _handle(request: web.Request, kind: str) -> web.StreamResponse:
    st = request.app[STATE]
    seen = Seen(now())
    if st.held is not None:
        seen.session = session_header(request.headers)
        seen.turn = st.held.next_turn(seen.session)
    try:
        return await _serve(request, kind, st, seen)
    finally:
        if seen.rid:
            st.ids.release(seen.rid)
        if st.held is not None:
            st.held.add(held_record(seen))


async def _parse(request: web.Request, kind: str, st: RouterState, seen: Seen) -> tuple[ParsedRequest, JSONObject]:
    """The request as the router reads it, and its body (what an engine protocol passes on)."""
    sc = st.cfg.deployment.scenario
    try:
        text = await request.text()
    except UnicodeDecodeError:
        seen.error, seen.error_kind = "bad request: body is not JSON", K.BAD_REQUEST
        raise _bad_request("body is not JSON (not UTF-8)") from None
    try:
        body = load_body(text)
        limits = Limits(sc.model.max_context_tokens, sc.serving.max_output_tokens)
        if kind == "responses" and sc.node_protocol != "testbed":
            raise RequestError(
                f"/v1/responses is not served over nodes.protocol {sc.node_protocol!r}: the engines' PD "
                "protocols run over /v1/completions and /v1/chat/completions"
            )
        return (parse_responses(body, limits) if kind == "responses" else parse(body, kind, limits)), body
    except RequestError as e:
        seen.error, seen.error_kind = f"bad request: {e}", K.BAD_REQUEST
        raise _bad_request(str(e), getattr(e, "param", None)) from None


def _bad_request(message: str, param: str | None = None) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=json.dumps(openai_error(message, param=param)), content_type="application/json")


def _claim_id(request: web.Request, req: ParsedRequest, st: RouterState, seen: Seen) -> str:
    # X-Request-Id as vLLM takes it (aiperf and vllm bench serve send one): an outside client's
    # records match the router's. An id in use, or recorded, gets a suffix (`testbed.core.router.request_ids`).
    asked = req.client_request_id or client_id(request.headers.get("X-Request-Id", "")) or uuid.uuid4().hex[:16]
    rid = seen.rid = st.ids.claim(asked)
    if rid != asked:
        log.info("request id %r is taken (in flight or recorded): this request is %r", asked, rid)
    return rid


async def _serve(request: web.Request, kind: str, st: RouterState, seen: Seen) -> web.StreamResponse:
    req, body = await _parse(request, kind, st, seen)
    model = req.model or st.cfg.deployment.scenario.model.name
    rid = _claim_id(request, req, st, seen)
    cid = {"chat": "chatcmpl-", "completions": "cmpl-", "responses": "resp_"}[kind] + uuid.uuid4().hex[:24]
    prog = Progress(Lifecycle(rid), RequestRecord(rid, NO_TRACE_INDEX, req.input_tokens, req.output_tokens))
    prog.rec.times.router_arrival = seen.arrival
    seen.prog = prog
    try:
        plan = route(st, req, rid)
    except NoCapacity as e:
        seen.error, seen.error_kind = f"no capacity: {e}", K.NO_CAPACITY
        raise web.HTTPServiceUnavailable(
            text=json.dumps(openai_error(str(e), "server_error")), content_type="application/json"
        ) from None
    note_decision(st, rid, req, plan, prog)
    st.inflight += 1
    reply = make_reply(req, cid, model)
    await reply.open(request)

    async def relay(new: int, before: int) -> None:
        if reply.stream is not None:
            await reply.tokens(new, before)
            seen.last = now()
            if math.isnan(seen.first):
                seen.first = seen.last

    proto = st.cfg.deployment.scenario.node_protocol
    # The nodes' protocol is the one seam between routing and the nodes (`engines`).
    att = Attempts(st, req, rid, plan, prog, seen, relay, drive_for(proto, body) if proto != "testbed" else drive)
    note_arrival(st.metrics, req.output_tokens)
    try:
        await att.run()
        replay_lifecycle(att.prog)
        observe_finished(st.metrics, att.prog.rec, seen.arrival, att.first_t, att.sent, now())
        out = await reply.finish(att.sent, record_ext(att.prog, att.sent), att.prog.rec.cached_tokens)
        if reply.stream is None:
            seen.first = seen.last = now()
        return out
    except (RequestFailed, InvalidTransition, aiohttp.ClientError) as e:
        if isinstance(e, InvalidTransition):
            e = RequestFailed(f"stamps out of lifecycle order: {e}", K.ROUTER_ERROR)
        elif isinstance(e, aiohttp.ClientError):
            e = RequestFailed(f"router: {type(e).__name__}: {e}", K.ROUTER_ERROR)
        if not att.prog.life.done:
            att.prog.life.apply(Event.FAIL, now(), str(e))
        att.prog.rec.failure_kind, att.prog.rec.failure_node = e.kind.value, e.at
        st.metrics.failed.labels(reason=e.kind.value).inc()
        log.warning("request %s failed: %s", rid, e)
        return await reply.fail(str(e), record_ext(att.prog, att.sent))
    except ConnectionError:
        # The client went away mid-stream: drive's cleanup has released the nodes' work.
        log.info("request %s: the client disconnected", rid)
        return reply.stream if reply.stream is not None else web.Response(status=499)
    finally:
        st.inflight -= 1
        note_departure(st.metrics, att.first_t is not None)
        if att.holding:
            st.tracker.decode_done(att.plan.d)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "chat")


async def responses(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "responses")


class ModelObject(TypedDict):
    """An entry of GET /v1/models (vLLM's fields)."""

    id: str
    object: str
    created: int
    owned_by: str
    root: str
    parent: None
    max_model_len: int
    permission: list[str]


def _model_object(request: web.Request) -> ModelObject:
    spec = request.app[STATE].cfg.deployment.scenario.model
    return {
        "id": spec.name,
        "object": "model",
        "created": 0,
        "owned_by": "prfaas-testbed",
        "root": spec.name,
        "parent": None,
        "max_model_len": spec.max_context_tokens,
        "permission": [],
    }


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_object(request)]})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{id}: the served model, or OpenAI's 404 for any other."""
    obj = _model_object(request)
    asked = request.match_info["id"]
    if asked != obj["id"]:
        return error_response(
            404,
            f"The model {asked!r} does not exist (this deployment serves {obj['id']!r})",
            param="model",
            code="model_not_found",
        )
    return web.json_response(obj)


async def info(request: web.Request) -> web.Response:
    """GET /testbed/info: what a client should know to read its own figures."""
    sc = request.app[STATE].cfg.deployment.scenario
    k = sc.serving.stream_interval
    return web.json_response(
        {
            "scenario": sc.name,
            "model": sc.model.name,
            "max_model_len": sc.model.max_context_tokens,
            "speedup": sc.scale.speedup,
            "byte_scale": sc.scale.byte_scale,
            "stream_interval": k,
            "tokens_per_chunk": k,
            "note": "each streamed chunk carries up to tokens_per_chunk tokens: per-chunk client figures (inter-"
            "chunk latency) cover that many tokens"
            if k > 1
            else "one token per streamed chunk",
        }
    )


# What the OpenAI API has and this server does not emulate: named in the 404, so a client knows
# it reached a server, just not one with that endpoint.
NOT_EMULATED = (
    "/v1/embeddings",
    "/v1/images",
    "/v1/audio",
    "/v1/moderations",
    "/v1/files",
    "/v1/uploads",
    "/v1/batches",
    "/v1/fine_tuning",
    "/v1/assistants",
    "/v1/threads",
    "/v1/vector_stores",
    "/v1/realtime",
    "/v1/evals",
    "/v1/containers",
    "/v1/conversations",
)
SERVED = "/v1/completions, /v1/chat/completions, /v1/responses, /v1/models"


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """An OpenAI error body for every error aiohttp would answer in plain text (unknown route,
    wrong method, a body over the size limit)."""
    try:
        resp: web.StreamResponse = await handler(request)
        return resp
    except web.HTTPException as e:
        if e.status < 400 or e.content_type == "application/json":
            raise
        where = f"{request.method} {request.path}"
        if e.status == 404:
            emulated = not any(request.path.startswith(p) for p in NOT_EMULATED)
            msg = (
                f"Invalid URL ({where}); this server answers {SERVED}"
                if emulated
                else f"{where} is not emulated by this testbed; it answers {SERVED}"
            )
            return error_response(404, msg, code="unknown_url" if emulated else "not_emulated")
        if e.status == 405:
            allow = e.headers.get("Allow", "")
            return error_response(
                405,
                f"Method not allowed ({where}); allowed: {allow}",
                code="method_not_allowed",
                headers={"Allow": allow},
            )
        return error_response(
            e.status, f"{where}: {e.reason}", "server_error" if e.status >= 500 else "invalid_request_error"
        )
    except Exception as e:  # a bug: still an error body the client can read
        log.exception("%s %s failed", request.method, request.path)
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")


async def version(request: web.Request) -> web.Response:
    """vLLM's /version; the testbed's own version (clients only check that it answers)."""
    from importlib import metadata

    try:
        v = metadata.version("prfaas-testbed")
    except metadata.PackageNotFoundError:
        v = "unknown"
    return web.json_response({"version": v, "server": "prfaas-testbed"})
