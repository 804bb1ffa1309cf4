"""Binary frame codec of the KV transfer layer: pure bytes in, frames out (no I/O).

Every frame is a fixed 48-byte big-endian header followed by `length` payload bytes:

    offset size field
         0    4 magic        0x4B565446 ("KVTF")
         4    1 version      1
         5    1 type         DATA=1, END=2, ABORT=3, ACK=4
         6    2 flags        FLAG_CHECKSUM: crc32 holds the payload's CRC-32
         8    8 transfer_id
        16    2 layer        DATA: layer of the payload; END: number of layers
        18    2 reserved     0
        20    4 length       payload bytes
        24    8 offset       DATA: byte offset of the payload within the transfer;
                             ACK: stream bytes acknowledged; else 0
        32    8 total        bytes of the whole transfer (ABORT, ACK: 0)
        40    4 crc32        CRC-32 of the payload when flagged, else 0
        44    4 pad          0

Sender to receiver: DATA carries KV bytes; END (no payload) says the sender has queued every
byte of the transfer; ABORT carries a UTF-8 reason. Receiver to sender, on the same
connection: ACK (no payload, transfer_id 0) says how many bytes of whole frames the receiver
has consumed from this connection so far (cumulative, so one ACK covers every frame before
it); END says the transfer is complete at the receiver; ABORT says the receiver failed it and
why. ACK is a new type in version 1: the header layout is unchanged.

Every field is bounds-checked as soon as the header arrives, so a hostile length is rejected
before any of its payload is buffered.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

MAGIC = 0x4B565446
VERSION = 1
HEADER = struct.Struct(">IBBHQHHIQQII")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 48

FLAG_CHECKSUM = 0x0001
KNOWN_FLAGS = FLAG_CHECKSUM

MAX_PAYLOAD = 16 * 1024 * 1024
MAX_TOTAL = 1 << 40
MAX_LAYERS = 4096
MAX_REASON = 1024


class FrameType(IntEnum):
    DATA = 1
    END = 2
    ABORT = 3
    ACK = 4


_TYPES = frozenset(int(t) for t in FrameType)


class FrameError(Exception):
    """A malformed frame. `transfer_id` is known when the header's layout was trusted (good magic
    and version); `frames` holds the good frames decoded in the same `feed` call before the bad
    one, so a caller can still account for them."""

    def __init__(self, reason: str, transfer_id: int | None = None, frames: list[Frame] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.transfer_id = transfer_id
        self.frames: list[Frame] = frames if frames is not None else []


@dataclass(frozen=True, slots=True)
class FrameHeader:
    type: int
    transfer_id: int
    layer: int = 0
    length: int = 0
    offset: int = 0
    total: int = 0
    flags: int = 0
    crc32: int = 0
    magic: int = MAGIC
    version: int = VERSION
    reserved: int = 0
    pad: int = 0


@dataclass(frozen=True, slots=True)
class Frame:
    header: FrameHeader
    payload: bytes


def encode_header(h: FrameHeader) -> bytes:
    return HEADER.pack(
        h.magic,
        h.version,
        h.type,
        h.flags,
        h.transfer_id,
        h.layer,
        h.reserved,
        h.length,
        h.offset,
        h.total,
        h.crc32,
        h.pad,
    )


def encode_data(
    transfer_id: int, layer: int, offset: int, total: int, payload: bytes | memoryview, checksum: bool
) -> tuple[bytes, memoryview]:
    """Header bytes and a view of the payload: the caller writes both without concatenating."""
    view = payload if isinstance(payload, memoryview) else memoryview(payload)
    n = view.nbytes
    if n > MAX_PAYLOAD:
        raise ValueError(f"payload of {n} bytes exceeds MAX_PAYLOAD {MAX_PAYLOAD}")
    if offset + n > total or total > MAX_TOTAL:
        raise ValueError(f"offset {offset} + length {n} outside total {total}")
    crc = zlib.crc32(view) if checksum else 0
    head = HEADER.pack(
        MAGIC,
        VERSION,
        FrameType.DATA,
        FLAG_CHECKSUM if checksum else 0,
        transfer_id,
        layer,
        0,
        n,
        offset,
        total,
        crc,
        0,
    )
    return head, view


def encode_end(transfer_id: int, layers: int, total: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, FrameType.END, 0, transfer_id, layers, 0, 0, 0, total, 0, 0)


def encode_abort(transfer_id: int, reason: str) -> bytes:
    """Header and reason in one buffer (aborts are rare and small); the reason is cut to
    MAX_REASON bytes on a character boundary so the receiver can always decode it."""
    raw = reason.encode("utf-8")
    if len(raw) > MAX_REASON:
        raw = raw[:MAX_REASON].decode("utf-8", "ignore").encode("utf-8")
    return HEADER.pack(MAGIC, VERSION, FrameType.ABORT, 0, transfer_id, 0, 0, len(raw), 0, 0, 0, 0) + raw


def encode_ack(consumed: int) -> bytes:
    """Receiver to sender: `consumed` bytes of whole frames taken from this connection so far."""
    return HEADER.pack(MAGIC, VERSION, FrameType.ACK, 0, 0, 0, 0, 0, consumed, 0, 0, 0)


# Every field of a valid ACK but its offset is fixed: one comparison each side of the offset
# validates it whole, which is how a sender reads its (many, small) ACKs cheaply.
_ACK_HEAD = encode_ack(0)[:24]
_ACK_TAIL = encode_ack(0)[32:]


def ack_at(data: bytes | bytearray | memoryview, pos: int = 0) -> int | None:
    """The offset of the valid ACK frame at `pos`, or None if there is none there (any other
    frame, a bad header, too few bytes)."""
    if len(data) - pos < HEADER_SIZE or data[pos : pos + 24] != _ACK_HEAD or data[pos + 32 : pos + 48] != _ACK_TAIL:
        return None
    return int.from_bytes(data[pos + 24 : pos + 32], "big")


def _check(fields: tuple[int, ...]) -> FrameHeader:
    """Validate an unpacked header; raise FrameError naming the first bad field."""
    magic, version, ftype, flags, tid, layer, reserved, length, offset, total, crc, pad = fields
    if magic != MAGIC:
        raise FrameError(f"bad magic 0x{magic:08x} (expected 0x{MAGIC:08x})")
    if version != VERSION:
        raise FrameError(f"unsupported version {version} (expected {VERSION})")
    # From here the layout is trusted, so errors can name the transfer they belong to.
    if ftype not in _TYPES:
        raise FrameError(f"unknown type {ftype}", tid)
    if flags & ~KNOWN_FLAGS:
        raise FrameError(f"unknown flags 0x{flags:04x}", tid)
    if reserved != 0:
        raise FrameError(f"nonzero reserved {reserved}", tid)
    if pad != 0:
        raise FrameError(f"nonzero pad {pad}", tid)
    if length > MAX_PAYLOAD:
        raise FrameError(f"length {length} exceeds MAX_PAYLOAD {MAX_PAYLOAD}", tid)
    if total > MAX_TOTAL:
        raise FrameError(f"total {total} exceeds MAX_TOTAL {MAX_TOTAL}", tid)
    if layer >= MAX_LAYERS:
        raise FrameError(f"layer {layer} exceeds maximum {MAX_LAYERS - 1}", tid)
    if not flags & FLAG_CHECKSUM and crc != 0:
        raise FrameError(f"crc32 0x{crc:08x} set without FLAG_CHECKSUM", tid)
    if ftype == FrameType.DATA:
        if offset + length > total:
            raise FrameError(f"offset {offset} + length {length} exceeds total {total}", tid)
    elif ftype == FrameType.ACK:
        if length != 0 or total != 0 or layer != 0 or tid != 0:
            raise FrameError(
                f"ACK must have no payload, total, layer or transfer (length {length}, total {total},"
                f" layer {layer}, transfer_id {tid})",
                tid,
            )
    elif offset != 0:
        raise FrameError(f"offset {offset} must be 0 in a {FrameType(ftype).name} frame", tid)
    if ftype == FrameType.END and length != 0:
        raise FrameError(f"length {length} must be 0 in an END frame", tid)
    if ftype == FrameType.ABORT and length > MAX_REASON:
        raise FrameError(f"length {length} of ABORT reason exceeds {MAX_REASON}", tid)
    return FrameHeader(ftype, tid, layer, length, offset, total, flags, crc, magic, version, reserved, pad)


def decode_header(data: bytes | bytearray | memoryview, pos: int = 0) -> FrameHeader:
    """Parse and validate one header at `pos` (needs HEADER_SIZE bytes)."""
    return _check(HEADER.unpack_from(data, pos))


class FrameDecoder:
    """Incremental decoder: feed any split of the byte stream, get whole frames back.

    With `keep_data` (the default) bytes live in one bytearray with a read position; consumed
    bytes are dropped once per `feed`, so a large payload arriving in small pieces costs O(n) in
    total, not O(n^2). Without it, DATA payloads are never buffered: their CRC (when flagged) is
    computed as they stream past and the frame comes back with an empty payload, so a partial
    frame holds at most a header (or an ABORT reason) whatever its announced length. KV bytes are
    dummies, so only a verifying receiver needs them.
    After a FrameError the decoder is dead: the stream has lost framing and cannot resync.
    """

    __slots__ = ("_buf", "_pos", "_header", "_error", "last_transfer_id", "_keep", "_left", "_crc", "_reason")

    def __init__(self, keep_data: bool = True) -> None:
        self._buf = bytearray()  # keep_data: the stream from _pos; else a partial header
        self._pos = 0
        self._header: FrameHeader | None = None  # validated header awaiting its payload
        self._error: FrameError | None = None
        self.last_transfer_id: int | None = None
        self._keep = keep_data
        self._left = 0  # without keep_data: payload bytes of _header still to come
        self._crc = 0
        self._reason = bytearray()  # without keep_data: the ABORT reason so far

    @property
    def buffered(self) -> int:
        """Bytes received of the partial frame not yet returned (held or, DATA payload without
        keep_data, already streamed past)."""
        if self._keep:
            return len(self._buf) - self._pos
        h = self._header
        return len(self._buf) if h is None else HEADER_SIZE + h.length - self._left

    @property
    def held(self) -> int:
        """Bytes of the partial frame held in memory."""
        if self._keep:
            return len(self._buf) - self._pos
        return len(self._buf) + len(self._reason)

    @property
    def pending_header(self) -> FrameHeader | None:
        """Header of the partial frame whose payload is still arriving, if any."""
        return self._header

    @property
    def dead(self) -> bool:
        return self._error is not None

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        if self._error is not None:
            raise FrameError(self._error.reason, self._error.transfer_id)
        frames: list[Frame] = []
        try:
            if self._keep:
                self._feed_keep(data, frames)
            else:
                self._feed_stream(data, frames)
        except FrameError as e:
            # None after bad magic/version: the would-be transfer id there is garbage.
            self.last_transfer_id = e.transfer_id
            self._error = e
            self._buf = bytearray()
            self._reason = bytearray()
            self._pos = 0
            self._header = None
            e.frames = frames
            raise
        return frames

    def _feed_keep(self, data: bytes | bytearray | memoryview, frames: list[Frame]) -> None:
        buf = self._buf
        buf += data
        pos = self._pos
        end = len(buf)
        header = self._header
        while True:
            if header is None:
                if end - pos < HEADER_SIZE:
                    break
                header = _check(HEADER.unpack_from(buf, pos))
                self.last_transfer_id = header.transfer_id
            stop = pos + HEADER_SIZE + header.length
            if stop > end:
                break
            payload = bytes(memoryview(buf)[pos + HEADER_SIZE : stop])
            if header.flags & FLAG_CHECKSUM:
                _check_crc(header, zlib.crc32(payload))
            frames.append(Frame(header, payload))
            pos = stop
            header = None
        self._header = header
        if pos:
            del buf[:pos]
            pos = 0
        self._pos = pos

    def _feed_stream(self, data: bytes | bytearray | memoryview, frames: list[Frame]) -> None:
        mv = data if isinstance(data, memoryview) else memoryview(data)
        n = len(mv)
        i = 0
        hbuf = self._buf
        header = self._header
        left = self._left
        while i < n:
            if header is None:
                if hbuf:
                    take = min(HEADER_SIZE - len(hbuf), n - i)
                    hbuf += mv[i : i + take]
                    i += take
                    if len(hbuf) < HEADER_SIZE:
                        break
                    header = _check(HEADER.unpack_from(hbuf))
                    hbuf.clear()
                elif n - i >= HEADER_SIZE:
                    header = _check(HEADER.unpack_from(mv, i))
                    i += HEADER_SIZE
                else:
                    hbuf += mv[i:]
                    break
                self.last_transfer_id = header.transfer_id
                left = header.length
                self._crc = 0
            take = min(left, n - i)
            if take:
                if header.type != FrameType.DATA:
                    self._reason += mv[i : i + take]
                elif header.flags & FLAG_CHECKSUM:
                    self._crc = zlib.crc32(mv[i : i + take], self._crc)
                i += take
                left -= take
            if left:
                break
            if header.type == FrameType.DATA:
                if header.flags & FLAG_CHECKSUM:
                    _check_crc(header, self._crc)
                frames.append(Frame(header, b""))
            else:
                payload = bytes(self._reason)
                self._reason.clear()
                if header.flags & FLAG_CHECKSUM:
                    _check_crc(header, zlib.crc32(payload))
                frames.append(Frame(header, payload))
            header = None
        self._header = header
        self._left = left


def _check_crc(header: FrameHeader, crc: int) -> None:
    if crc != header.crc32:
        raise FrameError(f"crc32 mismatch: header 0x{header.crc32:08x}, payload 0x{crc:08x}", header.transfer_id)


def _mix64(x: int) -> int:
    """splitmix64 finaliser: spreads transfer ids over the whole 64-bit space."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


_BIG_ENDIAN_U64 = np.dtype(">u8")


def payload_pattern(transfer_id: int, offset: int, length: int) -> bytes:
    """Deterministic test bytes: the 8-byte big-endian word at absolute word index k of a
    transfer is k * m + s (mod 2^64), with m (odd) and s derived from the transfer id. A chunk
    placed at the wrong offset or taken from another transfer differs in every word."""
    if length <= 0:
        return b""
    m = _mix64(transfer_id) | 1
    s = _mix64(transfer_id ^ 0x5A5A5A5A5A5A5A5A)
    first = offset >> 3
    last = (offset + length + 7) >> 3
    words = np.arange(first, last, dtype=np.uint64)
    words *= np.uint64(m)
    words += np.uint64(s)
    skip = offset & 7
    return words.astype(_BIG_ENDIAN_U64, copy=False).view(np.uint8)[skip : skip + length].tobytes()
