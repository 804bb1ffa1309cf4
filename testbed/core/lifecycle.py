"""Request lifecycle as a state machine held in data: (state, event) -> next state.

Layer-wise pipelining means the KV transfer starts while prefill runs, so TRANSFER_START is
legal during PREFILLING; the request is in TRANSFERRING once compute ends and only the
transfer tail remains.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class State(str, Enum):
    ARRIVED = "arrived"
    ROUTED = "routed"
    PREFILL_QUEUED = "prefill_queued"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    KV_READY = "kv_ready"
    DECODING = "decoding"
    COMPLETED = "completed"
    FAILED = "failed"


class Event(str, Enum):
    ROUTE = "route"
    ENQUEUE_PREFILL = "enqueue_prefill"
    START_PREFILL = "start_prefill"
    TRANSFER_START = "transfer_start"
    END_PREFILL = "end_prefill"
    KV_COMPLETE = "kv_complete"
    ADMIT = "admit"
    FIRST_TOKEN = "first_token"
    FINISH = "finish"
    FAIL = "fail"


S, E = State, Event
TRANSITIONS: dict[tuple[State, Event], State] = {
    (S.ARRIVED, E.ROUTE): S.ROUTED,
    (S.ROUTED, E.ENQUEUE_PREFILL): S.PREFILL_QUEUED,
    (S.PREFILL_QUEUED, E.START_PREFILL): S.PREFILLING,
    (S.PREFILLING, E.TRANSFER_START): S.PREFILLING,
    (S.PREFILLING, E.END_PREFILL): S.TRANSFERRING,
    (S.TRANSFERRING, E.TRANSFER_START): S.TRANSFERRING,
    (S.TRANSFERRING, E.KV_COMPLETE): S.KV_READY,
    (S.KV_READY, E.ADMIT): S.DECODING,
    (S.DECODING, E.FIRST_TOKEN): S.DECODING,
    (S.DECODING, E.FINISH): S.COMPLETED,
}
TERMINAL = frozenset({S.COMPLETED, S.FAILED})
_NEXT = TRANSITIONS.get  # bound once: a request applies about ten events
_FAIL = Event.FAIL


class InvalidTransition(ValueError):
    pass


@dataclass
class Lifecycle:
    """One request's progress; `times` keeps the first time each event happened."""

    request_id: str
    state: State = State.ARRIVED
    times: dict[Event, float] = field(default_factory=dict)
    reason: str = ""

    def apply(self, event: Event, now: float, reason: str = "") -> State:
        if event is _FAIL:
            if self.state in TERMINAL:
                raise InvalidTransition(f"fail in terminal state {self.state.value}")
            self.state = State.FAILED
            self.reason = reason or "failed"
            self.times.setdefault(event, now)
            return self.state
        nxt = _NEXT((self.state, event))
        if nxt is None:
            raise InvalidTransition(f"event {event.value} not allowed in state {self.state.value}")
        self.state = nxt
        times = self.times
        if event not in times:
            times[event] = now
        return nxt

    @property
    def done(self) -> bool:
        return self.state in TERMINAL
