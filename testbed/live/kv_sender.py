"""KV sender over TCP: asyncio driver of `testbed.core.kv.kv_send.SendPath`.

Per destination, one SendPath and N writer tasks, each owning one persistent connection that it
opens on first use (and re-opens after a loss, backing off while it cannot). Each writer takes
the next chunk whoever is free, so transfers stripe over the connections. A reader per
connection hands the receiver's ACK/END/ABORT frames to the path (and notices the receiver
going away while nothing is being written); a sweeper gives up on silent connections and on
transfers that cannot resume. All bookkeeping lives in the path; this module only moves bytes,
tunes sockets, samples TCP_INFO and wakes waiters.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass

from testbed.core.kv.kv_send import (
    ACK_TIMEOUT_S,
    MAX_RESUMES,
    RESUME_TIMEOUT_S,
    Chunk,
    CloseConnection,
    DataEncoder,
    OutgoingTransfer,
    Phase,
    SendEvent,
    SendFailed,
    SendPath,
    SendStats,
)
from testbed.live.tcpinfo import read_tcp_info

log = logging.getLogger("testbed.kv")

# Linux value; Python exposes it only on some builds.
TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)

Dest = tuple[str, int]

BACKOFF_MIN_S = 0.05  # between attempts to open a connection that would not open
BACKOFF_MAX_S = 1.0


class TransferFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ConnectionStats:
    dest: Dest
    conn: int
    rtt_us: int
    rttvar_us: int
    snd_cwnd: int
    total_retrans: int
    delivery_rate_Bps: int
    bytes_sent: int
    bytes_acked: int
    snd_wnd: int = 0  # the peer's advertised receive window, bytes
    notsent_bytes: int = 0  # in the socket, not yet sent
    unacked: int = 0  # segments in flight
    snd_mss: int = 0


@dataclass(frozen=True, slots=True)
class SenderLinkState:
    """Cumulative counters over every connection a sender has had (for rates by difference),
    and what it holds now that the network has not delivered."""

    acked_bytes: int  # TCP-acknowledged bytes (frame headers included)
    retrans_segments: int
    acked_segments: int  # acked_bytes / MSS, summed per connection
    undelivered_bytes: int  # queued in the sender + in transport buffers + unsent in sockets + in flight


def _fmt(addr: Dest) -> str:
    return f"{addr[0]}:{addr[1]}"


class _Dialer:
    """Opens tuned TCP connections; warns once per sender about a refused congestion control."""

    def __init__(self, sndbuf: int | None, congestion: str | None, connect_timeout: float) -> None:
        self.sndbuf = sndbuf
        self.congestion = congestion
        self.connect_timeout = connect_timeout
        self.congestion_warned = False

    async def dial(self, addr: Dest) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            async with asyncio.timeout(self.connect_timeout):
                return await self._open(addr)
        except TimeoutError as e:
            raise ConnectionError(f"connect timed out after {self.connect_timeout} s") from e

    async def _open(self, addr: Dest) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(addr[0], addr[1], type=socket.SOCK_STREAM)
        error: OSError = OSError(f"no address for {_fmt(addr)}")
        for family, type_, proto, _, sockaddr in infos:
            sock = socket.socket(family, type_, proto)
            try:
                sock.setblocking(False)
                self._tune(sock)  # before connect: buffer sizes shape the handshake's window
                await loop.sock_connect(sock, sockaddr)
                return await asyncio.open_connection(sock=sock)
            except BaseException as e:
                sock.close()
                if not isinstance(e, OSError):
                    raise
                error = e
        raise error

    def _tune(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.sndbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.sndbuf)
        if self.congestion is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, self.congestion.encode())
            except OSError as e:
                if not self.congestion_warned:
                    self.congestion_warned = True
                    log.warning(
                        "TCP congestion control %r refused by the kernel (%s); using the default", self.congestion, e
                    )


class _Conn:
    """One open connection's I/O objects; `id` names it to the path."""

    __slots__ = ("id", "index", "reader", "writer", "watcher", "seen_acked", "seen_retrans")

    def __init__(self, cid: int, index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.id = cid
        self.index = index
        self.reader = reader
        self.writer = writer
        self.watcher: asyncio.Task[None] | None = None
        self.seen_acked = 0  # TCP_INFO counters at the last link_state()
        self.seen_retrans = 0


class _Link:
    """One destination: its SendPath, connection slots, writer tasks and finish() waiters."""

    def __init__(self, addr: Dest, n: int, path: SendPath, encoder: DataEncoder, dialer: _Dialer) -> None:
        self.addr = addr
        self.path = path
        self.encoder = encoder
        self.dialer = dialer
        self.closing = False
        self.conns: list[_Conn | None] = [None] * n
        self._by_id: dict[int, _Conn] = {}
        self._locks = [asyncio.Lock() for _ in range(n)]
        self._backoff = [0.0] * n  # per slot, after connections that got nothing through
        self._retry_at = [0.0] * n
        self._work = asyncio.Event()  # set when chunks are queued
        self._changed: dict[OutgoingTransfer, asyncio.Event] = {}  # finish() waiters
        self._tasks = [asyncio.create_task(self._writer(i), name=f"kv-writer-{_fmt(addr)}-{i}") for i in range(n)]
        self._tasks.append(asyncio.create_task(self._sweeper(), name=f"kv-sweep-{_fmt(addr)}"))

    def live(self) -> list[_Conn]:
        return [c for c in self.conns if c is not None and self.path.alive(c.id)]

    def start(self, transfer_id: int, total: int, layers: int) -> OutgoingTransfer:
        return self.path.start(transfer_id, total, layers)

    def send_layer(self, t: OutgoingTransfer, layer: int, nbytes: int) -> None:
        if self.path.send_layer(t, layer, nbytes):
            self._work.set()

    async def finish(self, t: OutgoingTransfer) -> float:
        changed = self._changed[t] = asyncio.Event()
        try:
            self._apply(self.path.finish(t))
            backoff = BACKOFF_MIN_S
            while True:
                if t.failed is not None:
                    raise TransferFailed(t.failed)
                if t.phase is Phase.DELIVERED:
                    assert t.end_at is not None
                    return t.end_at
                if t.phase is Phase.ENDING:
                    if await self._send_end(t):
                        backoff = BACKOFF_MIN_S
                    else:
                        await asyncio.sleep(backoff)
                        backoff = min(2 * backoff, BACKOFF_MAX_S)
                    continue
                changed.clear()
                await changed.wait()
        finally:
            self._changed.pop(t, None)

    def abort(self, t: OutgoingTransfer, reason: str) -> None:
        self._apply(self.path.fail(t, reason))

    def fail_all(self, reason: str) -> None:
        self.closing = True
        self._apply(self.path.fail_all(reason))

    async def close(self) -> None:
        tasks = list(self._tasks)
        for c in self.conns:
            if c is not None:
                self.path.connection_lost(c.id, "sender closed", time.time())
                if c.watcher is not None:
                    tasks.append(c.watcher)
                c.writer.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in self.conns:
            if c is not None:
                try:
                    await c.writer.wait_closed()
                except OSError:
                    pass

    # -- internals

    def _apply(self, events: list[SendEvent]) -> None:
        for ev in events:
            if isinstance(ev, CloseConnection):
                c = self._by_id.pop(ev.conn, None)
                if c is not None:
                    if not self.closing:
                        log.warning("KV connection %d to %s closed: %s", c.index, _fmt(self.addr), ev.reason)
                    c.writer.transport.abort()
                self._work.set()  # its chunks were requeued: the other writers take them
                continue
            if isinstance(ev, SendFailed) and ev.abort:
                self._write_abort(ev.abort)
            changed = self._changed.get(ev.transfer)
            if changed is not None:
                changed.set()

    def _write_abort(self, frame: bytes) -> None:
        for c in self.live():
            try:
                c.writer.write(frame)
            except OSError:
                continue
            self.path.frame_written(c.id, len(frame))
            return

    async def _send_end(self, t: OutgoingTransfer) -> bool:
        """Write END on the emptiest live connection (or a new one); False if none would open."""
        conn: _Conn | None = None
        try:
            live = self.live()
            # The emptiest transport buffer gets END out soonest.
            conn = (
                min(live, key=lambda c: c.writer.transport.get_write_buffer_size()) if live else await self._connect(0)
            )
            if t.phase is not Phase.ENDING:  # a loss requeued chunks of it while we connected
                return True
            end = self.path.begin_end(t, conn.id, time.time())
            if end is not None:
                conn.writer.write(end)
                await conn.writer.drain()
        except OSError as e:
            reason = f"sending END to {_fmt(self.addr)} failed: {e!r}"
            if conn is not None:
                self._lost(conn, reason)  # the END is owed again
            else:
                self.path.stalled(t, reason, time.time())
                return False
        return True

    async def _writer(self, i: int) -> None:
        path = self.path
        backoff = BACKOFF_MIN_S
        while True:
            chunk = path.take()
            if chunk is None:
                self._work.clear()
                await self._work.wait()
                continue
            try:
                conn = await self._connect(i)
            except OSError as e:
                self._apply(path.unsent(chunk, f"connect to {_fmt(self.addr)} failed: {e!r}", time.time()))
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, BACKOFF_MAX_S)
                continue
            backoff = BACKOFF_MIN_S
            if not path.begin_write(conn.id, chunk, time.time()):
                continue  # settled while we were connecting
            await self._write(conn, chunk)
            # drain() does not yield while the kernel keeps up; yield so the other writers
            # take the next chunks and transfers stripe over all connections.
            await asyncio.sleep(0)

    async def _write(self, conn: _Conn, chunk: Chunk) -> None:
        head, view = self.encoder.encode(chunk)
        try:
            # One call per frame keeps frames whole when END or ABORT share the connection.
            conn.writer.writelines((head, view))
            await conn.writer.drain()
        except OSError as e:
            self._lost(conn, f"write to {_fmt(self.addr)} failed: {e!r}")
            return
        self._apply(self.path.chunk_written(conn.id))

    async def _connect(self, i: int) -> _Conn:
        c = self.conns[i]
        if c is not None and self.path.alive(c.id):
            return c
        async with self._locks[i]:
            c = self.conns[i]
            if c is not None and self.path.alive(c.id):
                return c
            wait = self._retry_at[i] - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            reader, writer = await self.dialer.dial(self.addr)
            c = self.conns[i] = _Conn(self.path.connection_opened(), i, reader, writer)
            self._by_id[c.id] = c
            c.watcher = asyncio.create_task(self._watch(c), name=f"kv-watch-{_fmt(self.addr)}-{i}")
            return c

    async def _watch(self, conn: _Conn) -> None:
        """The receiver's ACK, END and ABORT frames go to the path; EOF or an error means the
        connection is gone, which we must notice even while no chunk is being written on it."""
        try:
            while data := await conn.reader.read(65536):
                self._apply(self.path.data_received(conn.id, data, time.time()))
            reason = f"receiver {_fmt(self.addr)} closed connection {conn.index}"
        except OSError as e:
            reason = f"connection {conn.index} to {_fmt(self.addr)} failed: {e!r}"
        self._lost(conn, reason)

    async def _sweeper(self) -> None:
        path = self.path
        interval = min(1.0, path.ack_timeout / 4, path.resume_timeout / 4)
        while True:
            await asyncio.sleep(interval)
            self._apply(path.sweep(time.time()))

    def _lost(self, conn: _Conn, reason: str) -> None:
        self._by_id.pop(conn.id, None)
        if not self.path.alive(conn.id):
            return
        # A connection that died before the receiver acknowledged anything (an outage that
        # resets what it lets through): the next attempt on its slot waits, growing to a second.
        i = conn.index
        if self.path.acked_bytes(conn.id):
            self._backoff[i] = 0.0
        else:
            self._backoff[i] = min(max(2 * self._backoff[i], BACKOFF_MIN_S), BACKOFF_MAX_S)
        self._retry_at[i] = time.monotonic() + self._backoff[i]
        events = self.path.connection_lost(conn.id, reason, time.time())
        if not self.closing:
            log.warning("KV connection lost: %s", reason)
        conn.writer.transport.abort()
        self._apply(events)
        self._work.set()  # requeued chunks: the writers take them on the other connections


