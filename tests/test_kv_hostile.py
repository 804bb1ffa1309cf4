"""A live KV receiver against hostile peers over real loopback connections: fuzzed byte streams
beside a legitimate transfer, memory under 100 hostile connections held open, and 200,000
invented transfer ids. Hostile clients that hold memory run in a child process, so the
receiver's own RSS (this process, /proc/self/status VmRSS) is what is measured."""

from __future__ import annotations

import asyncio
import gc
import random
import socket
import struct
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from procinfo import vmrss

from testbed.core.kv.frames import (
    HEADER,
    MAGIC,
    MAX_PAYLOAD,
    MAX_REASON,
    FrameType,
    encode_abort,
    encode_ack,
    encode_data,
    encode_end,
    payload_pattern,
)
from testbed.core.kv.kv_receive import MAX_TRANSFERS_PER_PEER, fragment_cap
from testbed.live.kv_transport import KVReceiver, KVSender

pytestmark = pytest.mark.app

HOST = "127.0.0.1"
T = 10.0
GOOD = 0xC0FFEE_0000_0001  # the legitimate transfer's id; hostile ids are drawn below 2**40


async def wait_until(cond: Callable[[], bool], timeout: float = T) -> None:
    async def poll() -> None:
        while not cond():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout)


def hostile_stream(rng: random.Random) -> bytes:
    """Valid frames of invented transfers, bad headers, truncations and garbage, mixed."""
    parts: list[bytes] = []
    for _ in range(rng.randrange(1, 12)):
        tid = rng.randrange(2**40)
        k = rng.random()
        if k < 0.35:
            n = rng.randrange(2000)
            total = n + rng.randrange(3) * rng.randrange(5000)
            off = rng.randrange(total - n + 1)
            head, view = encode_data(
                tid, rng.randrange(64), off, total, payload_pattern(tid, off, n), rng.random() < 0.5
            )
            parts.append(head + bytes(view))
        elif k < 0.45:
            parts.append(encode_end(tid, rng.randrange(64), rng.randrange(10_000)))
        elif k < 0.5:
            parts.append(encode_abort(tid, "hostile"))
        elif k < 0.55:
            parts.append(encode_ack(rng.randrange(2**40)))  # only a receiver may send these
        elif k < 0.75:
            fields = [
                MAGIC,
                1,
                rng.choice([1, 2, 3, 4, 7]),
                rng.choice([0, 1, 0x8000]),
                tid,
                rng.randrange(5000),
                rng.choice([0, 0, 1]),
                rng.choice([0, 10, MAX_PAYLOAD, MAX_PAYLOAD + 1, 2**32 - 1]),
                rng.choice([0, 5, 2**63]),
                rng.choice([0, 10, MAX_PAYLOAD, 2**64 - 1]),
                rng.choice([0, 7]),
                rng.choice([0, 0, 3]),
            ]
            parts.append(HEADER.pack(*fields))
        else:
            parts.append(rng.randbytes(rng.randrange(1, 120)))
    raw = b"".join(parts)
    return raw[: rng.randrange(len(raw) + 1)] if rng.random() < 0.3 else raw


async def hostile_client(port: int, stream: bytes, rng: random.Random) -> None:
    r, w = await asyncio.open_connection(HOST, port)
    try:
        i = 0
        while i < len(stream):
            n = rng.choice([1, 7, 48, 500, len(stream)])
            w.write(stream[i : i + n])
            await w.drain()
            i += n
            if rng.random() < 0.3:
                await asyncio.sleep(0.001)
        end = rng.random()
        if end < 0.3:
            sock = w.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
            w.transport.abort()
        elif end < 0.6:
            w.close()
        else:
            await asyncio.sleep(0.05)  # left open a while, then closed
            w.close()
    except (ConnectionError, OSError):
        pass  # the receiver closed it: that is the point


async def live_fuzz(seed: int, conns: int) -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    rng = random.Random(seed)
    rx = KVReceiver(verify=True, frame_timeout=0.3)
    port = await rx.start(HOST, 0)
    tx = KVSender(connections=2, chunk_bytes=16384, checksum=True)
    try:
        fut = rx.expect(GOOD)
        good = tx.start((HOST, port), GOOD, 256 << 10, 4)
        clients = [asyncio.ensure_future(hostile_client(port, hostile_stream(rng), rng)) for _ in range(conns)]
        for layer in range(4):
            good.send_layer(layer, 64 << 10)
            await asyncio.sleep(0.002)
        await asyncio.wait_for(good.finish(), T)
        r = await asyncio.wait_for(fut, T)
        assert r.ok and r.bytes == 256 << 10, r.reason
        await asyncio.wait_for(asyncio.gather(*clients, return_exceptions=True), T)
        # Still serving: another transfer after the storm.
        fut2 = rx.expect(GOOD + 1)
        t2 = tx.start((HOST, port), GOOD + 1, 50_000, 1)
        t2.send_layer(0, 50_000)
        await asyncio.wait_for(t2.finish(), T)
        assert (await asyncio.wait_for(fut2, T)).ok
    finally:
        await tx.close()
        await rx.close()
    assert not errors, errors


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**64 - 1), st.integers(1, 6))
def test_live_receiver_survives_fuzzed_hostile_connections_beside_a_good_transfer(seed: int, conns: int) -> None:
    asyncio.run(live_fuzz(seed, conns))


