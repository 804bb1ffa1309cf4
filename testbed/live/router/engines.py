"""The router over the engines' PD protocols (`nodes.protocol` vllm or sglang): the same routing
(`drive.route`: the policy, its books, its placement of prefill node, cluster and decode node),
another way to ask the nodes. This is the seam: `drive_for` gives `Attempts` the attempt driver
of the deployment's protocol.

vLLM (vllm-router's two stages, NixlConnector's fields; tests/fixtures/routers): the client's
request goes to the chosen prefill node with `max_tokens: 1`, `min_tokens: 1`, `stream: false`
and `kv_transfer_params: {do_remote_decode: true, ...}`; the `kv_transfer_params` it answers go
verbatim into the client's request to the chosen decode node, which pulls the KV and streams.
SGLang (sglang-router's one stage): the same request to the prefill and the decode node at once,
with `bootstrap_host`/`bootstrap_port` (the prefill node's) and a 64-bit `bootstrap_room`.
Both carry `X-Request-Id`: the id the nodes log their stamps under (SGLang's nodes use
`room-<room>`), named in the final chunk so the replayer joins the stage logs to the record.

What an engine does not tell the router, and what is used instead (`Progress.observed`):
- when the prefill started and ended: its answer (vLLM answers at its end; SGLang's once pushed);
- when the KV is complete at the decode side (the testbed's `kv` event): the decode's first
  token, so the cache book's decode-side insert and the control loop's KV tail (first token
  less the prefill's answer: an upper bound, admission and one decode step included) come later;
- tokens as they are made: the decode's `usage.completion_tokens` per chunk (vLLM's and
  SGLang's `stream_options.continuous_usage_stats`); the client's answer is the router's own
  text of that many tokens, not the engine's;
- the cached prefix to reuse: an engine finds it in its own prefix cache (the mock engines take
  the router's view from a testbed client's `testbed` object, `EngineAttempt.body`); a
  cross-cluster cache move has no step in these protocols, so a decision with one is carried
  out without it (the prefill recomputes the prefix) and its record says so;
- the senders' WAN counters (`/status`, the bandwidth-aware loop's link signals) exist on the
  mock nodes only; a real engine answers none and the loop counts it as sending nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp

from testbed.core.failures import FailureKind as K
from testbed.core.json_types import JSONObject
from testbed.core.lifecycle import Event
from testbed.core.router.route_step import RoutePlan
from testbed.live.clock import now
from testbed.live.openai_api import EXTENSION, ParsedRequest
from testbed.live.router.state import Progress, RequestFailed, RouterState, outcome_of

REQUEST_ID_HEADER = "X-Request-Id"
ENGINE_PROTOCOLS = ("vllm", "sglang")
# vLLM's stage 1: the transfer parameters vllm-router sets on the prefill's request.
VLLM_PREFILL_PARAMS: JSONObject = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# The decode's stream: usage in every chunk is how the router counts tokens without a tokenizer.
DECODE_STREAM: JSONObject = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}

Body = Mapping[str, object]
EngineDrive = Callable[[RouterState, ParsedRequest, str, str, RoutePlan, Progress], AsyncIterator[int]]


def vllm_prefill_body(body: Body) -> dict[str, object]:
    """Stage 1: the client's request as a one-token, unstreamed prefill whose KV is decoded
    elsewhere (vLLM refuses `stream_options` without `stream`)."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out |= {"max_tokens": 1, "min_tokens": 1, "stream": False, "kv_transfer_params": dict(VLLM_PREFILL_PARAMS)}
    if "max_completion_tokens" in out:  # vLLM's chat takes it over max_tokens
        out["max_completion_tokens"] = 1
    return out


def vllm_decode_body(body: Body, kv_transfer_params: JSONObject) -> dict[str, object]:
    """Stage 2: the client's request with the prefill's `kv_transfer_params`, streamed."""
    return {**body, **DECODE_STREAM, "kv_transfer_params": kv_transfer_params}


