"""A request's attempts under its deadline: the routed plan first and, if that attempt fails
before any token reached the client, one retry elsewhere. The nodes are behind one seam, `Drive`
(`testbed.live.router.drive.drive` in service), so the retry and deadline decisions run against
a fake in tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from testbed.core.failures import FailureKind as K
from testbed.core.record import NAN
from testbed.core.router.retries import avoid_after as _avoid
from testbed.core.router.retries import deadline_paper_s, deadline_reason, may_retry, retry_id
from testbed.core.router.route_step import RoutePlan
from testbed.core.routing.policy import NoCapacity
from testbed.live.clock import now
from testbed.live.openai_api import ParsedRequest
from testbed.live.router.drive import drive, note_decision, route
from testbed.live.router.records import Seen, retry_progress
from testbed.live.router.state import Progress, RequestFailed, RouterState, log
from testbed.live.router.vllm_metrics import note_tokens

# One attempt through the nodes, known there as its own id; yields cumulative token counts.
Drive = Callable[[RouterState, ParsedRequest, str, str, RoutePlan, Progress], AsyncIterator[int]]
# Relay tokens to the client: (new tokens, tokens sent before them).
Relay = Callable[[int, int], Awaitable[None]]


def avoid_after(e: RequestFailed, plan: RoutePlan) -> frozenset[str]:
    """Where a retry should not go (`testbed.core.retries.avoid_after`)."""
    return _avoid(e.node, plan)


class Attempts:
    """One request's attempts. What the handler reads once `run` has returned or raised: `plan`
    and `prog` (the last attempt's route and record), `holding` (that plan still holds a decode
    slot in the tracker), `sent` (tokens relayed) and `first_t` (when the first came, wire clock)."""

    def __init__(
        self,
        st: RouterState,
        req: ParsedRequest,
        rid: str,
        plan: RoutePlan,
        prog: Progress,
        seen: Seen,
        relay: Relay,
        drive: Drive = drive,
    ) -> None:
        self.st, self.req, self.rid, self.seen = st, req, rid, seen
        self._relay, self._drive = relay, drive
        self.plan, self.prog = plan, prog
        self.holding = True
        self.sent = 0
        self.first_t: float | None = None
        self._last_t = NAN

    def deadline_wire_s(self) -> float:
        """The whole request's time limit, retries included (`testbed.core.router.retries`)."""
        sc = self.st.cfg.deployment.scenario
        return self.st.cfg.scale.wire_seconds(deadline_paper_s(sc, self.req.output_tokens))

    async def run(self) -> None:
        """Drive the request to its last token; `RequestFailed` when it cannot be."""
        try:
            async with asyncio.timeout(self.deadline_wire_s()):
                await self._attempts()
        except TimeoutError:
            raise RequestFailed(
                deadline_reason(self.st.cfg.deployment.scenario, self.req.output_tokens), K.DEADLINE, retryable=False
            ) from None

    def may_retry(self, e: RequestFailed) -> bool:
        """Once, and only while the client has seen nothing (`testbed.core.router.retries`)."""
        return may_retry(e.retryable, self.sent, self.prog.rec.retries)

    async def _attempts(self) -> None:
        st, rid = self.st, self.rid
        while True:
            # Nodes know an attempt by its own id: a retry may land where the failed attempt is
            # still being cleaned up. Claimed like a request's id (a client may be using it).
            retries = self.prog.rec.retries
            node_rid = rid if not retries else st.ids.claim(retry_id(rid, retries))
            try:
                async for n in self._drive(st, self.req, rid, node_rid, self.plan, self.prog):
                    await self._tokens(n)
                return
            except RequestFailed as e:
                self._failed(e)
            finally:
                if node_rid != rid:
                    st.ids.release(node_rid)

    async def _tokens(self, n: int) -> None:
        t = now()
        st = self.st
        if self.first_t is None:
            self.first_t = t
            note_tokens(st.metrics, n - self.sent, None, t - self.seen.arrival, self.req.input_tokens)
        else:
            note_tokens(st.metrics, n - self.sent, t - self._last_t)
        if n > self.sent:
            self._last_t = t
            await self._relay(n - self.sent, self.sent)
        self.sent = self.seen.sent = n

    def _failed(self, e: RequestFailed) -> None:
        """After a failed attempt: free its decode slot, tell the health book, then either give up
        (raise) or route the retry away from the failed instances."""
        st = self.st
        st.tracker.decode_done(self.plan.d)
        self.holding = False
        if e.node:
            st.note_health(e.node, e.outcome, now(), str(e))
        if not self.may_retry(e):
            raise e
        avoid = avoid_after(e, self.plan)
        log.warning("request %s: %s; retrying elsewhere", self.rid, e)
        self.prog = self.seen.prog = retry_progress(self.prog, e)
        try:
            self.plan = route(st, self.req, self.rid, avoid)
        except NoCapacity as nc:
            # The request dies of the attempt's failure: its kind and instance stay.
            raise RequestFailed(f"{e}; no instance left to retry on: {nc}", e.kind, retryable=False, at=e.at) from None
        self.holding = True
        st.retries += 1
        note_decision(st, self.rid, self.req, self.plan, self.prog)
