"""KV frame codec: round trips, arbitrary stream splits, every bound, dead decoder, and the
streaming mode that never buffers DATA payloads."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.core.kv.frames import (
    FLAG_CHECKSUM,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_PAYLOAD,
    MAX_REASON,
    MAX_TOTAL,
    Frame,
    FrameDecoder,
    FrameError,
    FrameHeader,
    FrameType,
    decode_header,
    encode_abort,
    encode_ack,
    encode_data,
    encode_end,
    encode_header,
    payload_pattern,
)

pytestmark = pytest.mark.pure

DATA, END, ABORT, ACK = FrameType.DATA, FrameType.END, FrameType.ABORT, FrameType.ACK


def data_frame(tid: int, layer: int, offset: int, total: int, payload: bytes, checksum: bool = False) -> bytes:
    head, view = encode_data(tid, layer, offset, total, payload, checksum)
    return head + bytes(view)


def raw_header(**kw: int) -> bytes:
    """A DATA header with every field overridable, bypassing the encoder's own checks."""
    f = dict(
        magic=MAGIC, version=1, type=1, flags=0, tid=9, layer=0, reserved=0, length=0, offset=0, total=0, crc=0, pad=0
    )
    f.update(kw)
    return HEADER.pack(
        f["magic"],
        f["version"],
        f["type"],
        f["flags"],
        f["tid"],
        f["layer"],
        f["reserved"],
        f["length"],
        f["offset"],
        f["total"],
        f["crc"],
        f["pad"],
    )


def sample_stream() -> tuple[bytes, list[tuple[int, int, bytes]]]:
    """Several frames of every type; returns the bytes and (type, transfer_id, payload) expected."""
    parts = [
        data_frame(1, 0, 0, 10, b"abcde"),
        data_frame(1, 3, 5, 10, b"fghij", checksum=True),
        encode_end(1, 4, 10),
        data_frame(2, 0, 0, 0, b""),
        encode_abort(2, "prefill died"),
        data_frame(3, 1, 100, 1000, payload_pattern(3, 100, 700), checksum=True),
        encode_end(3, 2, 1000),
        encode_ack(123456),
    ]
    expect = [
        (DATA, 1, b"abcde"),
        (DATA, 1, b"fghij"),
        (END, 1, b""),
        (DATA, 2, b""),
        (ABORT, 2, b"prefill died"),
        (DATA, 3, payload_pattern(3, 100, 700)),
        (END, 3, b""),
        (ACK, 0, b""),
    ]
    return b"".join(parts), expect


def summary(frames: list[Frame]) -> list[tuple[int, int, bytes]]:
    return [(f.header.type, f.header.transfer_id, f.payload) for f in frames]


def test_header_is_48_bytes_and_round_trips() -> None:
    assert HEADER_SIZE == 48
    h = FrameHeader(DATA, 2**64 - 1, layer=4095, length=7, offset=3, total=10, flags=FLAG_CHECKSUM, crc32=123)
    raw = encode_header(h)
    assert len(raw) == 48 and raw[:4] == b"KVTF"
    assert decode_header(raw) == h


def test_data_round_trip_with_and_without_checksum() -> None:
    payload = bytes(range(256)) * 3
    for checksum in (False, True):
        head, view = encode_data(77, 5, 1000, 5000, memoryview(payload), checksum)
        assert isinstance(view, memoryview) and view.obj is payload  # no copy of the payload
        (f,) = FrameDecoder().feed(head + bytes(view))
        h = f.header
        assert (h.type, h.transfer_id, h.layer, h.offset, h.total, h.length) == (DATA, 77, 5, 1000, 5000, 768)
        assert f.payload == payload
        assert h.flags == (FLAG_CHECKSUM if checksum else 0)
        assert h.crc32 == (zlib.crc32(payload) if checksum else 0)


def test_end_round_trip() -> None:
    (f,) = FrameDecoder().feed(encode_end(5, 61, 123456789))
    assert (f.header.type, f.header.transfer_id, f.header.layer, f.header.total, f.header.length) == (
        END,
        5,
        61,
        123456789,
        0,
    )
    assert f.payload == b""


