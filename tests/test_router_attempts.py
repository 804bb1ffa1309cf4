"""The router's retry and deadline decisions (`testbed.live.router.attempts.Attempts`) against
fake nodes at the `Drive` seam: which instances a retry goes to, when it gives up, and what the
client is answered."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from testbed.config.scenarios import load_scenario
from testbed.core.failures import FailureKind as K
from testbed.core.lifecycle import Lifecycle
from testbed.core.record import NO_TRACE_INDEX, RequestRecord
from testbed.core.router.route_step import RoutePlan
from testbed.core.schema.topology import node_specs
from testbed.live.clock import now
from testbed.live.common import ServiceConfig
from testbed.live.deployment import Deployment, Endpoint, NodeEndpoint
from testbed.live.openai_api import ParsedRequest
from testbed.live.router.attempts import Attempts
from testbed.live.router.drive import route
from testbed.live.router.records import Seen
from testbed.live.router.reply import Reply
from testbed.live.router.state import Progress, RequestFailed, RouterState, new_state
from testbed.live.router.vllm_metrics import make_metrics
from testbed.metrics.series_format import SeriesWriter
from testbed.run.load import resolve

pytestmark = pytest.mark.pure

HANG = "hang"
REQ = ParsedRequest("completions", "m", 100, 4, stream=True, include_usage=False)


class FakeNodes:
    """The nodes behind `Drive`: attempt k yields script[k]'s token counts, then raises its
    error (if any) or, for HANG, never answers. Records where each attempt went."""

    def __init__(self, *script: tuple[list[int], RequestFailed | str | None]) -> None:
        self.script = list(script)
        self.calls: list[tuple[str, str, str]] = []  # (node request id, prefill node, decode node)

    async def __call__(
        self, st: RouterState, req: ParsedRequest, rid: str, node_rid: str, plan: RoutePlan, prog: Progress
    ) -> AsyncIterator[int]:
        self.calls.append((node_rid, plan.d.prefill_node, plan.d.decode_node))
        tokens, end = self.script[len(self.calls) - 1]
        for n in tokens:
            yield n
        if end == HANG:
            await asyncio.Event().wait()
        if isinstance(end, RequestFailed):
            raise end


def _state(session: aiohttp.ClientSession, prefill: int = 2, decode: int = 2, **serving: Any) -> RouterState:
    sc = load_scenario(
        "paper-homogeneous",
        {
            "scale": {"speedup": 40, "byte_scale": 1024},
            "clusters": [
                {
                    "name": "pd",
                    "datacenter": "local",
                    "kind": "pd",
                    "hardware": "h20",
                    "prefill": prefill,
                    "decode": decode,
                }
            ],
            "serving": serving,
        },
    )
    rs = resolve(sc)
    nowhere = Endpoint("127.0.0.1", 9)  # never dialled: the fake stands in for the nodes
    nodes = {s.id: NodeEndpoint(s.id, s.role, s.cluster, s.datacenter, nowhere) for s in node_specs(rs.spec)}
    cfg = ServiceConfig(Deployment(rs, nowhere, nodes), "router")
    return new_state(
        cfg,
        session,
        make_metrics(CollectorRegistry(), sc.model.name, sc.model.max_context_tokens),
        SeriesWriter(None, "router"),
    )


def _attempts(st: RouterState, nodes: FakeNodes, relayed: list[tuple[int, int]]) -> Attempts:
    rid = "r1"
    prog = Progress(Lifecycle(rid), RequestRecord(rid, NO_TRACE_INDEX, REQ.input_tokens, REQ.output_tokens))
    seen = Seen(now(), prog)

    async def relay(new: int, before: int) -> None:
        relayed.append((new, before))

    return Attempts(st, REQ, rid, route(st, REQ, rid), prog, seen, relay, nodes)


async def test_a_decode_node_refusing_before_any_token_is_retried_once_on_the_other_decode_node() -> None:
    async with aiohttp.ClientSession() as session:
        st = _state(session)
        relayed: list[tuple[int, int]] = []
        nodes = FakeNodes()
        att = _attempts(st, nodes, relayed)
        first = att.plan.d.decode_node
        refused = RequestFailed(f"decode node {first} unreachable", K.DECODE_DOWN, first, "refused")
        nodes.script = [([], refused), ([1, 2, 4], None)]
        await att.run()
    (rid0, _, d0), (rid1, _, d1) = nodes.calls
    assert d0 == first and d1 != d0
    assert (rid0, rid1) == ("r1", "r1~retry1") and st.ids.in_flight == 0  # the retry's id is released
    assert st.health.state(d0) == "down"  # refused: out at once
    assert relayed == [(1, 0), (1, 1), (2, 2)] and att.sent == 4 and att.seen.sent == 4
    assert st.retries == 1 and att.prog.rec.retries == 1 and "unreachable" in att.prog.rec.retry_reason
    assert (att.prog.rec.retry_kind, att.prog.rec.retry_node) == ("decode_node_down", first)  # as data
    assert att.seen.prog is att.prog and att.holding and att.plan.d.decode_node == d1
    assert st.tracker.active[d0] == 0 and st.tracker.active[d1] == 1  # the failed slot is freed


async def test_a_failure_naming_no_instance_retries_away_from_both_instances_it_used() -> None:
    async with aiohttp.ClientSession() as session:
        st = _state(session)
        nodes = FakeNodes(([], RequestFailed("decode failed", K.KV_TRANSFER)), ([4], None))
        await _attempts(st, nodes, []).run()
    (_, p0, d0), (_, p1, d1) = nodes.calls
    assert p1 != p0 and d1 != d0
    assert st.health.down() == frozenset()  # nobody was blamed


async def test_with_nothing_else_of_the_role_left_a_retry_goes_back_to_a_failed_but_not_down_instance() -> None:
    async with aiohttp.ClientSession() as session:
        st = _state(session, prefill=1, decode=1)
        nodes = FakeNodes(([], RequestFailed("decode node pd-d0 stream broke", K.DECODE_DOWN, "pd-d0")), ([4], None))
        await _attempts(st, nodes, []).run()
    assert [c[1:] for c in nodes.calls] == [("pd-p0", "pd-d0")] * 2
    assert st.health.state("pd-d0") == "up" and st.retries == 1  # one failure does not take it out


@pytest.mark.parametrize(
    "first, second, why",
    [
        ([1], RequestFailed("decode node pd-d0 stream broke", K.DECODE_DOWN, "pd-d0"), "a token reached the client"),
        (
            [],
            RequestFailed("decode node pd-d0 answered 400: bad", K.DECODE_ERROR, retryable=False, at="pd-d0"),
            "not retryable",
        ),
    ],
)
async def test_no_retry_once_a_token_was_sent_or_when_the_failure_is_not_retryable(
    first: list[int], second: RequestFailed, why: str
) -> None:
    async with aiohttp.ClientSession() as session:
        st = _state(session)
        nodes = FakeNodes((first, second), ([4], None))
        att = _attempts(st, nodes, [])
        with pytest.raises(RequestFailed) as got:
            await att.run()
    assert got.value is second, why
    assert len(nodes.calls) == 1 and st.retries == 0 and att.prog.rec.retries == 0
    assert not att.holding and all(v == 0 for k, v in st.tracker.active.items() if "-d" in k)


async def test_a_second_failure_gives_up_with_its_own_reason() -> None:
    async with aiohttp.ClientSession() as session:
        st = _state(session)
        nodes = FakeNodes(
            ([], RequestFailed("decode failed", K.KV_TRANSFER)),
            ([], RequestFailed("prefill node pd-p1 unreachable", K.PREFILL_DOWN, "pd-p1")),
        )
        att = _attempts(st, nodes, [])
        with pytest.raises(RequestFailed, match="pd-p1 unreachable"):
            await att.run()
    assert len(nodes.calls) == 2 and st.retries == 1 and not att.holding


async def test_a_refused_only_instance_leaves_nothing_to_retry_on() -> None:
    async with aiohttp.ClientSession() as session:
        st = _state(session, prefill=1, decode=1)
        refused = RequestFailed("decode node pd-d0 unreachable", K.DECODE_DOWN, "pd-d0", "refused")
        nodes = FakeNodes(([], refused), ([4], None))
        att = _attempts(st, nodes, [])
        with pytest.raises(RequestFailed) as got:
            await att.run()
    assert str(got.value).startswith("decode node pd-d0 unreachable; no instance left to retry on")
    # The request dies of the attempt's failure: its kind and instance, as data.
    assert got.value.failure.kind == K.DECODE_DOWN and got.value.failure.node == "pd-d0"
    assert not got.value.retryable and len(nodes.calls) == 1 and st.retries == 0


async def test_the_deadline_covers_the_retry_and_ends_an_attempt_that_never_answers() -> None:
    async with aiohttp.ClientSession() as session:
        # 2 s paper at speedup 40: 50 ms of wire time for the whole request, retry included.
        st = _state(session, deadline_s=2.0, deadline_floor_wire_s=0.01)
        nodes = FakeNodes(([], RequestFailed("decode failed", K.KV_TRANSFER)), ([], HANG))
        att = _attempts(st, nodes, [])
        assert att.deadline_wire_s() == pytest.approx(0.05)
        t0 = now()
        with pytest.raises(RequestFailed) as got:
            await att.run()
        took = now() - t0
    assert str(got.value) == "deadline exceeded: no answer within 2 s (paper)" and not got.value.retryable
    assert got.value.kind == K.DEADLINE and got.value.at == ""
    assert 0.05 <= took < 1.0 and len(nodes.calls) == 2
    assert att.holding  # the retry's slot: the handler frees it


async def test_the_deadline_floor_holds_when_the_paper_deadline_is_shorter() -> None:
    async with aiohttp.ClientSession() as session:
        st = _state(session, deadline_s=2.0, deadline_floor_wire_s=7.0)
        assert _attempts(st, FakeNodes(), []).deadline_wire_s() == 7.0


async def test_a_client_that_did_not_stream_gets_a_502_with_the_record_and_a_200_when_done() -> None:
    req = ParsedRequest("chat", "m", 100, 4, stream=False, include_usage=False)
    failed = await Reply(req, "chatcmpl-1", "m").fail("deadline exceeded: x", {"testbed": {"outcome": "failed"}})
    assert failed.status == 502
    assert json.loads(failed.body) == {
        "error": {"message": "deadline exceeded: x", "type": "server_error", "param": None, "code": 502},
        "testbed": {"outcome": "failed"},
    }
    done = await Reply(req, "chatcmpl-1", "m").finish(4, {"testbed": {}}, 0)
    body = json.loads(done.body)
    assert done.status == 200 and body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 4