def sglang_body(body: Body, host: str, port: int, room: int) -> dict[str, object]:
    """What both nodes get: the client's request with the prefill's bootstrap address and room."""
    return {**body, **DECODE_STREAM, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}


def room_of(node_rid: str) -> int:
    """The attempt's bootstrap room: 64 bits of its node-side id (unique per attempt, as the
    routers' random rooms are), so the nodes' `room-<room>` stage lines can be joined."""
    return int.from_bytes(hashlib.blake2b(node_rid.encode(), digest_size=8).digest(), "big")


def chat_path(req: ParsedRequest) -> str:
    return "/v1/chat/completions" if req.kind == "chat" else "/v1/completions"


class DecodeStream:
    """The decode node's SSE answer read as cumulative completion tokens (`next`: the count once
    it has grown, None at `[DONE]`); an error chunk or a broken stream is a `RequestFailed`."""

    def __init__(self, resp: aiohttp.ClientResponse, node: str) -> None:
        self.resp, self.node, self.count = resp, node, 0

    async def next(self) -> int | None:
        while True:
            try:
                raw = await self.resp.content.readline()
            except (aiohttp.ClientError, ConnectionError) as e:
                raise RequestFailed(
                    f"decode node {self.node} stream broke: {type(e).__name__}: {e}", K.DECODE_DOWN, self.node
                ) from None
            if not raw:
                raise RequestFailed(f"decode node {self.node} closed the stream early", K.DECODE_DOWN, self.node)
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return None
            try:
                obj = json.loads(data)
            except ValueError:
                raise RequestFailed(
                    f"decode node {self.node} sent a chunk that is not JSON", K.DECODE_ERROR, self.node
                ) from None
            if not isinstance(obj, dict):
                continue
            if "error" in obj:
                err = obj["error"]
                msg = err.get("message", err) if isinstance(err, dict) else err
                raise RequestFailed(f"decode node {self.node}: {msg}", _kind(str(msg)), at=self.node)
            usage = obj.get("usage")
            n = usage.get("completion_tokens") if isinstance(usage, dict) else None
            if isinstance(n, int) and not isinstance(n, bool) and n > self.count:
                self.count = n
                return n


def _kind(message: str) -> K:
    return K.KV_TRANSFER if "kv " in message.lower() else K.DECODE_ERROR