class Transfer:
    """One KV transfer to one destination. Call `send_layer` as layers become ready (never
    blocks), then `await finish()`."""

    def __init__(self, link: _Link, state: OutgoingTransfer) -> None:
        self._link = link
        self._state = state

    @property
    def transfer_id(self) -> int:
        return self._state.transfer_id

    @property
    def total(self) -> int:
        return self._state.total

    @property
    def layers(self) -> int:
        return self._state.layers

    @property
    def dest(self) -> Dest:
        return self._link.addr

    @property
    def first_send(self) -> float | None:
        return self._state.first_send

    @property
    def failed(self) -> str | None:
        return self._state.failed

    def send_layer(self, layer: int, nbytes: int) -> None:
        self._link.send_layer(self._state, layer, nbytes)

    async def finish(self) -> float:
        """Wait until every chunk is written, send END, and wait for the receiver to confirm
        the transfer complete (resuming over the remaining or new connections after a loss);
        returns the time.time() the (last) END was written. Raises TransferFailed with the
        reason: the receiver failed it, or it could not be resumed within the sender's budget."""
        return await self._link.finish(self._state)

    def abort(self, reason: str) -> None:
        """Give the transfer up (its request was cancelled): the receiver is told with an ABORT."""
        self._link.abort(self._state, reason)


