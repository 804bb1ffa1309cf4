"""KV receiver over TCP: asyncio driver of `testbed.core.kv.kv_receive.Reassembler`.

One asyncio Protocol per accepted connection hands its bytes to the reassembler; the receiver
acts on the events that come back (write ACKs and outcomes back, close a connection, log,
resolve an `expect` future) and runs the sweep (stale transfers, frames not finished in time)
once a second. A connection beyond the reassembler's limit is closed at once. Accepted sockets
get TCP keepalive, so a connection left half-open by a network outage is reaped rather than
held against the connection limit for good. With `allowed_hosts`, a connection from any other
address is closed before it costs anything. Times are time.time().
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable

from testbed.core.kv.kv_receive import (
    FRAME_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_FRAGMENTS,
    MAX_TRANSFERS,
    MAX_TRANSFERS_PER_CONNECTION,
    MAX_TRANSFERS_PER_PEER,
    Reassembler,
)
from testbed.core.kv.kv_receive_types import (
    CloseConnection,
    ConnectionLost,
    ConnId,
    ReceiveEvent,
    Send,
    TransferCompleted,
    TransferFailed,
    TransferResult,
)

log = logging.getLogger("testbed.kv")

SWEEP_INTERVAL = 1.0
# Keepalive on accepted sockets: probe after 60 s idle, every 10 s, give up after 6 misses.
KEEPALIVE = (
    (getattr(socket, "TCP_KEEPIDLE", None), 60),
    (getattr(socket, "TCP_KEEPINTVL", None), 10),
    (getattr(socket, "TCP_KEEPCNT", None), 6),
)


def _keepalive(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, value in KEEPALIVE:
            if opt is not None:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
    except OSError as e:  # not fatal: the connection works, it is only reaped later
        log.debug("TCP keepalive refused: %s", e)


class _Protocol(asyncio.Protocol):
    """One accepted connection: its bytes go to the reassembler, the events to `handle`."""

    def __init__(
        self,
        rx: Reassembler,
        transports: dict[ConnId, asyncio.Transport],
        handle: Callable[[list[ReceiveEvent]], None],
        receiver: KVReceiver,
    ) -> None:
        self.rx = rx
        self.transports = transports
        self.handle = handle
        self.receiver = receiver
        self.conn: ConnId | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        peer = transport.get_extra_info("peername")
        label = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "?"
        allowed = self.receiver.allowed_hosts
        if allowed is not None and (not isinstance(peer, tuple) or peer[0] not in allowed):
            self.receiver.peers_refused += 1
            n = self.receiver.peers_refused
            if n == 1 or n % 1000 == 0:
                log.warning(
                    "refusing KV connection from %s: not a node of this deployment (%d refused so far)", label, n
                )
            transport.abort()
            return
        self.conn = self.rx.connection_made(label)
        if self.conn is None:
            n = self.rx.connections_refused
            if n == 1 or n % 1000 == 0:  # a flood of them must not flood the log too
                log.warning(
                    "refusing KV connection from %s: %d connections open (limit %d; %d refused so far)",
                    label,
                    len(self.transports),
                    self.rx.max_connections,
                    n,
                )
            transport.abort()
            return
        self.transports[self.conn] = transport
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            _keepalive(sock)

    def data_received(self, data: bytes) -> None:
        if self.conn is None:
            return  # refused; its transport is closing
        self.handle(self.rx.data_received(self.conn, data, time.time()))

    # A peer that does not read our ACKs is not read either: replies stay bounded by the
    # transport's high-water mark instead of piling up in memory.
    def pause_writing(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn is None:
            return
        self.transports.pop(self.conn, None)
        self.handle(self.rx.connection_lost(self.conn, time.time(), None if exc is None else repr(exc)))


class KVReceiver:
    def __init__(
        self,
        verify: bool = False,
        rcvbuf: int | None = None,
        idle_timeout: float = 60.0,
        result_ttl: float = 120.0,
        *,
        frame_timeout: float = FRAME_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        max_transfers: int = MAX_TRANSFERS,
        max_transfers_per_connection: int = MAX_TRANSFERS_PER_CONNECTION,
        max_fragments: int = MAX_FRAGMENTS,
        max_transfers_per_peer: int = MAX_TRANSFERS_PER_PEER,
        allowed_hosts: frozenset[str] | None = None,
    ) -> None:
        self.rcvbuf = rcvbuf
        # Senders' addresses (the deployment's nodes): a connection from any other is closed at
        # once (a container's KV port is reachable from the host and its bridge). None: any.
        self.allowed_hosts = allowed_hosts
        self.peers_refused = 0
        self._rx = Reassembler(
            verify,
            idle_timeout,
            result_ttl,
            frame_timeout=frame_timeout,
            max_connections=max_connections,
            max_transfers=max_transfers,
            max_transfers_per_connection=max_transfers_per_connection,
            max_fragments=max_fragments,
            max_transfers_per_peer=max_transfers_per_peer,
        )
        self._server: asyncio.Server | None = None
        self._transports: dict[ConnId, asyncio.Transport] = {}
        self._waiters: dict[int, asyncio.Future[TransferResult]] = {}
        self._sweeper: asyncio.TimerHandle | None = None

    @property
    def verify(self) -> bool:
        return self._rx.verify

    @property
    def idle_timeout(self) -> float:
        return self._rx.idle_timeout

    @property
    def result_ttl(self) -> float:
        return self._rx.result_ttl

    @property
    def bytes_received(self) -> int:
        return self._rx.bytes_received

    @property
    def transfers_completed(self) -> int:
        return self._rx.transfers_completed

    @property
    def transfers_failed(self) -> int:
        return self._rx.transfers_failed

    @property
    def stream_bytes(self) -> int:
        """Every byte read from every connection (frames, partial frames, garbage)."""
        return self._rx.stream_bytes

    @property
    def connections(self) -> int:
        return len(self._transports)

    @property
    def connections_refused(self) -> int:
        return self._rx.connections_refused

    @property
    def duplicate_bytes(self) -> int:
        """Resent DATA bytes that had already arrived (the sender resumed after a loss)."""
        return self._rx.duplicate_bytes

    @property
    def reassembler(self) -> Reassembler:
        """The state machine: its counters, what it holds, and its limits (which may be changed
        between events, e.g. by a test)."""
        return self._rx

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, type_, proto, _, sockaddr = infos[0]
        sock = socket.socket(family, type_, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self.rcvbuf is not None:
                # Set on the listener so accepted sockets inherit it before the handshake
                # fixes the window scale.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
            sock.bind(sockaddr)
            sock.listen(512)
            sock.setblocking(False)
            self._server = await loop.create_server(
                lambda: _Protocol(self._rx, self._transports, self._handle, self), sock=sock
            )
        except BaseException:
            sock.close()
            raise
        self._sweeper = loop.call_later(SWEEP_INTERVAL, self._sweep)
        bound: int = sock.getsockname()[1]
        return bound

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        self._handle(self._rx.close(time.time()))
        self._waiters.clear()
        for transport in list(self._transports.values()):
            transport.abort()
        if self._server is not None:
            await self._server.wait_closed()
        await asyncio.sleep(0)  # let the aborted transports run connection_lost

    def expect(self, transfer_id: int) -> asyncio.Future[TransferResult]:
        """Future of the transfer's result; works before, during or after the transfer. A stored
        result is handed out once."""
        loop = asyncio.get_running_loop()
        stored = self._rx.expect(transfer_id)
        if stored is not None:
            fut: asyncio.Future[TransferResult] = loop.create_future()
            fut.set_result(stored)
            return fut
        waiter = self._waiters.get(transfer_id)
        if waiter is None or waiter.done():
            waiter = self._waiters[transfer_id] = loop.create_future()
        return waiter

    # -- internals

    def _handle(self, events: list[ReceiveEvent]) -> None:
        for ev in events:
            if isinstance(ev, Send):
                transport = self._transports.get(ev.conn)
                if transport is not None and not transport.is_closing():
                    transport.write(ev.data)
            elif isinstance(ev, (TransferCompleted, TransferFailed)):
                r = ev.result
                if not r.ok:
                    log.debug("KV transfer %d failed: %s", r.transfer_id, r.reason)
                if ev.claimed:
                    fut = self._waiters.pop(r.transfer_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(r)
                    else:  # the waiter gave up (cancelled): keep it for a later expect()
                        self._rx.keep(r, r.complete)
            elif isinstance(ev, CloseConnection):
                log.warning("closing KV connection from %s: %s", ev.peer, ev.reason)
                transport = self._transports.get(ev.conn)
                if transport is not None:
                    transport.abort()
            elif isinstance(ev, ConnectionLost):
                log.warning("KV %s", ev.reason)

    def _sweep(self) -> None:
        self._handle(self._rx.sweep(time.time()))
        self._sweeper = asyncio.get_running_loop().call_later(SWEEP_INTERVAL, self._sweep)
