"""Trace replay against the router's OpenAI-style streaming API.

Open loop: each trace request is sent at its (time-scaled) timestamp whatever happened to earlier
ones. Closed loop: a session's first turn is sent at its timestamp and each later turn when the
rule of `testbed.core.sessions` releases it (after its parent's answer), as the simulator does.
Each request lands in the records exactly once: completed, failed with the reason, or, when the
run is interrupted, failed as interrupted / not sent. A request of a session carries its session
id to the router in the `X-Session-ID` header (as aiperf sends it), so sticky routing may use it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from collections.abc import Callable

import aiohttp

from testbed.core.failures import Failure
from testbed.core.failures import FailureKind as K
from testbed.core.json_types import JSONObject
from testbed.core.record import RequestRecord, record_from_wire
from testbed.core.sessions import ArrivalMode, ClosedLoop
from testbed.live.clock import now, sleep_until
from testbed.live.openai_api import EXTENSION
from testbed.live.replay_stats import ReplayStats as ReplayStats  # re-exported
from testbed.live.stage_log import NODE_REQUEST_ID
from testbed.metrics.node_stages import NodeStages, fill_record
from testbed.metrics.records import RecordWriter
from testbed.traces.sessions import run_sessions
from testbed.traces.types import Trace, TraceRequest

START_LEAD_S = 0.5  # first request leaves this long after t0, so t0 is never in the past
SESSION_HEADER = "X-Session-ID"


def request_body(tr: TraceRequest, model: str) -> JSONObject:
    """The completions request that replays `tr`: its exact lengths and hashes in the `testbed` field."""
    return {
        "model": model,
        "prompt": "",
        "max_tokens": tr.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        EXTENSION: {"input_tokens": tr.input_tokens, "hash_ids": list(tr.hash_ids), "request_id": tr.request_id},
    }


def _spelled(seed: str, tokens: int, sep: str) -> str:
    """`tokens` tokens of text as the nodes count it (4 bytes each), spelled from `seed`'s digest:
    three hex digits and `sep` per token."""
    digest = hashlib.blake2b(seed.encode(), digest_size=24).hexdigest()  # 16 distinct tokens, repeated
    words = [digest[i : i + 3] + sep for i in range(0, 48, 3)]
    return "".join(words[i % len(words)] for i in range(tokens))


def standard_prompt(tr: TraceRequest, block_tokens: int) -> str:
    """Prompt text of exactly `tr.input_tokens` tokens as the mock nodes count text (4 UTF-8 bytes
    a token), whose blocks are equal exactly where the trace's hash_ids are: block i is spelled
    from hash_ids[i], the rest from the request id, so two requests share a prefix only as far
    as their hashes do."""
    parts: list[str] = []
    left = tr.input_tokens
    for h in tr.hash_ids:
        if left <= 0:
            break
        n = min(block_tokens, left)
        parts.append(_spelled(f"block {h}", n, " "))
        left -= n
    if left > 0:
        parts.append(_spelled(f"request {tr.request_id}", left, "."))
    return "".join(parts)


def standard_body(tr: TraceRequest, model: str, block_tokens: int) -> dict[str, object]:
    """The completions request a foreign router can pass on unchanged: no testbed extension."""
    return {
        "model": model,
        "prompt": standard_prompt(tr, block_tokens),
        "max_tokens": tr.output_tokens,
        "min_tokens": tr.output_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send_standard(
    session: aiohttp.ClientSession,
    url: str,
    tr: TraceRequest,
    rec: RequestRecord,
    t0: float,
    model: str,
    block_tokens: int,
    stages: NodeStages,
) -> None:
    """One request through a foreign router: the client's stamps here, the rest from the nodes'
    stage logs joined by the response id (the request id the nodes saw)."""
    times = rec.times
    times.arrival = now() - t0
    rid: str | None = None
    tokens = 0
    async with session.post(f"{url}/v1/completions", json=standard_body(tr, model, block_tokens)) as resp:
        if resp.status != 200:
            text = await resp.text()
            kind = K.NO_CAPACITY if resp.status == 503 else K.BAD_REQUEST if resp.status < 500 else K.ROUTER_ERROR
            rec.fail(Failure(kind), f"router answered {resp.status}: {text[:200]}")
            return
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                rec.fail(Failure(K.ROUTER_ERROR), str(obj["error"].get("message", obj["error"]))[:300])
                return
            rid = obj.get("id", rid)
            if obj.get("usage"):
                tokens = int(obj["usage"].get("completion_tokens", tokens))
            for ch in obj.get("choices", []):
                if ch.get("text"):
                    t = now() - t0
                    if math.isnan(times.first_token):
                        times.first_token = t
                    times.last_token = t
    rec.tokens_received = tokens
    _join_stages(rec, stages, rid, t0)
    if rec.outcome == "completed" and tokens != tr.output_tokens:
        rec.fail(Failure(K.CLIENT_ERROR), f"received {tokens} of {tr.output_tokens} tokens")


async def send_one(
    session: aiohttp.ClientSession,
    url: str,
    tr: TraceRequest,
    rec: RequestRecord,
    t0: float,
    model: str,
    stages: NodeStages | None = None,
) -> None:
    """One request through the testbed's router: its record from the final chunk, and with
    `stages` (the nodes speak an engine's protocol, which carries no stamps to the router) the
    stage stamps and bytes from the nodes' logs under the id the final chunk names."""
    body = request_body(tr, model)
    node_rid: str | None = None
    times = rec.times
    times.arrival = now() - t0
    served: RequestRecord | None = None
    error: str | None = None
    tokens = 0
    headers = {SESSION_HEADER: rec.session_id} if rec.session_id else None
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            text = await resp.text()
            kind = K.NO_CAPACITY if resp.status == 503 else K.BAD_REQUEST if resp.status < 500 else K.ROUTER_ERROR
            rec.fail(Failure(kind), f"router answered {resp.status}: {text[:200]}")
            return
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                error = str(obj["error"].get("message", obj["error"]))
            if EXTENSION in obj:
                # The router's stamps are unix seconds; the record's are relative to t0.
                served = record_from_wire(obj[EXTENSION], rec.trace_index, t0)
                node_rid = obj.get(NODE_REQUEST_ID, node_rid)
            if obj.get("usage"):
                tokens = int(obj["usage"].get("completion_tokens", tokens))
            for ch in obj.get("choices", []):
                if ch.get("text"):
                    t = now() - t0
                    if math.isnan(times.first_token):
                        times.first_token = t
                    times.last_token = t
    if served is not None:
        rec.take_served(served)
    rec.tokens_received = tokens
    if error is not None:
        # The router's verdict: its record names what failed and where.
        f = (
            Failure(K(served.failure_kind), served.failure_node)
            if served is not None and served.failure_kind
            else Failure(K.ROUTER_ERROR)
        )
        rec.fail(f, error)
    elif served is None or served.outcome != "completed":
        rec.fail(Failure(K.CLIENT_ERROR), "stream ended without a completed record")
    elif tokens != tr.output_tokens:
        rec.fail(Failure(K.CLIENT_ERROR), f"received {tokens} of {tr.output_tokens} tokens")
    elif stages is not None:
        _join_stages(rec, stages, node_rid, t0)
    else:
        rec.outcome = "completed"


def _join_stages(rec: RequestRecord, stages: NodeStages, node_rid: str | None, t0: float) -> None:
    """A request's stamps and bytes from the nodes' stage logs, joined by the id the nodes saw;
    it completes unless failed already, a node logged an error, or the nodes logged nothing."""
    lines = stages.lines(node_rid) if node_rid else []
    error = fill_record(rec, lines, t0)
    if rec.outcome == "failed":
        return
    if error is not None:
        rec.fail(Failure(K.KV_TRANSFER if "kv " in error.lower() else K.DECODE_ERROR), error)
    elif not {"prefill", "decode"} <= {x.get("stage") for x in lines}:
        rec.fail(Failure(K.CLIENT_ERROR), f"the nodes logged no prefill and decode for request id {node_rid!r}")
    else:
        rec.outcome = "completed"


async def replay(
    trace: Trace,
    url: str,
    writer: RecordWriter,
    speedup: float,
    model: str = "",
    on_progress: Callable[[ReplayStats], None] | None = None,
    request_timeout: float | Callable[[TraceRequest], float] | None = None,
    t0: float | None = None,
    api_key: str | None = None,
    arrivals: ArrivalMode = "open",
    foreign: NodeStages | None = None,
    block_tokens: int = 512,
    stages: NodeStages | None = None,
) -> ReplayStats:
    """Replay `trace` (paper-time timestamps divided by `speedup`); record times are relative
    to `t0` (default: now). `api_key`: sent as `Authorization: Bearer KEY`, as OpenAI clients do.
    `arrivals`: open or closed loop (the module's docstring). `foreign`: a foreign router is in the
    router's place; requests are standard ones (trace blocks of `block_tokens`) and records come
    from these node stage logs. `stages`: the testbed's router drives nodes that speak an engine's
    protocol; its records take their stamps from these logs (`send_one`)."""
    stats = ReplayStats(total=len(trace))
    t0 = now() if t0 is None else t0
    first = START_LEAD_S
    records = [RequestRecord(r.request_id, i, r.input_tokens, r.output_tokens) for i, r in enumerate(trace)]
    plan = run_sessions(trace, arrivals)
    if plan is not None:
        for i, rec in enumerate(records):
            rec.session_id, rec.turn, rec.parent_index = plan.session[i], plan.turn[i], plan.parent[i]
    closed = ClosedLoop(plan) if arrivals == "closed" and plan is not None else None
    written = [False] * len(records)

    # Paper seconds on the trace's axis <-> the clock: the rule works in the former.
    def paper(t: float) -> float:
        return (t - t0 - first) * speedup

    def clock(p: float) -> float:
        return t0 + first + p / speedup

    def finish(i: int) -> None:
        if not written[i]:
            written[i] = True
            writer.write(records[i])
            if records[i].outcome == "completed":
                stats.completed += 1
            else:
                stats.failed += 1
            if on_progress:
                on_progress(stats)

    def release(i: int) -> None:
        """Closed loop: request i is done; start the turns it releases."""
        if closed is None:
            return
        for c, at in closed.done(i, paper(now())):
            tasks.append(asyncio.create_task(turn(c, at)))

    async def turn(i: int, at: float) -> None:
        await sleep_until(clock(at))
        start(i)
        await run(i, trace.requests[i])

    def start(i: int) -> None:
        if closed is not None:
            closed.sent(i, paper(now()))
        stats.sent += 1
        if on_progress:
            on_progress(stats)

    async def run(i: int, tr: TraceRequest) -> None:
        rec = records[i]
        limit = request_timeout(tr) if callable(request_timeout) else request_timeout
        try:
            one = (
                send_one(session, url, tr, rec, t0, model, stages)
                if foreign is None
                else send_standard(session, url, tr, rec, t0, model, block_tokens, foreign)
            )
            await asyncio.wait_for(one, limit)
        except asyncio.CancelledError:
            rec.fail(Failure(K.INTERRUPTED), "interrupted: run stopped before the request finished")
            finish(i)
            raise
        except TimeoutError:
            rec.fail(Failure(K.CLIENT_TIMEOUT), f"no answer within {limit:g} s (wire): the client gave up")
        except (aiohttp.ClientError, ValueError, KeyError) as e:
            rec.fail(Failure(K.CLIENT_ERROR), f"client error: {type(e).__name__}: {e}")
        finish(i)
        release(i)

    tasks: list[asyncio.Task[None]] = []
    connector = aiohttp.TCPConnector(limit=0)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else None
    session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None), headers=headers)
    try:
        order = closed.first_turns() if closed is not None else range(len(trace))
        reqs = trace.requests
        for i in order:
            tr = reqs[i]
            await sleep_until(clock(tr.timestamp))
            tasks.append(asyncio.create_task(run(i, tr)))
            start(i)
        # Closed loop: turns released while waiting add tasks of their own; wait for those too.
        done = 0
        while done < len(tasks):
            n = len(tasks)
            await asyncio.gather(*tasks[done:n])
            done = n
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for i, rec in enumerate(records):
            if not written[i]:
                rec.fail(Failure(K.INTERRUPTED), "not sent: run interrupted")
                finish(i)
        await session.close()
    return stats