def test_abort_round_trip_and_reason_truncated_on_char_boundary() -> None:
    (f,) = FrameDecoder().feed(encode_abort(6, "out of KV memory ✗"))
    assert f.header.type == ABORT and f.payload.decode() == "out of KV memory ✗"
    long = "é" * 1000  # 2000 bytes of UTF-8
    (f,) = FrameDecoder().feed(encode_abort(6, long))
    assert len(f.payload) <= MAX_REASON
    assert f.payload.decode() == "é" * (MAX_REASON // 2)


def test_ack_round_trip() -> None:
    (f,) = FrameDecoder().feed(encode_ack(2**63))
    h = f.header
    assert (h.type, h.transfer_id, h.offset, h.total, h.length, h.layer) == (ACK, 0, 2**63, 0, 0, 0)


def test_stream_fed_whole() -> None:
    stream, expect = sample_stream()
    assert summary(FrameDecoder().feed(stream)) == expect


def test_stream_fed_byte_by_byte() -> None:
    stream, expect = sample_stream()
    d = FrameDecoder()
    out: list[Frame] = []
    for i in range(len(stream)):
        out += d.feed(stream[i : i + 1])
    assert summary(out) == expect
    assert d.buffered == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2000), max_size=20))
def test_stream_fed_in_random_splits(cuts: list[int]) -> None:
    stream, expect = sample_stream()
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    d = FrameDecoder()
    out: list[Frame] = []
    for a, b in zip(points, points[1:]):
        out += d.feed(memoryview(stream)[a:b])
    assert summary(out) == expect


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2000), max_size=20))
def test_streaming_decoder_returns_the_same_frames_without_data_payloads(cuts: list[int]) -> None:
    stream, expect = sample_stream()
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    d = FrameDecoder(keep_data=False)
    out: list[Frame] = []
    for a, b in zip(points, points[1:]):
        out += d.feed(memoryview(stream)[a:b])
        assert d.held <= max(HEADER_SIZE, len("prefill died"))
    assert summary(out) == [(t, tid, b"" if t == DATA else p) for t, tid, p in expect]
    assert d.buffered == 0 and d.held == 0


def test_streaming_decoder_holds_a_header_at_most_whatever_the_announced_length() -> None:
    d = FrameDecoder(keep_data=False)
    head, _ = encode_data(1, 0, 0, MAX_PAYLOAD, b"", False)
    big = HEADER.pack(MAGIC, 1, DATA, 0, 1, 0, 0, MAX_PAYLOAD, 0, MAX_PAYLOAD, 0, 0)
    assert d.feed(big[:20]) == [] and (d.buffered, d.held) == (20, 20)
    assert d.feed(big[20:] + bytes(1 << 20)) == []
    assert d.buffered == HEADER_SIZE + (1 << 20) and d.held == 0
    assert d.pending_header is not None and d.pending_header.length == MAX_PAYLOAD
    (f,) = d.feed(bytes(MAX_PAYLOAD - (1 << 20)))
    assert f.header.length == MAX_PAYLOAD and f.payload == b"" and d.buffered == 0


def test_streaming_decoder_checks_crc_as_the_payload_streams() -> None:
    head, view = encode_data(11, 0, 0, 600, payload_pattern(11, 0, 600), checksum=True)
    frame = head + bytes(view)
    d = FrameDecoder(keep_data=False)
    for i in range(0, len(frame), 7):
        d.feed(frame[i : i + 7])
    assert d.buffered == 0 and not d.dead
    bad = bytearray(frame)
    bad[300] ^= 1
    d = FrameDecoder(keep_data=False)
    assert d.feed(bad[:599]) == []
    with pytest.raises(FrameError, match="crc32 mismatch"):
        d.feed(bad[599:])
    assert d.dead and d.last_transfer_id == 11


def test_trailing_partial_frame_is_kept() -> None:
    stream, expect = sample_stream()
    tail = data_frame(4, 0, 0, 8, b"12345678")
    d = FrameDecoder()
    assert summary(d.feed(stream + tail[:50])) == expect
    assert d.buffered == 50
    assert d.pending_header is not None and d.pending_header.transfer_id == 4
    (f,) = d.feed(bytearray(tail[50:]))
    assert f.payload == b"12345678" and d.buffered == 0 and d.pending_header is None
    # A trailing partial header is kept too.
    assert d.feed(tail[:10]) == [] and d.buffered == 10 and d.pending_header is None


