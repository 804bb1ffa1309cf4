"""Fuzzing the frame decoder and both transfer machines with hostile bytes.

Each example expands a seed into a batch of valid frames of every type, mutates the stream
(random bytes, flipped bytes, a header field set to a boundary value, truncation, trailing or
spliced-in bytes) and feeds it whole, in random pieces or byte by byte, to a keeping and a
streaming decoder at once. Whatever the input: no exception but FrameError, a dead decoder
after one, the two modes agree frame for frame and error for error, unmutated frames come back
exactly, and what a decoder holds stays bounded. Frame cases over the module: see FRAME_CASES
(printed at the end of the module's run).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.core.kv.frames import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_LAYERS,
    MAX_PAYLOAD,
    MAX_REASON,
    MAX_TOTAL,
    VERSION,
    Frame,
    FrameDecoder,
    FrameError,
    FrameType,
    encode_abort,
    encode_ack,
    encode_data,
    encode_end,
)
from testbed.core.kv.kv_receive import Reassembler
from testbed.core.kv.kv_receive_types import Send
from testbed.core.kv.kv_send import SendPath

pytestmark = pytest.mark.pure

DEADLINE = timedelta(seconds=10)  # a hang fails the example, not the suite (generous: shared CPU)
MUTATIONS = ["none", "flip", "field", "truncate", "trailing", "splice", "random"]
FEEDS = ["whole", "pieces", "bytes"]
FIELD_OFFSETS = {
    "magic": (0, 4),
    "version": (4, 1),
    "type": (5, 1),
    "flags": (6, 2),
    "tid": (8, 8),
    "layer": (16, 2),
    "reserved": (18, 2),
    "length": (20, 4),
    "offset": (24, 8),
    "total": (32, 8),
    "crc": (40, 4),
    "pad": (44, 4),
}
counts = {"frames": 0, "examples": 0, "bytes": 0}


@pytest.fixture(scope="module", autouse=True)
def _report(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    line = (
        f"\nframe fuzz: {counts['frames']} frame cases in {counts['examples']} streams "
        f"({counts['bytes'] / 1e6:.1f} MB fed to each decoder mode)"
    )
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if capture is not None:
        with capture.global_and_fixture_disabled():
            print(line)


def valid_frame(rng: random.Random) -> tuple[bytes, tuple[int, int, bytes]]:
    kind = rng.random()
    tid = rng.choice([0, 1, rng.randrange(2**64)])
    if kind < 0.6:
        n = rng.choice([0, 1, rng.randrange(300), rng.randrange(3000)])
        total = rng.choice([n, n + rng.randrange(10_000), MAX_TOTAL])
        off = rng.randrange(total - n + 1) if total - n < 2**62 else rng.randrange(2**40)
        payload = rng.randbytes(n)
        head, view = encode_data(tid, rng.randrange(MAX_LAYERS), off, total, payload, rng.random() < 0.5)
        return head + bytes(view), (FrameType.DATA, tid, payload)
    if kind < 0.75:
        return encode_end(tid, rng.randrange(MAX_LAYERS), rng.randrange(MAX_TOTAL + 1)), (FrameType.END, tid, b"")
    if kind < 0.9:
        reason = "".join(rng.choice("ab ✗é\x00") for _ in range(rng.randrange(40)))
        frame = encode_abort(tid, reason)
        return frame, (FrameType.ABORT, tid, frame[HEADER_SIZE:])
    return encode_ack(rng.randrange(2**64)), (FrameType.ACK, 0, b"")


def boundary(rng: random.Random, size: int) -> bytes:
    top = 2 ** (8 * size)
    v = (
        rng.choice(
            [
                0,
                1,
                top - 1,
                top // 2,
                MAX_PAYLOAD,
                MAX_PAYLOAD + 1,
                MAX_REASON + 1,
                MAX_LAYERS,
                MAGIC,
                VERSION + 1,
                rng.randrange(top),
            ]
        )
        % top
    )
    return v.to_bytes(size, "big")


def mutate(rng: random.Random, kind: str, frames: list[bytes]) -> tuple[bytes, int]:
    """The stream and how many leading frames are intact (their bytes untouched)."""
    stream = b"".join(frames)
    starts = [0]
    for f in frames:
        starts.append(starts[-1] + len(f))
    if kind == "none":
        return stream, len(frames)
    if kind == "random":
        return rng.randbytes(rng.randrange(4 * HEADER_SIZE)), 0
    b = bytearray(stream)
    if kind == "flip":
        first = len(b)
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= rng.randrange(1, 256)
            first = min(first, i)
    elif kind == "field":
        k = rng.randrange(len(frames))
        name = rng.choice(list(FIELD_OFFSETS))
        at, size = FIELD_OFFSETS[name]
        b[starts[k] + at : starts[k] + at + size] = boundary(rng, size)
        first = starts[k]
    elif kind == "truncate":
        first = rng.randrange(len(b) + 1)
        del b[first:]
    elif kind == "trailing":
        first = len(b)
        b += rng.randbytes(rng.randrange(1, 2 * HEADER_SIZE))
    else:  # splice
        first = rng.randrange(len(b) + 1)
        b[first:first] = rng.randbytes(rng.randrange(1, 2 * HEADER_SIZE))
    intact = sum(1 for k in range(len(frames)) if starts[k + 1] <= first)
    return bytes(b), intact


def pieces(rng: random.Random, how: str, n: int) -> list[tuple[int, int]]:
    if how == "whole":
        return [(0, n)]
    if how == "bytes":
        return [(i, i + 1) for i in range(n)]
    cuts = sorted({0, n, *(rng.randrange(n + 1) for _ in range(rng.randrange(1, 30)))})
    return list(zip(cuts, cuts[1:]))


def run(d: FrameDecoder, stream: bytes, spans: list[tuple[int, int]], limit: int) -> tuple[list[Frame], str | None]:
    out: list[Frame] = []
    view = memoryview(stream)
    for a, b in spans:
        try:
            out += d.feed(view[a:b])
        except FrameError as e:
            out += e.frames
            assert d.dead
            with pytest.raises(FrameError):
                d.feed(b"\x00")
            return out, e.reason
        assert d.held <= limit
    return out, None


def summary(frames: list[Frame], keep_data: bool) -> list[tuple[int, int, bytes]]:
    return [
        (f.header.type, f.header.transfer_id, f.payload if keep_data or f.header.type != FrameType.DATA else b"")
        for f in frames
    ]


@settings(max_examples=1500, deadline=DEADLINE)
@given(st.integers(0, 2**64 - 1), st.sampled_from(MUTATIONS), st.sampled_from(FEEDS))
def test_decoders_survive_hostile_streams_and_agree(seed: int, mutation: str, feed: str) -> None:
    rng = random.Random(seed)
    n = 12 if feed == "bytes" else 120  # byte by byte is a feed call per byte: fewer frames
    batch = [valid_frame(rng) for _ in range(n)]
    stream, intact = mutate(rng, mutation, [f for f, _ in batch])
    spans = pieces(rng, feed, len(stream))
    kept, kept_err = run(FrameDecoder(), stream, spans, HEADER_SIZE + MAX_PAYLOAD)
    streamed, streamed_err = run(FrameDecoder(keep_data=False), stream, spans, HEADER_SIZE + MAX_REASON)
    counts["frames"] += n
    counts["examples"] += 1
    counts["bytes"] += len(stream)
    # Both modes see the same frames and fail at the same point for the same reason.
    assert [f.header for f in kept] == [f.header for f in streamed]
    assert summary(kept, False) == summary(streamed, False)
    assert kept_err == streamed_err
    expect = [e for _, e in batch]
    assert summary(kept, True)[:intact] == expect[:intact]
    for f in kept:  # whatever got through is a frame the codec would have produced
        h = f.header
        assert len(f.payload) == h.length
        if h.flags & 1:
            assert zlib.crc32(f.payload) == h.crc32
    if mutation == "none":
        assert kept_err is None and summary(kept, True) == expect
    if mutation == "truncate":
        assert kept_err is None and summary(kept, True) == expect[:intact]


@settings(max_examples=300, deadline=DEADLINE)
@given(st.binary(min_size=0, max_size=400), st.integers(1, 64))
def test_random_bytes_in_any_split_raise_only_frame_errors(raw: bytes, step: int) -> None:
    for keep in (True, False):
        d = FrameDecoder(keep_data=keep)
        try:
            for i in range(0, len(raw), step):
                d.feed(raw[i : i + step])
        except FrameError:
            assert d.dead
    counts["frames"] += max(1, len(raw) // HEADER_SIZE)
    counts["examples"] += 1
    counts["bytes"] += len(raw)


def hostile_headers(rng: random.Random) -> bytes:
    """A header with every field drawn from its boundary values: mostly bad, sometimes not."""
    fields = []
    for name, (_, size) in FIELD_OFFSETS.items():
        if name == "magic":
            fields.append(MAGIC if rng.random() < 0.9 else rng.randrange(2**32))
        elif name == "version":
            fields.append(VERSION if rng.random() < 0.9 else rng.randrange(256))
        elif name == "type":
            fields.append(rng.choice([1, 2, 3, 4, 0, 5, 255]))
        else:
            fields.append(int.from_bytes(boundary(rng, size), "big") if rng.random() < 0.3 else 0)
    magic, version, ftype, flags, tid, layer, reserved, length, offset, total, crc, pad = fields
    return HEADER.pack(magic, version, ftype, flags, tid, layer, reserved, length, offset, total, crc, pad)


@settings(max_examples=200, deadline=DEADLINE)
@given(st.integers(0, 2**64 - 1))
def test_reassembler_survives_hostile_connections_within_its_limits(seed: int) -> None:
    rng = random.Random(seed)
    rx = Reassembler(
        verify=rng.random() < 0.3,
        max_transfers=20,
        max_transfers_per_connection=5,
        max_results=10,
        max_tombstones=30,
        max_connections=6,
    )
    conns = [c for c in (rx.connection_made(f"p{i}") for i in range(8)) if c is not None]
    assert len(conns) == 6 and rx.connections_refused == 2
    now = 0.0
    for _ in range(40):
        conn = rng.choice(conns)
        parts = [
            valid_frame(rng)[0] if rng.random() < 0.8 else hostile_headers(rng) for _ in range(rng.randrange(1, 6))
        ]
        stream, _ = mutate(rng, rng.choice(MUTATIONS), parts)
        now += rng.random()
        for a, b in pieces(rng, rng.choice(["whole", "pieces"]), len(stream)):
            events = rx.data_received(conn, stream[a:b], now)
            for e in events:
                if isinstance(e, Send):
                    FrameDecoder().feed(e.data)  # what goes back is well formed
        if rng.random() < 0.1:
            rx.connection_lost(conn, now, rng.choice([None, "ConnectionResetError()"]))
            conns.remove(conn)
            new = rx.connection_made("again")
            assert new is not None
            conns.append(new)
        if rng.random() < 0.2:
            rx.sweep(now)
        assert rx.active <= 20 and all(len(rx.carried(c)) <= 5 for c in conns)
        assert rx.kept[0] <= 10 and rx.kept[1] <= 30
        counts["frames"] += len(parts)
    counts["examples"] += 1


@settings(max_examples=200, deadline=DEADLINE)
@given(st.integers(0, 2**64 - 1))
def test_send_path_survives_a_hostile_receiver(seed: int) -> None:
    rng = random.Random(seed)
    path = SendPath(chunk_bytes=100)
    conns = [path.connection_opened() for _ in range(3)]
    for tid in range(4):
        t = path.start(tid, 250, 1)
        path.send_layer(t, 0, 250)
    for _ in range(30):
        conn = rng.choice(conns)
        if path.alive(conn) and rng.random() < 0.5 and (chunk := path.take()) is not None:
            path.begin_write(conn, chunk, 0.0)
            path.chunk_written(conn)
        parts = [
            rng.choice(
                [
                    encode_ack(rng.randrange(2 * path.written_bytes(conn) + 2)),
                    encode_end(rng.randrange(5), 1, 250),
                    encode_abort(rng.randrange(5), "no"),
                    valid_frame(rng)[0],
                    hostile_headers(rng),
                ]
            )
            for _ in range(rng.randrange(1, 4))
        ]
        stream, _ = mutate(rng, rng.choice(MUTATIONS), parts)
        path.data_received(conn, stream, 1.0)
        if not path.alive(conn):
            conns.remove(conn)
            conns.append(path.connection_opened())
        counts["frames"] += len(parts)
    path.sweep(1e9)
    counts["examples"] += 1