class EngineAttempt:
    """One attempt's book-keeping over an engine protocol: the events the router observes, in
    the lifecycle's order (`Progress.observed`), and the books' updates at each."""

    def __init__(self, st: RouterState, req: ParsedRequest, rid: str, plan: RoutePlan, prog: Progress) -> None:
        self.st, self.req, self.rid, self.plan, self.prog = st, req, rid, plan, prog
        self.prefill_answered = False  # the tracker and the cache book have its prefill
        self.prefill_over = False  # the lifecycle has it (answered, or a token proves it)
        self.answer_t = math.nan
        self.first_t: float | None = None
        prog.observed = [(prog.rec.times.routed, Event.ROUTE)]
        d, rec = plan.d, prog.rec
        if d.cache_move is not None:
            # No step of the engines' protocols moves a cached prefix between clusters: the
            # prefill node recomputes what its own cluster lacks.
            rec.cached_tokens = d.cache_move.from_tokens
            if d.decode_cluster == d.prefill_cluster:
                rec.decode_cached_tokens = rec.cached_tokens
            rec.cache_move_tokens, rec.cache_move_src, rec.cache_move_bytes_paper = 0, "", 0
            rec.route_reason += f"; cache move not made ({st.cfg.deployment.scenario.node_protocol} protocol has none)"

    def body(self, body: Body) -> Body:
        """The client's request as the nodes get it: a testbed client's `testbed` object (lengths
        and hashes in place of a prompt) gains the router's view of the cached prefixes, which the
        mock engines take for their own prefix cache's (`testbed.live.vllm_pd.prefix_hint`); any
        other request goes on as the client sent it."""
        ext = body.get(EXTENSION)
        if not isinstance(ext, dict):
            return body
        rec = self.prog.rec
        hint: dict[str, object] = {"cached_tokens": rec.cached_tokens, "decode_cached_tokens": rec.decode_cached_tokens}
        after = self.plan.d.prefix_after
        if after:
            # The request the prefill waits for, by the id the engine's node knows it by.
            sglang = self.st.cfg.deployment.scenario.node_protocol == "sglang"
            hint["prefix_after"] = f"room-{room_of(after)}" if sglang else after
        return {**body, EXTENSION: {**ext, **hint}}

    def sent_prefill(self) -> None:
        t = self.prog.rec.times.prefill_sent = now()
        self.see(t, Event.ENQUEUE_PREFILL)

    def see(self, t: float, ev: Event) -> None:
        assert self.prog.observed is not None
        self.prog.observed.append((t, ev))

    def _prefill_over(self, t: float) -> None:
        if not self.prefill_over:
            self.prefill_over = True
            self.see(t, Event.START_PREFILL)
            self.see(t, Event.END_PREFILL)

    def prefilled(self) -> None:
        """The prefill node answered."""
        st, d = self.st, self.plan.d
        self.answer_t = t = now()
        self.prefill_answered = True
        self._prefill_over(t)
        st.tracker.prefill_done(d, self.plan.work, self.plan.rid, self.plan.hashes)
        st.note_health(d.prefill_node, "ok", t)
        st.prefilled(self.rid, self.plan, self.req.input_tokens, moved=False)

    def token(self) -> None:
        """A count came from the decode node; the first says its KV is complete."""
        if self.first_t is not None:
            return
        t = self.first_t = now()
        self._prefill_over(t)
        for ev in (Event.KV_COMPLETE, Event.ADMIT, Event.FIRST_TOKEN):
            self.see(t, ev)
        if self.plan.d.crossed_wan and math.isfinite(self.answer_t):
            self.st.note_tail(max(t - self.answer_t, 0.0))
        self.st.kv_complete(self.rid, self.plan, self.req.input_tokens)

    def finished(self) -> None:
        t = now()
        self.st.note_health(self.plan.d.decode_node, "ok", t)
        self.see(t, Event.FINISH)

    def over(self) -> None:
        self.st.attempt_over(self.rid, self.plan, self.prefill_answered)


def _prefill_failed(node: str, status: int, text: str) -> RequestFailed:
    return RequestFailed(
        f"prefill node {node} answered {status}: {text[:200]}",
        K.PREFILL_ERROR,
        node if status >= 500 else "",
        retryable=status >= 500,
        at=node,
    )


async def _open_decode(st: RouterState, node: str, path: str, body: Body, headers: dict[str, str]) -> DecodeStream:
    url = st.cfg.deployment.nodes[node].http.url + path
    try:
        resp = await st.session.post(url, json=body, headers=headers)
    except aiohttp.ClientError as e:
        raise RequestFailed(f"decode node {node} unreachable: {e}", K.DECODE_DOWN, node, outcome_of(e)) from None
    if resp.status != 200:
        text = await resp.text()
        resp.release()
        raise RequestFailed(
            f"decode node {node} answered {resp.status}: {text[:200]}",
            _kind(text),
            node if resp.status >= 500 else "",
            retryable=resp.status >= 500,
            at=node,
        )
    return DecodeStream(resp, node)


async def _post_prefill(st: RouterState, node: str, path: str, body: Body, headers: dict[str, str]) -> tuple[int, str]:
    url = st.cfg.deployment.nodes[node].http.url + path
    try:
        async with st.session.post(url, json=body, headers=headers) as r:
            return r.status, await r.text()
    except aiohttp.ClientError as e:
        raise RequestFailed(f"prefill node {node} unreachable: {e}", K.PREFILL_DOWN, node, outcome_of(e)) from None


