"""KV receiver over TCP: asyncio driver of `testbed.core.kv_receive.Reassembler`.

One asyncio Protocol per accepted connection hands its bytes to the reassembler; the receiver
acts on the events that come back (close a connection, log, resolve an `expect` future) and
runs the stale-transfer sweep once a second. Times are time.time().
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable

from testbed.core.kv_receive import (
    CloseConnection,
    ConnectionLost,
    ConnId,
    Reassembler,
    ReceiveEvent,
    TransferCompleted,
    TransferFailed,
    TransferResult,
)

log = logging.getLogger("testbed.kv")

SWEEP_INTERVAL = 1.0


class _Protocol(asyncio.Protocol):
    """One accepted connection: its bytes go to the reassembler, the events to `handle`."""

    def __init__(
        self,
        rx: Reassembler,
        transports: dict[ConnId, asyncio.Transport],
        handle: Callable[[list[ReceiveEvent]], None],
    ) -> None:
        self.rx = rx
        self.transports = transports
        self.handle = handle
        self.conn: ConnId | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        peer = transport.get_extra_info("peername")
        label = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "?"
        self.conn = self.rx.connection_made(label)
        self.transports[self.conn] = transport

    def data_received(self, data: bytes) -> None:
        assert self.conn is not None
        self.handle(self.rx.data_received(self.conn, data, time.time()))

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
    ) -> None:
        self.rcvbuf = rcvbuf
        self._rx = Reassembler(verify, idle_timeout, result_ttl)
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
                lambda: _Protocol(self._rx, self._transports, self._handle), sock=sock
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
            if isinstance(ev, (TransferCompleted, TransferFailed)):
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
