"""A request's record as the router keeps it: the attempt's lifecycle checked once all stamps
are in, a retry's fresh record, the `testbed` extension the final chunk carries, and, for a held
deployment, the record of what the client saw (`Seen`)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from testbed.core.failures import Failure
from testbed.core.failures import FailureKind as K
from testbed.core.json_types import JSONObject
from testbed.core.lifecycle import Lifecycle
from testbed.core.record import NAN, NO_TRACE_INDEX, RequestRecord
from testbed.live.openai_api import record_extension
from testbed.live.router.state import Progress, RequestFailed
from testbed.live.stage_log import NODE_REQUEST_ID


def replay_lifecycle(prog: Progress) -> None:
    """Drive the request's state machine through its stamps in time order. Stamps come from
    three processes over two connections, so they are checked once all are in: an order the
    machine rejects (say, admitted before its KV arrived) is a testbed bug worth failing on.
    Over an engine protocol, through the events the router observed instead."""
    events = prog.observed if prog.observed is not None else prog.rec.times.lifecycle_events()
    for t, ev in events:
        prog.life.apply(ev, t)
    if not prog.life.done:
        raise RequestFailed(f"incomplete lifecycle: stopped in state {prog.life.state.value}", K.ROUTER_ERROR)


def record_ext(prog: Progress, tokens: int) -> JSONObject:
    """The final chunk's `testbed` field: the record with the verdict and the tokens sent."""
    rec = prog.rec
    rec.outcome, rec.reason, rec.tokens_received = prog.life.state.value, prog.life.reason, tokens
    ext = record_extension(rec)
    if prog.node_request_id:
        ext[NODE_REQUEST_ID] = prog.node_request_id
    return ext


def retry_progress(old: Progress, e: RequestFailed) -> Progress:
    """A fresh attempt's progress after `e`: the client's arrival kept, the failed attempt's
    stages not."""
    rec = RequestRecord(
        old.rec.request_id,
        old.rec.trace_index,
        old.rec.input_tokens,
        old.rec.output_tokens,
        retries=old.rec.retries + 1,
        retry_reason=str(e),
        retry_kind=e.kind.value,
        retry_node=e.at,
    )
    rec.times.router_arrival = old.rec.times.router_arrival
    return Progress(Lifecycle(old.rec.request_id), rec)


@dataclass
class Seen:
    """One request as its client saw it (unix seconds), for a held deployment's records."""

    arrival: float
    prog: Progress | None = None
    first: float = NAN  # the first token chunk went out (non-streaming: the response)
    last: float = NAN
    sent: int = 0
    error: str = ""  # why it ended without a lifecycle verdict (bad request, no capacity)
    error_kind: K = K.CLIENT_GONE  # its kind
    rid: str = ""  # the id claimed for it (`RouterState.ids`), released at the end
    session: str = ""  # the client's session (`session_header`), for a held deployment's records
    turn: int = 0  # its turn in that session, by arrival (1, 2, ...)


# The headers a client names its session by: the testbed's replayer and aiperf with
# `--session-header X-Session-ID` send X-Session-ID; aiperf by default X-Correlation-ID.
SESSION_HEADERS = ("X-Session-ID", "X-Correlation-ID")
MAX_SESSION_CHARS = 128


def session_header(headers: Mapping[str, str]) -> str:
    """The request's session id from its headers ("" without one); printable and at most
    MAX_SESSION_CHARS, since it lands in the records as it came."""
    for name in SESSION_HEADERS:
        v = headers.get(name, "")
        if v:
            return "".join(c for c in v[:MAX_SESSION_CHARS] if c.isprintable() and c not in ',"\n')
    return ""


def held_record(seen: Seen) -> RequestRecord:
    if seen.prog is None:
        rec = RequestRecord(uuid.uuid4().hex[:16], NO_TRACE_INDEX, 0, 0)
    else:
        src = seen.prog.rec
        rec = dataclasses.replace(src, times=dataclasses.replace(src.times))
    if rec.outcome not in ("completed", "failed"):
        rec.fail(Failure(seen.error_kind), seen.error or "the client disconnected before the end")
    t = rec.times
    t.arrival, t.first_token, t.last_token = seen.arrival, seen.first, seen.last
    rec.tokens_received = seen.sent
    if seen.session and not rec.session_id:
        rec.session_id, rec.turn = seen.session, seen.turn
    return rec
