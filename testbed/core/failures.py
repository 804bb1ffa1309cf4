"""What ended a request attempt, as data: a kind (`FailureKind`), the instance it happened at, and
a detail for people. The point of failure names them (a node's HTTP answer, a refused connection,
a broken stream, a KV transfer, a deadline, the client), the router carries them to the record
(`failure_kind`, `failure_node`; a retried attempt's as `retry_kind`, `retry_node`), and the
metrics group by them; the reason text is for people and is never parsed. The live router and the
simulator name the same kinds and nodes for the same events, each from its own events.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FailureKind(StrEnum):
    """Why an attempt or a request failed. The node kinds name the instance (`Failure.node`)."""

    PREFILL_DOWN = "prefill_node_down"  # the prefill instance refused the call, broke it off or did not answer
    PREFILL_ERROR = "prefill_node_error"  # it answered an error status or a malformed report, or its job raised
    DECODE_DOWN = "decode_node_down"  # the decode instance refused the call, or its token stream broke
    DECODE_ERROR = "decode_node_error"  # it answered an error status, or cannot hold the request's KV
    KV_TRANSFER = "kv_transfer_failed"  # the KV transfer failed (not resumed in time) or did not complete in time
    CACHE_MOVE = "cache_move_failed"  # a cached prefix moved between clusters failed or did not arrive in time
    DEADLINE = "deadline_exceeded"  # the request's time limit passed (retries included)
    NO_CAPACITY = "no_capacity"  # the router had no instance to route it to (503)
    BAD_REQUEST = "bad_request"  # the router refused the request itself (4xx)
    ROUTER_ERROR = "router_error"  # the router failed it otherwise (a testbed fault, an unexpected error)
    CLIENT_TIMEOUT = "client_timeout"  # the client gave up waiting
    CLIENT_ERROR = "client_error"  # the client's connection failed, or the answer it got was incomplete
    CLIENT_GONE = "client_disconnected"  # the client went away before the end (a held deployment's record)
    INTERRUPTED = "interrupted"  # the run stopped before the request finished


# The kinds a node's failure has, by the node's role and whether it answered at all.
NODE_KINDS: dict[tuple[str, bool], FailureKind] = {
    ("prefill", False): FailureKind.PREFILL_DOWN,
    ("prefill", True): FailureKind.PREFILL_ERROR,
    ("decode", False): FailureKind.DECODE_DOWN,
    ("decode", True): FailureKind.DECODE_ERROR,
}


@dataclass(frozen=True, slots=True)
class Failure:
    """One failure: its kind, the instance it happened at ("" if none: a KV transfer between two,
    a deadline, the client), and what happened, for people."""

    kind: FailureKind
    node: str = ""
    detail: str = ""


def failure_kind(text: str, where: str = "failure kind") -> FailureKind | None:
    """The kind a stored or wire text names (None for ""); an unknown one raises ValueError
    naming `where` and the kinds known."""
    if not text:
        return None
    try:
        return FailureKind(text)
    except ValueError:
        known = ", ".join(k.value for k in FailureKind)
        raise ValueError(f"{where}: unknown failure kind {text!r} (known: {known})") from None