# -- memory -------------------------------------------------------------------------------------

CLIENT = r"""
import socket, struct, sys, time
port, kind_count = int(sys.argv[1]), int(sys.argv[2])
MAGIC, MAX_PAYLOAD = 0x4B565446, 16 * 1024 * 1024
H = struct.Struct(">IBBHQHHIQQII")
blob = bytes(4 << 20)
socks, sent = [], 0
for i in range(kind_count):
    s = socket.create_connection(("127.0.0.1", port))
    kind = i % 5
    if kind == 0:    # a partial header
        data = H.pack(MAGIC, 1, 1, 0, i, 0, 0, 100, 0, 100, 0, 0)[: 1 + i % 47]
    elif kind == 1:  # a DATA header announcing 16 MiB, then 4 MiB of it
        data = H.pack(MAGIC, 1, 1, 0, i, 0, 0, MAX_PAYLOAD, 0, MAX_PAYLOAD, 0, 0) + blob
    elif kind == 2:  # an oversized length: refused at the header
        data = H.pack(MAGIC, 1, 1, 0, i, 0, 0, MAX_PAYLOAD + 1, 0, MAX_PAYLOAD + 1, 0, 0)
    elif kind == 3:  # 50 invented transfers, one byte each, then half a header
        data = b"".join(H.pack(MAGIC, 1, 1, 0, (i << 20) + k, 0, 0, 1, 0, 2, 0, 0) + b"x" for k in range(50))
        data += H.pack(MAGIC, 1, 1, 0, i, 0, 0, 1, 0, 2, 0, 0)[:24]
    else:            # an ABORT announcing a 1 KiB reason, 1000 bytes of it
        data = H.pack(MAGIC, 1, 3, 0, i, 0, 0, 1024, 0, 0, 0, 0) + b"r" * 1000
    s.sendall(data)
    sent += len(data)
    socks.append(s)
print(sent, flush=True)
sys.stdin.readline()   # hold every connection open until told
"""

INVENTED = r"""
import socket, struct, sys, threading
port, n = int(sys.argv[1]), int(sys.argv[2])
H = struct.Struct(">IBBHQHHIQQII")
s = socket.create_connection(("127.0.0.1", port))
def drain():   # read the receiver's ACKs and ABORTs, as a sender does
    while s.recv(1 << 16):
        pass
threading.Thread(target=drain, daemon=True).start()
for k in range(0, n, 10000):
    s.sendall(b"".join(H.pack(0x4B565446, 1, 1, 0, 1 + tid, 0, 0, 1, 0, 2, 0, 0) + b"x"
                       for tid in range(k, min(k + 10000, n))))
print(n, flush=True)
sys.stdin.readline()
"""


async def with_client(script: str, *args: str, body: Callable[[int], Awaitable[None]]) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        await body(int(line))
        proc.stdin.write(b"\n")
        await proc.stdin.drain()
        await asyncio.wait_for(proc.wait(), T)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def assert_a_real_transfer_still_goes_through(rx: KVReceiver, port: int) -> None:
    tx = KVSender(connections=2)
    try:
        fut = rx.expect(GOOD)
        t = tx.start((HOST, port), GOOD, 100_000, 1)
        t.send_layer(0, 100_000)
        await asyncio.wait_for(t.finish(), T)
        assert (await asyncio.wait_for(fut, T)).ok
    finally:
        await tx.close()


