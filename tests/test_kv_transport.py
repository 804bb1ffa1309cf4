"""KV transport over loopback: integrity, striping, malformed input isolation, failures."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Callable

import pytest

from testbed.core.frames import HEADER, MAGIC, MAX_PAYLOAD, encode_abort, encode_data, encode_end, payload_pattern
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
        totals = [1, 7, 100, 4095, 4096, 65536, 262143, 262144, 262145, 300_000,
                  mib, mib + 1, 2 * mib - 3, 3 * mib, 3 * mib, 1234567, 777, 2 * mib, 500_000, 3 * mib - 1]
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


async def test_bad_length_fails_its_transfer_others_unaffected(receiver: tuple[KVReceiver, int], sender: KVSender) -> None:
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
    tx = KVSender(connections=4, chunk_bytes=65536)
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

