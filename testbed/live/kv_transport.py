"""TCP KV transport: prefill nodes stream framed KV chunks to decode nodes.

Sender: per destination, one shared chunk queue and N writer tasks, each owning one persistent
connection. Writers take the next chunk whoever is free (work stealing), so a transfer's chunks
stripe over the connections and a slow connection holds back only the chunk it is writing.
A transfer is done once all its chunks are written and drained and END has been sent.

Receiver: one asyncio Protocol per connection feeding a FrameDecoder; a transfer completes when
every byte of its `total` has arrived exactly once and its END was seen, whatever connection
carried each piece. A malformed frame closes only its connection and fails only the transfers
that connection was carrying.

KV bytes are dummies: zeros, or `payload_pattern` with CRC-32 when checksumming.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from bisect import bisect_right
from dataclasses import dataclass

from testbed.core.frames import (
    FLAG_CHECKSUM,
    Frame,
    FrameDecoder,
    FrameError,
    FrameType,
    encode_abort,
    encode_data,
    encode_end,
    payload_pattern,
)
from testbed.live.tcpinfo import read_tcp_info

log = logging.getLogger("testbed.kv")

# Linux value; Python exposes it only on some builds.
TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)

Dest = tuple[str, int]


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
    snd_wnd: int = 0          # the peer's advertised receive window, bytes
    notsent_bytes: int = 0    # in the socket, not yet sent
    unacked: int = 0          # segments in flight
    snd_mss: int = 0


@dataclass(frozen=True, slots=True)
class SenderLinkState:
    """Cumulative counters over every connection a sender has had (for rates by difference),
    and what it holds now that the network has not delivered."""

    acked_bytes: int          # TCP-acknowledged bytes (frame headers included)
    retrans_segments: int
    acked_segments: int       # acked_bytes / MSS, summed per connection
    undelivered_bytes: int    # queued in the sender + in transport buffers + unsent in sockets + in flight


@dataclass(frozen=True, slots=True)
class TransferResult:
    """Outcome of one received transfer; times are time.time(). `layers_done` is the layer count
    announced by END when ok, else the number of distinct layers that delivered data;
    `connections` counts the distinct connections that carried its DATA frames."""

    transfer_id: int
    ok: bool
    bytes: int
    first_byte: float
    complete: float
    reason: str
    layers_done: int
    connections: int


# --------------------------------------------------------------------------------------- sender


class _Chunk:
    __slots__ = ("transfer", "layer", "offset", "length")

    def __init__(self, transfer: Transfer, layer: int, offset: int, length: int) -> None:
        self.transfer = transfer
        self.layer = layer
        self.offset = offset
        self.length = length


class _Conn:
    __slots__ = ("dest", "index", "reader", "writer", "transfers", "alive", "watcher", "seen_acked", "seen_retrans")

    def __init__(self, dest: Dest, index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.dest = dest
        self.index = index
        self.reader = reader
        self.writer = writer
        # Unfinished transfers with chunks written here: a failure of this connection may
        # have lost their bytes, so it fails them.
        self.transfers: set[Transfer] = set()
        self.alive = True
        self.watcher: asyncio.Task[None] | None = None
        self.seen_acked = 0       # TCP_INFO counters at the last link_state()
        self.seen_retrans = 0


class _Dest:
    __slots__ = ("addr", "queue", "conns", "locks", "tasks")

    def __init__(self, addr: Dest, n: int) -> None:
        self.addr = addr
        self.queue: asyncio.Queue[_Chunk] = asyncio.Queue()
        self.conns: list[_Conn | None] = [None] * n
        self.locks = [asyncio.Lock() for _ in range(n)]
        self.tasks: list[asyncio.Task[None]] = []

    def live(self) -> list[_Conn]:
        return [c for c in self.conns if c is not None and c.alive]


class Transfer:
    """One KV transfer to one destination. Call `send_layer` as layers become ready (never
    blocks), then `await finish()`."""

    def __init__(self, sender: KVSender, dest: _Dest, transfer_id: int, total: int, layers: int) -> None:
        self.transfer_id = transfer_id
        self.total = total
        self.layers = layers
        self.first_send: float | None = None
        self._sender = sender
        self._dest = dest
        self._queued = 0  # bytes handed to send_layer so far (= next offset)
        self._outstanding = 0  # chunks queued or being written
        self._idle = asyncio.Event()
        self._idle.set()
        self._conns: set[_Conn] = set()
        self._failed: str | None = None
        self._finishing = False
        self._done = False

    @property
    def dest(self) -> Dest:
        return self._dest.addr

    @property
    def failed(self) -> str | None:
        return self._failed

    def send_layer(self, layer: int, nbytes: int) -> None:
        if self._finishing:
            raise RuntimeError(f"transfer {self.transfer_id}: send_layer after finish()")
        if not 0 <= layer < self.layers:
            raise ValueError(f"transfer {self.transfer_id}: layer {layer} outside 0..{self.layers - 1}")
        if nbytes < 0 or self._queued + nbytes > self.total:
            raise ValueError(
                f"transfer {self.transfer_id}: layer {layer} of {nbytes} bytes overruns total {self.total}"
                f" ({self._queued} already queued)"
            )
        start, end = self._queued, self._queued + nbytes
        self._queued = end
        if self._failed is not None or nbytes == 0:
            return  # finish() reports the failure
        step = self._sender.chunk_bytes
        put = self._dest.queue.put_nowait
        for off in range(start, end, step):
            put(_Chunk(self, layer, off, min(step, end - off)))
            self._outstanding += 1
        self._sender.backlog_bytes += nbytes
        self._idle.clear()

    async def finish(self) -> float:
        """Wait until every chunk is written and drained, send END; return the completion
        time.time(). Raises TransferFailed if a connection carrying this transfer failed."""
        if self._done:
            raise RuntimeError(f"transfer {self.transfer_id}: finish() called twice")
        if self._queued != self.total:
            raise ValueError(f"transfer {self.transfer_id}: finish() after {self._queued} of {self.total} bytes")
        self._finishing = True
        await self._idle.wait()
        if self._failed is not None:
            raise TransferFailed(self._failed)
        sender = self._sender
        conn: _Conn | None = None
        try:
            live = self._dest.live()
            if live:
                # The emptiest transport buffer gets END out soonest.
                conn = min(live, key=lambda c: c.writer.transport.get_write_buffer_size())
            else:
                conn = await sender._connect(self._dest, 0)
            if self.first_send is None:
                self.first_send = time.time()
            conn.writer.write(encode_end(self.transfer_id, self.layers, self.total))
            await conn.writer.drain()
        except OSError as e:
            reason = f"sending END to {_fmt(self.dest)} failed: {e!r}"
            if conn is not None:
                sender._conn_lost(conn, reason)
            self._fail(reason)
        if self._failed is not None:
            raise TransferFailed(self._failed)
        self._done = True
        self._forget()
        sender.transfers_sent += 1
        return time.time()

    def _chunk_done(self) -> None:
        self._outstanding -= 1
        if self._outstanding == 0:
            self._idle.set()

    def _forget(self) -> None:
        for c in self._conns:
            c.transfers.discard(self)
        self._conns.clear()
        self._sender._active.discard(self)

    def _fail(self, reason: str) -> None:
        if self._failed is not None or self._done:
            return
        self._failed = reason
        self._idle.set()
        self._forget()
        self._sender.transfers_failed += 1
        self._sender._send_abort(self._dest, self.transfer_id, reason)


class KVSender:
    def __init__(
        self,
        connections: int = 4,
        chunk_bytes: int = 262144,
        sndbuf: int | None = None,
        congestion: str | None = None,
        checksum: bool = False,
        connect_timeout: float = 10.0,
    ) -> None:
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.connections = connections
        self.chunk_bytes = chunk_bytes
        self.sndbuf = sndbuf
        self.congestion = congestion
        self.checksum = checksum
        self.connect_timeout = connect_timeout
        self.bytes_sent = 0
        self.transfers_sent = 0
        self.transfers_failed = 0
        self.backlog_bytes = 0
        self._acked_total = 0
        self._retrans_total = 0
        self._acked_segments = 0
        self._zeros = memoryview(bytes(chunk_bytes))
        self._dests: dict[Dest, _Dest] = {}
        self._active: set[Transfer] = set()
        self._closed = False
        self._congestion_warned = False

    def start(self, dest: Dest, transfer_id: int, total: int, layers: int) -> Transfer:
        if self._closed:
            raise RuntimeError("KVSender is closed")
        d = self._dests.get(dest)
        if d is None:
            d = self._dests[dest] = _Dest(dest, self.connections)
            d.tasks = [asyncio.create_task(self._writer(d, i), name=f"kv-writer-{_fmt(dest)}-{i}") for i in range(self.connections)]
        t = Transfer(self, d, transfer_id, total, layers)
        self._active.add(t)
        return t

    def tcp_info(self) -> list[ConnectionStats]:
        out: list[ConnectionStats] = []
        for d in self._dests.values():
            for c in d.live():
                info = read_tcp_info(c.writer.get_extra_info("socket"))
                if info is not None:
                    out.append(ConnectionStats(
                        d.addr, c.index, info.rtt, info.rttvar, info.snd_cwnd, info.total_retrans,
                        info.delivery_rate, info.bytes_sent, info.bytes_acked, info.snd_wnd,
                        info.notsent_bytes, info.unacked, info.snd_mss,
                    ))
        return out

    def link_state(self) -> SenderLinkState:
        undelivered = self.backlog_bytes
        for d in self._dests.values():
            for c in d.live():
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
        for t in list(self._active):
            t._fail("sender closed")
        tasks: list[asyncio.Task[None]] = []
        for d in self._dests.values():
            tasks.extend(d.tasks)
            for c in d.conns:
                if c is not None:
                    c.alive = False
                    if c.watcher is not None:
                        tasks.append(c.watcher)
                    c.writer.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for d in self._dests.values():
            for c in d.conns:
                if c is not None:
                    try:
                        await c.writer.wait_closed()
                    except OSError:
                        pass
        self._dests.clear()

    # -- internals

    async def _writer(self, d: _Dest, i: int) -> None:
        queue = d.queue
        while True:
            chunk = await queue.get()
            t = chunk.transfer
            n = chunk.length
            if t._failed is not None:
                self.backlog_bytes -= n
                t._chunk_done()
                continue
            try:
                conn = await self._connect(d, i)
            except OSError as e:
                self.backlog_bytes -= n
                t._chunk_done()
                t._fail(f"connect to {_fmt(d.addr)} failed: {e!r}")
                continue
            if t._failed is not None:  # failed while we were connecting
                self.backlog_bytes -= n
                t._chunk_done()
                continue
            if self.checksum:
                payload: bytes | memoryview = payload_pattern(t.transfer_id, chunk.offset, n)
            else:
                payload = self._zeros[:n]
            head, view = encode_data(t.transfer_id, chunk.layer, chunk.offset, t.total, payload, self.checksum)
            conn.transfers.add(t)
            t._conns.add(conn)
            if t.first_send is None:
                t.first_send = time.time()
            self.backlog_bytes -= n
            try:
                # One call per frame keeps frames whole when several tasks share a connection.
                conn.writer.writelines((head, view))
                await conn.writer.drain()
            except OSError as e:
                t._chunk_done()
                self._conn_lost(conn, f"write to {_fmt(d.addr)} failed: {e!r}")
                continue
            self.bytes_sent += n
            t._chunk_done()
            # drain() does not yield while the kernel keeps up; yield so the other writers
            # take the next chunks and transfers stripe over all connections.
            await asyncio.sleep(0)

    async def _connect(self, d: _Dest, i: int) -> _Conn:
        c = d.conns[i]
        if c is not None and c.alive:
            return c
        async with d.locks[i]:
            c = d.conns[i]
            if c is not None and c.alive:
                return c
            try:
                async with asyncio.timeout(self.connect_timeout):
                    c = await self._open(d.addr, i)
            except TimeoutError as e:
                raise ConnectionError(f"connect timed out after {self.connect_timeout} s") from e
            d.conns[i] = c
            return c

    async def _open(self, addr: Dest, i: int) -> _Conn:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(addr[0], addr[1], type=socket.SOCK_STREAM)
        error: OSError = OSError(f"no address for {_fmt(addr)}")
        for family, type_, proto, _, sockaddr in infos:
            sock = socket.socket(family, type_, proto)
            try:
                sock.setblocking(False)
                self._tune(sock)  # before connect: buffer sizes shape the handshake's window
                await loop.sock_connect(sock, sockaddr)
                reader, writer = await asyncio.open_connection(sock=sock)
            except BaseException as e:
                sock.close()
                if not isinstance(e, OSError):
                    raise
                error = e
                continue
            conn = _Conn(addr, i, reader, writer)
            conn.watcher = asyncio.create_task(self._watch(conn), name=f"kv-watch-{_fmt(addr)}-{i}")
            return conn
        raise error

    def _tune(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.sndbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.sndbuf)
        if self.congestion is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, self.congestion.encode())
            except OSError as e:
                if not self._congestion_warned:
                    self._congestion_warned = True
                    log.warning("TCP congestion control %r refused by the kernel (%s); using the default",
                                self.congestion, e)

    async def _watch(self, conn: _Conn) -> None:
        """The receiver never sends; EOF or an error here means the connection is gone, which
        we must notice even while no chunk is being written on it."""
        try:
            while await conn.reader.read(65536):
                pass
            reason = f"receiver {_fmt(conn.dest)} closed connection {conn.index}"
        except OSError as e:
            reason = f"connection {conn.index} to {_fmt(conn.dest)} failed: {e!r}"
        self._conn_lost(conn, reason)

    def _conn_lost(self, conn: _Conn, reason: str) -> None:
        if not conn.alive:
            return
        conn.alive = False
        if not self._closed:
            log.warning("KV connection lost: %s", reason)
        conn.writer.transport.abort()
        for t in list(conn.transfers):
            t._fail(reason)
        conn.transfers.clear()

    def _send_abort(self, d: _Dest, transfer_id: int, reason: str) -> None:
        for c in d.live():
            try:
                c.writer.write(encode_abort(transfer_id, reason))
            except OSError:
                continue
            return


# ------------------------------------------------------------------------------------- receiver


class _RxTransfer:
    __slots__ = (
        "transfer_id", "total", "received", "starts", "ends", "end_seen", "layers", "first_byte",
        "last_activity", "conns", "data_conns", "layers_seen",
    )

    def __init__(self, transfer_id: int, total: int, now: float, mono: float) -> None:
        self.transfer_id = transfer_id
        self.total = total
        self.received = 0
        # Received byte ranges, merged and sorted: duplicates and overlaps are caught exactly.
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.end_seen = False
        self.layers = 0
        self.first_byte = now
        self.last_activity = mono
        self.conns: set[_RxConn] = set()  # carried any frame: their failure fails us
        self.data_conns: set[_RxConn] = set()
        self.layers_seen: set[int] = set()

    def add_range(self, off: int, n: int) -> bool:
        """Record [off, off+n); False if it overlaps bytes already received."""
        if n == 0:
            return True
        starts, ends = self.starts, self.ends
        end = off + n
        i = bisect_right(starts, off)
        if i > 0 and ends[i - 1] > off:
            return False
        if i < len(starts) and starts[i] < end:
            return False
        join_prev = i > 0 and ends[i - 1] == off
        join_next = i < len(starts) and starts[i] == end
        if join_prev and join_next:
            ends[i - 1] = ends[i]
            del starts[i], ends[i]
        elif join_prev:
            ends[i - 1] = end
        elif join_next:
            starts[i] = off
        else:
            starts.insert(i, off)
            ends.insert(i, end)
        return True


class _RxConn(asyncio.Protocol):
    def __init__(self, rx: KVReceiver) -> None:
        self.rx = rx
        self.decoder = FrameDecoder()
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.active: set[_RxTransfer] = set()
        self.broken = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.peer = _fmt((str(peer[0]), int(peer[1])))
        self.rx._conns.add(self)

    def data_received(self, data: bytes) -> None:
        if self.broken:
            return
        try:
            frames = self.decoder.feed(data)
        except FrameError as e:
            for f in e.frames:
                self.rx._on_frame(self, f)
            self.rx._frame_error(self, e)
            return
        on_frame = self.rx._on_frame
        for f in frames:
            on_frame(self, f)

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.rx._conn_closed(self, exc)


class KVReceiver:
    def __init__(
        self,
        verify: bool = False,
        rcvbuf: int | None = None,
        idle_timeout: float = 60.0,
        result_ttl: float = 120.0,
    ) -> None:
        self.verify = verify
        self.rcvbuf = rcvbuf
        self.idle_timeout = idle_timeout
        self.result_ttl = result_ttl
        self.bytes_received = 0
        self.transfers_completed = 0
        self.transfers_failed = 0
        self._server: asyncio.Server | None = None
        self._conns: set[_RxConn] = set()
        self._transfers: dict[int, _RxTransfer] = {}
        self._waiters: dict[int, asyncio.Future[TransferResult]] = {}
        self._results: dict[int, tuple[TransferResult, float]] = {}  # unclaimed, insertion-ordered
        self._finished: dict[int, float] = {}  # tombstones: late frames of these are dropped
        self._sweeper: asyncio.TimerHandle | None = None
        self._closing = False

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
            self._server = await loop.create_server(lambda: _RxConn(self), sock=sock)
        except BaseException:
            sock.close()
            raise
        self._sweeper = loop.call_later(1.0, self._sweep)
        bound: int = sock.getsockname()[1]
        return bound

    async def close(self) -> None:
        self._closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for t in list(self._transfers.values()):
            self._finish(t, False, "receiver closed")
        for tid, fut in list(self._waiters.items()):
            if not fut.done():
                fut.set_result(TransferResult(tid, False, 0, 0.0, time.time(), "receiver closed", 0, 0))
        self._waiters.clear()
        for c in list(self._conns):
            if c.transport is not None:
                c.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()
        await asyncio.sleep(0)  # let the aborted transports run connection_lost

    def expect(self, transfer_id: int) -> asyncio.Future[TransferResult]:
        """Future of the transfer's result; works before, during or after the transfer. A stored
        result is handed out once."""
        loop = asyncio.get_running_loop()
        stored = self._results.pop(transfer_id, None)
        if stored is not None:
            fut: asyncio.Future[TransferResult] = loop.create_future()
            fut.set_result(stored[0])
            return fut
        fut_ = self._waiters.get(transfer_id)
        if fut_ is None or fut_.done():
            fut_ = self._waiters[transfer_id] = loop.create_future()
        return fut_

    # -- internals

    def _on_frame(self, conn: _RxConn, f: Frame) -> None:
        h = f.header
        tid = h.transfer_id
        if tid in self._finished:
            return  # a failed transfer's stragglers
        t = self._transfers.get(tid)
        if t is None:
            t = self._transfers[tid] = _RxTransfer(tid, h.total, time.time(), time.monotonic())
        else:
            t.last_activity = time.monotonic()
        if h.type == FrameType.DATA:
            self.bytes_received += h.length
            t.conns.add(conn)
            conn.active.add(t)
            if h.total != t.total:
                self._finish(t, False, f"DATA at offset {h.offset} says total {h.total}, expected {t.total}")
                return
            if not t.add_range(h.offset, h.length):
                self._finish(t, False, f"duplicate or overlapping DATA at offset {h.offset} length {h.length}")
                return
            if self.verify:
                if not h.flags & FLAG_CHECKSUM:
                    self._finish(t, False, f"DATA at offset {h.offset} has no checksum in verify mode")
                    return
                if f.payload != payload_pattern(tid, h.offset, h.length):
                    self._finish(t, False, f"DATA at offset {h.offset} length {h.length} does not match the pattern")
                    return
            t.received += h.length
            t.data_conns.add(conn)
            t.layers_seen.add(h.layer)
            if t.end_seen and t.received == t.total:
                self._finish(t, True, "")
        elif h.type == FrameType.END:
            t.conns.add(conn)
            conn.active.add(t)
            if h.total != t.total:
                self._finish(t, False, f"END says total {h.total}, data said {t.total}")
                return
            t.end_seen = True
            t.layers = h.layer
            if t.received == t.total:
                self._finish(t, True, "")
        else:
            reason = f.payload.decode("utf-8", "replace")
            self._finish(t, False, f"aborted by sender: {reason}")

    def _finish(self, t: _RxTransfer, ok: bool, reason: str) -> None:
        tid = t.transfer_id
        del self._transfers[tid]
        for c in t.conns:
            c.active.discard(t)
        if ok:
            self.transfers_completed += 1
        else:
            self.transfers_failed += 1
            log.debug("KV transfer %d failed: %s", tid, reason)
        result = TransferResult(
            tid, ok, t.received, t.first_byte, time.time(), reason,
            t.layers if ok else len(t.layers_seen), len(t.data_conns),
        )
        now = time.monotonic()
        self._finished[tid] = now
        fut = self._waiters.pop(tid, None)
        if fut is not None and not fut.done():
            fut.set_result(result)
        else:
            self._results[tid] = (result, now)

    def _fail_id(self, tid: int, reason: str) -> None:
        """Fail a transfer by id, even one we never saw a good frame of."""
        if tid in self._finished:
            return
        t = self._transfers.get(tid)
        if t is None:
            t = self._transfers[tid] = _RxTransfer(tid, 0, time.time(), time.monotonic())
        self._finish(t, False, reason)

    def _frame_error(self, conn: _RxConn, e: FrameError) -> None:
        conn.broken = True
        log.warning("closing KV connection from %s: %s", conn.peer, e.reason)
        if conn.transport is not None:
            conn.transport.abort()
        reason = f"bad frame from {conn.peer}: {e.reason}"
        if e.transfer_id is not None:
            self._fail_id(e.transfer_id, reason)
        for t in list(conn.active):
            self._finish(t, False, reason)

    def _conn_closed(self, conn: _RxConn, exc: Exception | None) -> None:
        self._conns.discard(conn)
        if conn.broken or self._closing:
            return
        conn.broken = True
        if exc is None and conn.decoder.buffered == 0:
            # Closed at a frame boundary: every frame sent on it arrived, so its transfers can
            # still complete over the other connections.
            conn.active.clear()
            return
        reason = f"connection from {conn.peer} lost" + (f": {exc!r}" if exc is not None else " mid-frame")
        log.warning("KV %s", reason)
        pending = conn.decoder.pending_header
        if pending is not None:
            self._fail_id(pending.transfer_id, reason)
        for t in list(conn.active):
            self._finish(t, False, reason)

    def _sweep(self) -> None:
        now = time.monotonic()
        for t in [t for t in self._transfers.values() if now - t.last_activity > self.idle_timeout]:
            self._finish(t, False, f"no frames for {self.idle_timeout:g} s")
        # Both maps are insertion-ordered by finish time: stop at the first young entry.
        while self._results:
            tid, (_, stamp) = next(iter(self._results.items()))
            if now - stamp <= self.result_ttl:
                break
            del self._results[tid]
        while self._finished:
            tid, stamp = next(iter(self._finished.items()))
            if now - stamp <= self.result_ttl:
                break
            del self._finished[tid]
        self._sweeper = asyncio.get_running_loop().call_later(1.0, self._sweep)


def _fmt(addr: Dest) -> str:
    return f"{addr[0]}:{addr[1]}"