def _transfer_params(node: str, text: str) -> JSONObject:
    try:
        ans = json.loads(text)
    except ValueError:
        ans = None
    ktp = ans.get("kv_transfer_params") if isinstance(ans, dict) else None
    if not isinstance(ktp, dict):
        raise RequestFailed(f"prefill node {node} answered no kv_transfer_params", K.PREFILL_ERROR, node)
    return ktp


def drive_vllm(body: Body) -> EngineDrive:
    """vLLM's two stages for the client's request `body`."""

    async def drive(
        st: RouterState, req: ParsedRequest, rid: str, node_rid: str, plan: RoutePlan, prog: Progress
    ) -> AsyncIterator[int]:
        d, path = plan.d, chat_path(req)
        headers = {REQUEST_ID_HEADER: node_rid}
        prog.node_request_id = node_rid
        att = EngineAttempt(st, req, rid, plan, prog)
        sent = att.body(body)
        stream: DecodeStream | None = None
        try:
            att.sent_prefill()
            status, text = await _post_prefill(st, d.prefill_node, path, vllm_prefill_body(sent), headers)
            if status != 200:
                raise _prefill_failed(d.prefill_node, status, text)
            ktp = _transfer_params(d.prefill_node, text)
            att.prefilled()
            stream = await _open_decode(st, d.decode_node, path, vllm_decode_body(sent, ktp), headers)
            while (n := await stream.next()) is not None:
                att.token()
                yield n
            att.finished()
        finally:
            if stream is not None:
                stream.resp.close()
            att.over()

    return drive


def drive_sglang(body: Body) -> EngineDrive:
    """SGLang's one stage for the client's request `body`: prefill and decode at once."""

    async def drive(
        st: RouterState, req: ParsedRequest, rid: str, node_rid: str, plan: RoutePlan, prog: Progress
    ) -> AsyncIterator[int]:
        d, path = plan.d, chat_path(req)
        room = room_of(node_rid)
        prog.node_request_id = f"room-{room}"
        p = st.cfg.deployment.nodes[d.prefill_node].http
        headers = {REQUEST_ID_HEADER: node_rid}
        att = EngineAttempt(st, req, rid, plan, prog)
        both = sglang_body(att.body(body), p.host, p.port, room)
        att.sent_prefill()
        ptask = asyncio.create_task(_post_prefill(st, d.prefill_node, path, both, headers))
        stream: DecodeStream | None = None
        ntask: asyncio.Task[int | None] | None = None

        def take_prefill() -> None:
            status, text = ptask.result()
            if status != 200:
                raise _prefill_failed(d.prefill_node, status, text)
            att.prefilled()

        try:
            stream = await _open_decode(st, d.decode_node, path, both, headers)
            ntask = asyncio.create_task(stream.next())
            while True:
                waiting: set[asyncio.Task[Any]] = {ntask}
                if not att.prefill_answered:
                    waiting.add(ptask)
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if ptask in done and not att.prefill_answered:
                    take_prefill()  # a failed prefill ends the attempt now, not at the KV timeout
                if ntask not in done:
                    continue
                n = ntask.result()
                if n is None:
                    break
                att.token()
                yield n
                ntask = asyncio.create_task(stream.next())
            if not att.prefill_answered:
                await ptask
                take_prefill()
            att.finished()
        finally:
            for task in (ptask, ntask):
                if task is not None and not task.done():
                    task.cancel()
                elif task is not None and not task.cancelled():
                    task.exception()  # retrieved: the attempt's own failure is already raised
            if stream is not None:
                stream.resp.close()
            att.over()

    return drive


def drive_for(protocol: str, body: Body) -> EngineDrive:
    """The attempt driver of an engine protocol for the client's request `body`."""
    if protocol == "vllm":
        return drive_vllm(body)
    if protocol == "sglang":
        return drive_sglang(body)
    raise ValueError(f"no engine protocol {protocol!r} (one of {ENGINE_PROTOCOLS})")
