"""TCP KV transport: prefill nodes stream framed KV chunks to decode nodes.

Sender (`kv_sender`): per destination, one shared chunk queue and N writer tasks, each owning
one persistent connection. Writers take the next chunk whoever is free (work stealing), so a
transfer's chunks stripe over the connections and a slow connection holds back only the chunk
it is writing. A transfer is done once all its chunks are written and drained and END has been
sent.

Receiver (`kv_receiver`): one asyncio Protocol per connection; a transfer completes when every
byte of its `total` has arrived exactly once and its END was seen, whatever connection carried
each piece. A malformed frame closes only its connection and fails only the transfers that
connection was carrying.

The receiver acknowledges what it has consumed on each connection, and answers each transfer
with its outcome; a sender resumes a transfer whose connection was lost from what was not
acknowledged, within a deadline. The receiver bounds what a hostile peer can cost it:
connections (and, in a deployment, only from its nodes' addresses), open transfers per
connection, per peer address and in total (shared fairly: a silent flood gives its places back
to a sender that needs a few), time inside a frame, kept results.

The protocol logic of both sides is I/O-free, in `testbed.core.kv.kv_send` and
`testbed.core.kv.kv_receive`; these modules drive it with sockets, tasks and futures.
KV bytes are dummies: zeros, or `payload_pattern` with CRC-32 when checksumming.
"""

from __future__ import annotations

from testbed.core.kv.kv_receive_types import TransferResult
from testbed.core.kv.kv_send import ACK_TIMEOUT_S
from testbed.live.kv_receiver import KVReceiver
from testbed.live.kv_sender import (
    TCP_CONGESTION,
    ConnectionStats,
    Dest,
    KVSender,
    SenderLinkState,
    Transfer,
    TransferFailed,
)

IDLE_TIMEOUT_S = 60.0


def receiver_idle_timeout(resume_timeout: float, ack_timeout: float = ACK_TIMEOUT_S) -> float:
    """How long a receiver keeps a transfer without frames: past the longest a sender may take
    to notice a silent connection and then resume (it must not give up first)."""
    return max(IDLE_TIMEOUT_S, ack_timeout + resume_timeout + 15.0)


__all__ = [
    "IDLE_TIMEOUT_S",
    "TCP_CONGESTION",
    "ConnectionStats",
    "Dest",
    "KVReceiver",
    "KVSender",
    "SenderLinkState",
    "Transfer",
    "TransferFailed",
    "TransferResult",
    "receiver_idle_timeout",
]