async def test_receiver_rss_stays_bounded_under_100_hostile_connections_held_open(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Twenty of the 100 send 4 MiB of a frame announcing 16 MiB (80 MiB that a buffering decoder
    would hold); the rest hold partial headers, a refused length, invented transfers, an ABORT
    reason. RSS growth must stay under 64 MiB; the frame deadline then frees the stuck ones."""
    rx = KVReceiver(frame_timeout=60.0)
    port = await rx.start(HOST, 0)
    try:
        gc.collect()
        before = vmrss()
        grown: list[int] = []

        async def measure(sent: int) -> None:
            await wait_until(lambda: rx.stream_bytes >= sent, 60)
            gc.collect()
            grown.append(vmrss() - before)
            assert rx.connections == 80  # the 20 with a refused length were closed at once
            assert rx.reassembler.held_bytes <= 80 * MAX_REASON
            rx.reassembler.frame_timeout = 0.2  # now let the deadline do its work
            await wait_until(lambda: rx.connections == 0)
            assert rx.reassembler.held_bytes == 0

        await with_client(CLIENT, str(port), "100", body=measure)
        with capsys.disabled():
            print(
                f"\nreceiver RSS growth under 100 hostile connections: {grown[0] / 2**20:.1f} MiB "
                f"({rx.stream_bytes / 2**20:.1f} MiB received from them)"
            )
        assert grown[0] < 64 << 20
    finally:
        await rx.close()


async def test_200000_invented_transfer_ids_cost_the_receiver_a_bounded_amount(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rx = KVReceiver()
    port = await rx.start(HOST, 0)
    try:
        gc.collect()
        before = vmrss()
        grown: list[int] = []

        async def measure(n: int) -> None:
            await wait_until(lambda: rx.reassembler.transfers_refused + rx.reassembler.active == n, 120)
            gc.collect()
            grown.append(vmrss() - before)
            assert rx.reassembler.active == 256 and rx.reassembler.kept == (4096, 16384)

        await with_client(INVENTED, str(port), "200000", body=measure)
        with capsys.disabled():
            print(f"\nreceiver RSS growth for 200,000 invented transfer ids: {grown[0] / 2**20:.1f} MiB")
        assert grown[0] < 64 << 20
        await assert_a_real_transfer_still_goes_through(rx, port)
    finally:
        await rx.close()


FRAGMENTS = r"""
import socket, struct, sys, threading
port, n = int(sys.argv[1]), int(sys.argv[2])
H = struct.Struct(">IBBHQHHIQQII")
s = socket.create_connection(("127.0.0.1", port))
def drain():
    try:
        while s.recv(1 << 16):
            pass
    except OSError:
        pass
threading.Thread(target=drain, daemon=True).start()
sent = 0
try:   # one-byte DATA frames of one transfer, a byte apart: none joins another
    for k in range(0, n, 10000):
        s.sendall(b"".join(H.pack(0x4B565446, 1, 1, 0, 77, 0, 0, 1, 2 * i, 4 * n, 0, 0) + b"x"
                           for i in range(k, min(k + 10000, n))))
        sent = min(k + 10000, n)
except OSError:   # the receiver closed the connection
    pass
print(sent, flush=True)
sys.stdin.readline()
"""


async def test_400000_separate_one_byte_fragments_fail_the_transfer_at_the_cap(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Unbounded, the ranges of 400,000 one-byte frames held ~30 MB. Past the cap the transfer
    fails naming it, its connection is closed, the memory is freed and the receiver serves on."""
    n = 400_000
    cap = fragment_cap(4 * n)
    rx = KVReceiver()
    port = await rx.start(HOST, 0)
    try:
        gc.collect()
        before = vmrss()
        grown: list[int] = []
        fut = rx.expect(77)

        async def measure(sent: int) -> None:
            result = await asyncio.wait_for(fut, 60)
            assert not result.ok and f"more than {cap} separate byte ranges (limit {cap}" in result.reason
            await wait_until(lambda: rx.connections == 0)
            gc.collect()
            grown.append(vmrss() - before)
            assert rx.reassembler.active == 0

        await with_client(FRAGMENTS, str(port), str(n), body=measure)
        with capsys.disabled():
            print(f"\nreceiver RSS growth for {n:,} separate one-byte fragments: {grown[0] / 2**20:.1f} MiB")
        assert grown[0] < 8 << 20  # ~30 MiB unbounded; the cap's ranges are ~0.5 MiB
        await assert_a_real_transfer_still_goes_through(rx, port)
    finally:
        await rx.close()


def test_hostile_generators_cover_every_frame_type() -> None:
    """Guard for the fuzz above: its streams do contain each frame type, bad headers and garbage."""
    seen: set[int] = set()
    rng = random.Random(1)
    for _ in range(200):
        raw = hostile_stream(rng)
        for i in range(0, len(raw) - HEADER.size + 1):
            if raw[i : i + 4] == MAGIC.to_bytes(4, "big"):
                seen.add(raw[i + 5])
    assert {int(t) for t in FrameType} <= seen and 7 in seen


# -- 32 silent connections against a deployment ------------------------------------------------

FLOOD = r"""
import socket, struct, sys
ports = [int(p) for p in sys.argv[1].split(",")]
conns, per, hosts = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
H = struct.Struct(">IBBHQHHIQQII")
socks = []
for j, port in enumerate(ports):
    for i in range(conns):
        s = socket.socket()
        s.bind((f"127.0.0.{2 + i % hosts}" if hosts > 1 else "127.0.0.1", 0))   # loopback takes any 127/8 source
        s.connect(("127.0.0.1", port))
        base = (1 << 62) + (j << 40) + (i << 20)
        try:
            s.sendall(b"".join(H.pack(0x4B565446, 1, 1, 0, base + k, 0, 0, 1, 0, 2, 0, 0) + b"x" for k in range(per)))
        except OSError:   # refused: not an address of the deployment
            pass
        socks.append(s)
print(len(socks), flush=True)
sys.stdin.readline()   # every connection open and silent until told
"""


@pytest.mark.parametrize("hosts", [1, 8])
async def test_requests_complete_while_32_silent_connections_hold_every_decode_nodes_transfer_table(
    tmp_path: Path, hosts: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """The attack seen live: 32 connections to each decode node's KV port, 128 transfers opened on
    each and left silent. From the nodes' own address (on loopback every local process has it)
    they hold that address's 1024 places, shared with the prefill nodes; from eight others, every
    connection is closed at once (no node of the deployment has those addresses; in a container
    deployment, the host's address on the bridge is such a one). Either way a trace replayed
    through the router meanwhile completes every request."""
    from testbed.config.scenarios import load_scenario
    from testbed.deploy.inproc import InProcessBackend
    from testbed.deploy.plan import loopback_deployment
    from testbed.live import decode_node
    from testbed.live.replayer import replay
    from testbed.metrics.records import RecordWriter, read_records
    from testbed.run.load import resolve
    from testbed.traces.loader import trace_from_workload

    sc = load_scenario(
        "paper-prfaas",
        {
            "scale": {"speedup": 40, "byte_scale": 1024},
            "workload": {"requests": 24, "rate": 4.0, "output_tokens": 12, "seed": 3},
        },
    )
    dep = loopback_deployment(resolve(sc), str(tmp_path))
    decodes = sorted(n for n, e in dep.nodes.items() if e.role == "decode")
    ports = ",".join(str(dep.nodes[n].kv.port) for n in decodes if dep.nodes[n].kv is not None)
    writer = RecordWriter(tmp_path / "records.csv")
    figures: dict[str, str] = {}
    be = InProcessBackend(dep)
    async with be as d:
        rxs = [service_app(be, n)[decode_node.STATE].receiver.reassembler for n in decodes]
        receivers = [service_app(be, n)[decode_node.STATE].receiver for n in decodes]

        async def attacked(opened: int) -> None:
            if hosts == 1:
                await wait_until(lambda: all(rx.active >= MAX_TRANSFERS_PER_PEER for rx in rxs), 60)
            else:
                await wait_until(lambda: all(r.peers_refused >= 32 for r in receivers), 60)
                assert all(rx.active == 0 for rx in rxs)
            before = [(rx.active, rx.transfers_evicted, rx.transfers_refused) for rx in rxs]
            stats = await replay(
                trace_from_workload(sc.workload),
                d.router.url,
                writer,
                sc.scale.speedup,
                sc.model.name,
                api_key=d.credentials.api_key,
            )
            after = [(rx.active, rx.transfers_evicted, rx.transfers_refused) for rx in rxs]
            assert len(rxs[0].connections) >= (32 if hosts == 1 else 0)
            figures.update(
                opened=str(opened),
                completed=f"{stats.completed}/{stats.total}",
                refused=" ".join(str(r.peers_refused) for r in receivers),
                held=" ".join(str(b[0]) for b in before),
                evicted=" ".join(str(a[1] - b[1]) for a, b in zip(after, before)),
            )

        await with_client(FLOOD, ports, "32", "128", str(hosts), body=attacked)
    writer.close()
    recs = read_records(tmp_path / "records.csv")
    with capsys.disabled():
        print(
            f"\n{figures['opened']} silent KV connections from {hosts} address(es) (refused per decode node: "
            f"{figures['refused']}) holding {figures['held']} transfers on the {len(decodes)} decode nodes: "
            f"{figures['completed']} requests completed; places taken back from the flood per decode node: "
            f"{figures['evicted']}"
        )
    assert len(recs) == 24 and all(r.outcome == "completed" for r in recs), [
        r.reason for r in recs if r.outcome != "completed"
    ]


def service_app(be: Any, node: str) -> Any:
    """A service's aiohttp application in an in-process deployment (the test reads its receiver)."""
    return be._by_id[node].app
