"""KV transport over loopback: integrity, striping, malformed input isolation, failures."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import struct
from collections.abc import AsyncIterator, Callable

import pytest

from testbed.core.kv.frames import HEADER, MAGIC, MAX_PAYLOAD, encode_abort, encode_data, encode_end, payload_pattern
from testbed.live.kv_transport import KVReceiver, KVSender, TransferFailed, TransferResult
from testbed.live.tcpinfo import TcpInfo, parse_tcp_info, read_tcp_info

pytestmark = pytest.mark.app

HOST = "127.0.0.1"
T = 5.0  # per-await timeout: a hang fails the test instead of stalling the suite


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[KVReceiver, int]]:
    rx = KVReceiver()
    port = await rx.start(HOST, 0)
    try:
        yield rx, port
    finally:
        await rx.close()


@pytest.fixture
async def sender() -> AsyncIterator[KVSender]:
    tx = KVSender(connections=4)
    try:
        yield tx
    finally:
        await tx.close()


async def send(tx: KVSender, port: int, tid: int, layer_sizes: list[int]) -> float:
    t = tx.start((HOST, port), tid, sum(layer_sizes), len(layer_sizes))
    for layer, n in enumerate(layer_sizes):
        t.send_layer(layer, n)
        await asyncio.sleep(0)  # layers become ready over time, as in a prefill
    return await asyncio.wait_for(t.finish(), T)


async def raw_conn(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(HOST, port)


def data(tid: int, offset: int, total: int, n: int, checksum: bool = False, layer: int = 0) -> bytes:
    head, view = encode_data(tid, layer, offset, total, payload_pattern(tid, offset, n), checksum)
    return head + bytes(view)


async def result(rx: KVReceiver, tid: int) -> TransferResult:
    return await asyncio.wait_for(rx.expect(tid), T)


async def closed_by_peer(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), T) == b""
    except ConnectionResetError:
        return True


async def wait_until(cond: Callable[[], bool]) -> None:
    async def poll() -> None:
        while not cond():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), T)


async def test_integrity_concurrent_transfers_striped_over_connections() -> None:
    rx = KVReceiver(verify=True)
    port = await rx.start(HOST, 0)
    tx = KVSender(connections=4, checksum=True)
    try:
        mib = 1 << 20
        totals = [
            1,
            7,
            100,
            4095,
            4096,
            65536,
            262143,
            262144,
            262145,
            300_000,
            mib,
            mib + 1,
            2 * mib - 3,
            3 * mib,
            3 * mib,
            1234567,
            777,
            2 * mib,
            500_000,
            3 * mib - 1,
        ]
        plans: dict[int, list[int]] = {}
        for i, total in enumerate(totals):
            # Uneven layers with a zero-byte layer in the middle.
            a = total // 3
            plans[1000 + i] = [a, 0, total - a - total // 4, total // 4]
        futures = {tid: rx.expect(tid) for tid in list(plans)[::2]}  # half expected up front
        await asyncio.gather(*(send(tx, port, tid, sizes) for tid, sizes in plans.items()))
        for tid in list(plans)[1::2]:
            futures[tid] = rx.expect(tid)
        results = {tid: await asyncio.wait_for(f, T) for tid, f in futures.items()}
        for tid, r in results.items():
            assert r.ok, r.reason
            assert r.bytes == sum(plans[tid])
            assert r.layers_done == 4
            assert r.first_byte <= r.complete
        big = [r for tid, r in results.items() if sum(plans[tid]) >= 3 * (1 << 20) - 1]
        assert all(r.connections > 1 for r in big), [r.connections for r in big]
        assert max(r.connections for r in results.values()) == 4
        assert rx.bytes_received == tx.bytes_sent == sum(totals)
        assert rx.transfers_completed == tx.transfers_sent == 20
        assert rx.transfers_failed == tx.transfers_failed == 0
        assert tx.backlog_bytes == 0
    finally:
        await tx.close()
        await rx.close()


async def test_zero_byte_transfer(receiver: tuple[KVReceiver, int], sender: KVSender) -> None:
    rx, port = receiver
    await send(sender, port, 5, [0, 0, 0])
    r = await result(rx, 5)
    assert r.ok and r.bytes == 0 and r.layers_done == 3 and r.connections == 0


async def test_expect_after_completion(receiver: tuple[KVReceiver, int], sender: KVSender) -> None:
    rx, port = receiver
    await send(sender, port, 7, [1000, 2000])
    await wait_until(lambda: rx.transfers_completed == 1)
    fut = rx.expect(7)
    assert fut.done()
    r = await fut
    assert r.ok and r.bytes == 3000 and r.transfer_id == 7


async def test_bad_magic_fails_only_that_connections_transfers(
    receiver: tuple[KVReceiver, int], sender: KVSender, caplog: pytest.LogCaptureFixture
) -> None:
    rx, port = receiver
    reader, writer = await raw_conn(port)
    b = asyncio.ensure_future(send(sender, port, 200, [300_000, 300_000]))
    # A good half of transfer 100, then garbage, in one write: both may land in one read.
    writer.write(data(100, 0, 2000, 1000) + b"\x00GARBAGE" * 8)
    with caplog.at_level(logging.WARNING, logger="testbed.kv"):
        ra = await result(rx, 100)
        assert await closed_by_peer(reader)
    assert not ra.ok and "magic" in ra.reason and ra.bytes == 1000
    assert any("magic" in rec.getMessage() and "closing" in rec.getMessage() for rec in caplog.records)
    await b
    rb = await result(rx, 200)
    assert rb.ok and rb.bytes == 600_000
    writer.close()


async def test_bad_length_fails_its_transfer_others_unaffected(
    receiver: tuple[KVReceiver, int], sender: KVSender
) -> None:
    rx, port = receiver
    r1, w1 = await raw_conn(port)
    r2, w2 = await raw_conn(port)
    w2.write(data(301, 0, 4000, 2000))  # transfer D, half sent on another connection
    await w2.drain()
    await wait_until(lambda: rx.bytes_received >= 2000)
    w1.write(HEADER.pack(MAGIC, 1, 1, 0, 300, 0, 0, MAX_PAYLOAD + 1, 0, MAX_PAYLOAD + 1, 0, 0))
    rc = await result(rx, 300)
    assert not rc.ok and "length" in rc.reason and str(MAX_PAYLOAD + 1) in rc.reason
    assert await closed_by_peer(r1)
    w2.write(data(301, 2000, 4000, 2000) + encode_end(301, 1, 4000))
    rd = await result(rx, 301)
    assert rd.ok and rd.bytes == 4000
    await send(sender, port, 302, [10_000])
    assert (await result(rx, 302)).ok
    for w in (w1, w2):
        w.close()


async def test_abort_frame_fails_transfer_with_reason(receiver: tuple[KVReceiver, int]) -> None:
    rx, port = receiver
    reader, writer = await raw_conn(port)
    writer.write(data(400, 0, 5000, 1000) + encode_abort(400, "prefill node out of memory"))
    r = await result(rx, 400)
    assert not r.ok and "prefill node out of memory" in r.reason
    # ABORT is legitimate protocol: the connection stays usable; stragglers of 400 are dropped.
    writer.write(data(400, 1000, 5000, 1000) + data(401, 0, 10, 10) + encode_end(401, 1, 10))
    r2 = await result(rx, 401)
    assert r2.ok
    assert rx.transfers_failed == 1
    writer.close()


async def test_duplicate_offset_rejected(receiver: tuple[KVReceiver, int]) -> None:
    rx, port = receiver
    _, writer = await raw_conn(port)
    writer.write(data(500, 0, 300, 100) + data(500, 50, 300, 100))
    r = await result(rx, 500)
    assert not r.ok and "overlapping" in r.reason
    writer.close()


async def test_verify_mode_rejects_wrong_bytes_and_missing_checksum() -> None:
    rx = KVReceiver(verify=True)
    port = await rx.start(HOST, 0)
    try:
        _, writer = await raw_conn(port)
        # Valid CRC, but the bytes of offset 8 placed at offset 0.
        head, view = encode_data(600, 0, 0, 64, payload_pattern(600, 8, 32), checksum=True)
        writer.write(head + bytes(view))
        writer.write(data(601, 0, 32, 32, checksum=False))
        r600, r601 = await result(rx, 600), await result(rx, 601)
        assert not r600.ok and "pattern" in r600.reason
        assert not r601.ok and "checksum" in r601.reason
        writer.close()
    finally:
        await rx.close()


async def test_sender_fails_when_receiver_goes_away() -> None:
    rx = KVReceiver()
    port = await rx.start(HOST, 0)
    # It tries to resume on new connections for resume_timeout, then fails with the last error.
    tx = KVSender(connections=4, chunk_bytes=65536, resume_timeout=1.0)
    try:
        layer = 4 << 20
        t = tx.start((HOST, port), 700, 8 * layer, 8)
        t.send_layer(0, layer)
        await wait_until(lambda: rx.bytes_received > 0)
        await rx.close()
        for i in range(1, 8):
            t.send_layer(i, layer)
            await asyncio.sleep(0.001)
        with pytest.raises(TransferFailed):
            await asyncio.wait_for(t.finish(), T)
        assert t.failed is not None
        assert tx.transfers_failed == 1
        # With nobody listening, the next transfer fails on connect instead of hanging.
        t2 = tx.start((HOST, port), 701, 100, 1)
        t2.send_layer(0, 100)
        with pytest.raises(TransferFailed, match="connect"):
            await asyncio.wait_for(t2.finish(), T)
        assert tx.transfers_failed == 2
        # A receiver back on the same port: the sender re-opens its connections.
        rx = KVReceiver()
        assert await rx.start(HOST, port) == port
        await send(tx, port, 702, [1 << 20, 1 << 20])
        r = await result(rx, 702)
        assert r.ok and r.connections > 1
    finally:
        await tx.close()
        await rx.close()


async def test_tcp_info_after_transfer(receiver: tuple[KVReceiver, int], sender: KVSender) -> None:
    rx, port = receiver
    await send(sender, port, 800, [2 << 20])
    assert (await result(rx, 800)).ok
    stats = sender.tcp_info()
    assert 1 <= len(stats) <= 4
    assert {s.dest for s in stats} == {(HOST, port)}
    assert all(s.rtt_us >= 0 and s.snd_cwnd > 0 for s in stats)
    assert sum(s.bytes_sent for s in stats) >= 2 << 20
    assert sum(s.bytes_acked for s in stats) > 0


async def test_sender_socket_options(receiver: tuple[KVReceiver, int], caplog: pytest.LogCaptureFixture) -> None:
    rx, port = receiver
    for cc, warns in (("cubic", False), ("no-such-cc", True)):
        tx = KVSender(connections=2, sndbuf=1 << 20, congestion=cc)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="testbed.kv"):
            await send(tx, port, 900 if warns else 901, [100_000])
        assert (await result(rx, 900 if warns else 901)).ok
        assert any("congestion" in rec.getMessage() for rec in caplog.records) == warns
        await tx.close()


def test_read_tcp_info_rejects_non_tcp_and_parses_short_buffers() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        assert read_tcp_info(udp) is None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((HOST, 0))
        listener.listen()
        info = read_tcp_info(listener)
        assert info is not None and info.state == 10  # TCP_LISTEN
    buf = bytearray(104)
    buf[0] = 1
    buf[68:72] = (1234).to_bytes(4, "little" if socket.htons(1) != 1 else "big")
    info2 = parse_tcp_info(bytes(buf))
    assert info2.state == 1 and info2.rtt == 1234 and info2.bytes_sent == 0 and info2.delivery_rate == 0
    assert parse_tcp_info(b"") == TcpInfo()


async def test_close_resolves_pending_expectations() -> None:
    rx = KVReceiver()
    await rx.start(HOST, 0)
    fut = rx.expect(999)
    await rx.close()
    r = await asyncio.wait_for(fut, T)
    assert not r.ok and "closed" in r.reason


def rst(transport: asyncio.BaseTransport) -> None:
    """Close with a TCP reset, as a middlebox or a crashed peer would."""
    sock = transport.get_extra_info("socket")
    if sock is not None and not transport.is_closing():
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    assert isinstance(transport, asyncio.WriteTransport)
    transport.abort()


class Proxy:
    """A TCP relay in front of a receiver that can play a WAN: `reset()` resets every relayed
    connection both ways (RST, bytes in flight lost); while `refusing`, new connections are reset
    as they arrive; `down()`/`up()` stop and resume listening (connects are refused); while
    `blackhole`, relayed bytes are held (nothing forwarded, nothing closed); with `hold_after`,
    the blackhole begins once that many bytes have been forwarded (so a test acts mid-transfer
    however slowly it gets to run: nothing more arrives meanwhile)."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.refusing = False
        self.blackhole = False
        self.hold_after: int | None = None
        self.forwarded = 0
        self.pairs: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self.accepted = 0
        self.resets = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self, port: int = 0) -> int:
        self._server = await asyncio.start_server(self._accept, HOST, port)
        self.port: int = self._server.sockets[0].getsockname()[1]
        return self.port

    async def down(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def up(self) -> None:
        await self.start(self.port)

    @staticmethod
    def _rst(w: asyncio.StreamWriter) -> None:
        rst(w.transport)

    async def _accept(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.refusing:
            self._rst(w)
            return
        resets = self.resets
        ur, uw = await asyncio.open_connection(HOST, self.upstream)
        if self.refusing or resets != self.resets:
            # A reset (or an outage) came while this one was being relayed upstream: it is hit
            # too, or it would carry everything through the outage on a loaded machine.
            self._rst(w)
            self._rst(uw)
            return
        self.pairs.append((w, uw))
        for src, dst in ((r, uw), (ur, w)):
            task = asyncio.create_task(self._pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                while self.blackhole:
                    await asyncio.sleep(0.01)
                dst.write(data)
                self.forwarded += len(data)
                if self.hold_after is not None and self.forwarded >= self.hold_after:
                    self.blackhole = True
                await dst.drain()
        except (OSError, RuntimeError):
            pass
        dst.transport.abort()

    def reset(self) -> None:
        self.resets += 1
        for a, b in self.pairs:
            self._rst(a)
            self._rst(b)
        self.pairs.clear()

    async def close(self) -> None:
        self.reset()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def outage_run(
    resume_timeout: float, outage: float, down: bool = False
) -> tuple[list[TransferResult], list[BaseException | float], KVSender]:
    """Eight 2 MiB transfers through the proxy; once 1 MiB has arrived, every connection is
    reset, and for `outage` seconds new ones are reset as they come (or, `down`, refused). The
    proxy holds everything after the first MiB until the reset (the bytes held are lost with it),
    so the transfers are mid-way when it comes on any machine, a busy one included: waiting for
    the receiver to have 1 MiB instead lets loopback carry all 16 MiB before the wait sees it."""
    rx = KVReceiver(verify=True)
    port = await rx.start(HOST, 0)
    proxy = Proxy(port)
    proxy.hold_after = 1 << 20
    pport = await proxy.start()
    tx = KVSender(connections=4, chunk_bytes=65536, checksum=True, resume_timeout=resume_timeout)
    try:
        tids = list(range(3000, 3008))
        waits = [rx.expect(tid) for tid in tids]
        transfers = [tx.start((HOST, pport), tid, 2 << 20, 4) for tid in tids]
        for t in transfers:
            for layer in range(4):
                t.send_layer(layer, 512 << 10)
        finishing = [asyncio.ensure_future(t.finish()) for t in transfers]
        await wait_until(lambda: proxy.blackhole)
        proxy.refusing = True
        if down:
            await proxy.down()
        proxy.reset()
        proxy.hold_after, proxy.blackhole = None, False
        await asyncio.sleep(outage)
        proxy.refusing = False
        if down:
            await proxy.up()
        sent = await asyncio.wait_for(asyncio.gather(*finishing, return_exceptions=True), 3 * T)
        got = (
            list(await asyncio.wait_for(asyncio.gather(*waits), 3 * T))
            if all(isinstance(x, float) for x in sent)
            else []
        )
        return got, list(sent), tx
    finally:
        await tx.close()
        await proxy.close()
        await rx.close()


async def test_a_wan_outage_with_resets_mid_transfer_ends_with_every_transfer_complete() -> None:
    got, sent, tx = await outage_run(resume_timeout=10.0, outage=1.0)
    assert all(isinstance(x, float) for x in sent), sent
    assert [r.ok for r in got] == [True] * 8, [r.reason for r in got]
    assert all(r.bytes == 2 << 20 for r in got)  # verified against the pattern, byte for byte
    assert tx.resumes >= 1 and tx.transfers_sent == 8 and tx.transfers_failed == 0


@pytest.mark.parametrize("down", [False, True], ids=["resetting", "refusing"])
async def test_an_outage_beyond_the_resume_budget_fails_with_the_reason(down: bool) -> None:
    _, sent, tx = await outage_run(resume_timeout=0.5, outage=2.5, down=down)
    failed = [x for x in sent if isinstance(x, TransferFailed)]
    # Reset connections stall what they carried; a destination that refuses connections stalls
    # everything queued for it. (Transfers nothing of which was written meanwhile go on after.)
    assert len(failed) >= (7 if down else 1), sent
    pattern = r"connect to .* failed: .*Refused.*" if down else r".*(reset|lost|failed).*"
    assert all(re.fullmatch(pattern + r" \(not resumed within 0\.5 s\)", x.reason) for x in failed), failed
    assert tx.transfers_failed == len(failed) and tx.transfers_sent == 8 - len(failed)


async def test_a_black_holed_connection_is_given_up_after_the_ack_timeout_and_resumed() -> None:
    rx = KVReceiver(verify=True)
    port = await rx.start(HOST, 0)
    proxy = Proxy(port)
    pport = await proxy.start()
    tx = KVSender(connections=2, chunk_bytes=65536, checksum=True, ack_timeout=0.5)
    try:
        fut = rx.expect(3100)
        t = tx.start((HOST, pport), 3100, 4 << 20, 2)
        t.send_layer(0, 2 << 20)
        await wait_until(lambda: rx.bytes_received > 0)
        proxy.blackhole = True  # the old connections go silent, new ones are relayed anew
        held = list(proxy.pairs)
        proxy.pairs.clear()
        t.send_layer(1, 2 << 20)
        await wait_until(lambda: proxy.accepted > 2)
        proxy.blackhole = False  # (only the new pumps would run; the old ones stay blocked)
        for a, b in held:
            Proxy._rst(a)
            Proxy._rst(b)
        await asyncio.wait_for(t.finish(), T)
        r = await asyncio.wait_for(fut, T)
        assert r.ok and r.bytes == 4 << 20 and tx.resumes >= 1
    finally:
        await tx.close()
        await proxy.close()
        await rx.close()


async def test_connections_reset_by_the_receiver_side_resume_on_new_ones() -> None:
    rx = KVReceiver(verify=True)
    port = await rx.start(HOST, 0)
    tx = KVSender(connections=3, chunk_bytes=32768, checksum=True)
    try:
        fut = rx.expect(3200)
        t = tx.start((HOST, port), 3200, 8 << 20, 8)
        for layer in range(8):
            t.send_layer(layer, 1 << 20)
            if layer in (2, 5):
                await wait_until(lambda layer=layer: rx.bytes_received > (layer - 1) << 20)
                for transport in list(rx._transports.values()):  # reset from the receiver's side
                    rst(transport)
        await asyncio.wait_for(t.finish(), T)
        r = await asyncio.wait_for(fut, T)
        assert r.ok and r.bytes == 8 << 20 and tx.resumes >= 1
        assert rx.duplicate_bytes <= tx.bytes_resent
    finally:
        await tx.close()
        await rx.close()


async def test_a_bad_header_naming_a_transfer_in_flight_elsewhere_does_not_fail_it(
    receiver: tuple[KVReceiver, int], sender: KVSender
) -> None:
    rx, port = receiver
    t = sender.start((HOST, port), 3300, 2 << 20, 2)
    fut = rx.expect(3300)
    t.send_layer(0, 1 << 20)
    await wait_until(lambda: rx.reassembler.transfer(3300) is not None)
    r1, w1 = await raw_conn(port)
    w1.write(HEADER.pack(MAGIC, 1, 1, 0, 3300, 0, 0, MAX_PAYLOAD + 1, 0, MAX_PAYLOAD + 1, 0, 0))
    assert await closed_by_peer(r1)
    t.send_layer(1, 1 << 20)
    await asyncio.wait_for(t.finish(), T)
    r = await asyncio.wait_for(fut, T)
    assert r.ok and r.bytes == 2 << 20
    w1.close()


async def test_connections_beyond_the_receivers_limit_are_closed_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    rx = KVReceiver(max_connections=3)
    port = await rx.start(HOST, 0)
    try:
        held = [await raw_conn(port) for _ in range(3)]
        await wait_until(lambda: rx.connections == 3)
        with caplog.at_level(logging.WARNING, logger="testbed.kv"):
            r4, w4 = await raw_conn(port)
            assert await closed_by_peer(r4)
        assert rx.connections_refused == 1
        assert any(
            "refusing KV connection" in rec.getMessage() and "limit 3" in rec.getMessage() for rec in caplog.records
        )
        held[0][1].close()
        await wait_until(lambda: rx.connections == 2)
        tx = KVSender(connections=1)
        try:
            await send(tx, port, 3400, [1000])
            assert (await result(rx, 3400)).ok
        finally:
            await tx.close()
        for _, w in held[1:] + [(r4, w4)]:
            w.close()
    finally:
        await rx.close()


async def test_a_connection_stuck_inside_a_frame_is_closed_after_the_frame_timeout() -> None:
    rx = KVReceiver(frame_timeout=0.3)
    port = await rx.start(HOST, 0)
    try:
        reader, writer = await raw_conn(port)
        idle_r, idle_w = await raw_conn(port)
        writer.write(data(3500, 0, 1 << 20, 1 << 20)[:5000])  # then nothing
        idle_w.write(data(3501, 0, 10, 5))  # a whole frame, then idle: kept
        await wait_until(lambda: rx.bytes_received == 5)
        assert await closed_by_peer(reader)
        assert rx.connections == 1 and rx.reassembler.held_bytes == 0
        writer.close()
        idle_w.close()
    finally:
        await rx.close()


async def test_loopback_bench_measures_a_transfer() -> None:
    from testbed.studies.bench.bench import kv_loopback_once

    rate, cpu = await kv_loopback_once(8 << 20, 2, 65536, layers=4)
    assert rate > 0 and cpu > 0


def test_scenarios_bound_the_resume_timeout_and_receivers_outlast_it() -> None:
    from pydantic import ValidationError

    from testbed.core.schema.scenario import TransferSpec
    from testbed.live.kv_transport import IDLE_TIMEOUT_S, receiver_idle_timeout

    assert TransferSpec().resume_timeout_s == 30.0
    with pytest.raises(ValidationError, match="resume_timeout_s"):
        TransferSpec(resume_timeout_s=0)
    assert receiver_idle_timeout(30.0) == IDLE_TIMEOUT_S == 60.0
    assert receiver_idle_timeout(300.0, ack_timeout=15.0) == 330.0