BAD_HEADERS = [
    ("magic", raw_header(magic=0xDEADBEEF), None),
    ("version", raw_header(version=2), None),
    ("type", raw_header(type=9), 9),
    ("flags", raw_header(flags=0x8000), 9),
    ("reserved", raw_header(reserved=1), 9),
    ("pad", raw_header(pad=1), 9),
    ("length", raw_header(length=MAX_PAYLOAD + 1, total=MAX_PAYLOAD + 1), 9),
    ("total", raw_header(total=MAX_TOTAL + 1), 9),
    ("layer", raw_header(layer=4096), 9),
    ("offset", raw_header(offset=10, length=5, total=12), 9),
    ("crc32", raw_header(crc=5), 9),  # crc without the flag
    ("length", raw_header(type=END, length=1, total=1), 9),
    ("offset", raw_header(type=END, offset=1, total=1), 9),
    ("length", raw_header(type=ABORT, length=MAX_REASON + 1), 9),
    ("ACK.*length 1,", raw_header(type=ACK, tid=0, length=1), 0),
    ("ACK.*total 1,", raw_header(type=ACK, tid=0, total=1), 0),
    ("ACK.*layer 1,", raw_header(type=ACK, tid=0, layer=1), 0),
    ("ACK.*transfer_id 9", raw_header(type=ACK), 9),  # ACKs are per connection
]


@pytest.mark.parametrize("keep", [True, False], ids=["keep", "stream"])
@pytest.mark.parametrize(
    ("field", "raw", "tid"), BAD_HEADERS, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(BAD_HEADERS)]
)
def test_bound_violation_names_field(field: str, raw: bytes, tid: int | None, keep: bool) -> None:
    d = FrameDecoder(keep_data=keep)
    with pytest.raises(FrameError, match=field) as exc:
        d.feed(raw)  # header alone: bounds are checked before any payload arrives
    assert exc.value.transfer_id == tid
    assert d.last_transfer_id == tid


def test_crc_mismatch() -> None:
    head, view = encode_data(11, 0, 0, 4, b"abcd", checksum=True)
    d = FrameDecoder()
    with pytest.raises(FrameError, match="crc32 mismatch"):
        d.feed(head + b"abce")
    assert d.last_transfer_id == 11


def test_error_keeps_frames_decoded_before_it_and_decoder_stays_dead() -> None:
    good = data_frame(1, 0, 0, 3, b"xyz")
    d = FrameDecoder()
    with pytest.raises(FrameError, match="magic") as exc:
        d.feed(good + b"\x00" * HEADER_SIZE)
    assert summary(exc.value.frames) == [(DATA, 1, b"xyz")]
    assert d.last_transfer_id is None and d.dead
    for _ in range(2):
        with pytest.raises(FrameError, match="bad magic") as again:
            d.feed(good)
        assert again.value.reason == exc.value.reason and again.value.frames == []


def test_encoder_rejects_out_of_bounds() -> None:
    with pytest.raises(ValueError):
        encode_data(1, 0, 8, 10, b"abc", False)


def test_payload_pattern_is_consistent_and_detects_misplacement() -> None:
    whole = payload_pattern(42, 0, 4096)
    assert payload_pattern(42, 0, 4096) == whole
    for off, n in [(0, 1), (3, 5), (7, 9), (8, 8), (1000, 3000), (4095, 1)]:
        assert payload_pattern(42, off, n) == whole[off : off + n]
    assert payload_pattern(42, 5, 0) == b""
    assert payload_pattern(43, 0, 4096) != whole  # another transfer
    # The same chunk shifted by whole words, or half a word, never matches.
    assert payload_pattern(42, 1024, 512) != whole[0:512]
    assert payload_pattern(42, 4, 512) != whole[0:512]
    assert len(set(whole[i : i + 8] for i in range(0, 4096, 8))) == 512  # no repeating words


def test_decoder_is_linear_on_large_payloads() -> None:
    """Many frames fed in pieces smaller than a frame decode exactly (the benchmark is in the
    report; here only correctness at scale)."""
    payload = bytes(262144)
    n = 16
    stream = b"".join(data_frame(1, 0, i * len(payload), n * len(payload), payload) for i in range(n))
    d = FrameDecoder()
    got = 0
    for i in range(0, len(stream), 65536):
        for f in d.feed(stream[i : i + 65536]):
            assert f.header.offset == got
            got += len(f.payload)
    assert got == n * len(payload) and d.buffered == 0