class KVSender:
    def __init__(
        self,
        connections: int = 4,
        chunk_bytes: int = 262144,
        sndbuf: int | None = None,
        congestion: str | None = None,
        checksum: bool = False,
        connect_timeout: float = 10.0,
        *,
        resume_timeout: float = RESUME_TIMEOUT_S,
        ack_timeout: float = ACK_TIMEOUT_S,
        max_resumes: int = MAX_RESUMES,
    ) -> None:
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.connections = connections
        self.chunk_bytes = chunk_bytes
        self.checksum = checksum
        self._dialer = _Dialer(sndbuf, congestion, connect_timeout)
        self._encoder = DataEncoder(chunk_bytes, checksum)
        self._budget = (resume_timeout, ack_timeout, max_resumes)
        SendPath(
            chunk_bytes, resume_timeout=resume_timeout, ack_timeout=ack_timeout, max_resumes=max_resumes
        )  # validates the budget now rather than at first use
        self._stats = SendStats()
        self._acked_total = 0
        self._retrans_total = 0
        self._acked_segments = 0
        self._links: dict[Dest, _Link] = {}
        self._closed = False

    @property
    def sndbuf(self) -> int | None:
        return self._dialer.sndbuf

    @property
    def congestion(self) -> str | None:
        return self._dialer.congestion

    @property
    def connect_timeout(self) -> float:
        return self._dialer.connect_timeout

    @property
    def bytes_sent(self) -> int:
        return self._stats.bytes_sent

    @property
    def backlog_bytes(self) -> int:
        return self._stats.backlog_bytes

    @property
    def transfers_sent(self) -> int:
        return self._stats.transfers_sent

    @property
    def transfers_failed(self) -> int:
        return self._stats.transfers_failed

    @property
    def bytes_resent(self) -> int:
        """Payload bytes written again after a connection loss."""
        return self._stats.bytes_resent

    @property
    def resumes(self) -> int:
        """Connection losses that left something to resume."""
        return self._stats.resumes

    def start(self, dest: Dest, transfer_id: int, total: int, layers: int) -> Transfer:
        if self._closed:
            raise RuntimeError("KVSender is closed")
        link = self._links.get(dest)
        if link is None:
            resume, ack, resumes = self._budget
            path = SendPath(self.chunk_bytes, self._stats, resume_timeout=resume, ack_timeout=ack, max_resumes=resumes)
            link = self._links[dest] = _Link(dest, self.connections, path, self._encoder, self._dialer)
        return Transfer(link, link.start(transfer_id, total, layers))

    def tcp_info(self) -> list[ConnectionStats]:
        out: list[ConnectionStats] = []
        for link in self._links.values():
            for c in link.live():
                info = read_tcp_info(c.writer.get_extra_info("socket"))
                if info is not None:
                    out.append(
                        ConnectionStats(
                            link.addr,
                            c.index,
                            info.rtt,
                            info.rttvar,
                            info.snd_cwnd,
                            info.total_retrans,
                            info.delivery_rate,
                            info.bytes_sent,
                            info.bytes_acked,
                            info.snd_wnd,
                            info.notsent_bytes,
                            info.unacked,
                            info.snd_mss,
                        )
                    )
        return out

    def link_state(self) -> SenderLinkState:
        undelivered = self._stats.backlog_bytes
        for link in self._links.values():
            for c in link.live():
                undelivered += c.writer.transport.get_write_buffer_size()
                info = read_tcp_info(c.writer.get_extra_info("socket"))
                if info is None:
                    continue
                undelivered += info.notsent_bytes + info.unacked * info.snd_mss
                # Counters restart with each connection: accumulate their growth.
                d_acked = max(info.bytes_acked - c.seen_acked, 0)
                d_retrans = max(info.total_retrans - c.seen_retrans, 0)
                c.seen_acked, c.seen_retrans = info.bytes_acked, info.total_retrans
                self._acked_total += d_acked
                self._retrans_total += d_retrans
                self._acked_segments += d_acked // max(info.snd_mss, 1)
        return SenderLinkState(self._acked_total, self._retrans_total, self._acked_segments, undelivered)

    async def close(self) -> None:
        self._closed = True
        # Fail first so ABORTs go out on the still-open connections.
        for link in self._links.values():
            link.fail_all("sender closed")
        await asyncio.gather(*(link.close() for link in self._links.values()))
        self._links.clear()
