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

The protocol logic of both sides is I/O-free, in `testbed.core.kv_send` and
`testbed.core.kv_receive`; these modules drive it with sockets, tasks and futures.
KV bytes are dummies: zeros, or `payload_pattern` with CRC-32 when checksumming.
"""

from __future__ import annotations

from testbed.core.kv_receive import TransferResult
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

__all__ = [
    "TCP_CONGESTION",
    "ConnectionStats",
    "Dest",
    "KVReceiver",
    "KVSender",
    "SenderLinkState",
    "Transfer",
    "TransferFailed",
    "TransferResult",
]
