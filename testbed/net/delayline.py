"""Userspace delay line: delay, jitter and loss on a TUN device, for kernels without sch_netem.

Runs inside the WAN router namespace (policy routing sends forwarded traffic out of the TUN):

    python -m testbed.net.delayline --tun tun0 --config CONFIG.json \
        [--control SOCKET_PATH] [--stats STATS.jsonl] [--stats-interval 0.1]

Every packet the kernel routes into the TUN is read, given a release time by the
`DelayLineModel` of its direction (chosen by IPv4 destination subnet, first match in config
order; anything else passes straight through) and written back into the TUN at that time, where
the kernel forwards it on. Rate limiting stays in the kernel (HTB on the egress veth): this
process only delays and drops.

One thread, one epoll: per-packet work is a read, a subnet match, one model call and a write,
with no allocation beyond the packet itself. Release times are monotone per direction, so each
direction's queue is a pair of deques and the next wake-up is the earliest head.

Control: a UNIX datagram socket on a filesystem path (abstract sockets are per network
namespace; a path is reachable from every namespace sharing the filesystem). It is bound last
at start-up, so its appearance means the delay line is ready. Messages are JSON:
    {"op": "set", "direction": NAME | "*", "delay_s"?, "jitter_s"?, "loss"?, "loss_correlation"?}
    {"op": "stats"}
Replies go to the sender's bound address, if any. Changes apply to packets admitted from then on.

Stats: JSONL time-series lines (testbed/metrics/series_format.py), one per metric and
direction every interval: cumulative counters and the current queue.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import math
import os
import select
import shutil
import signal
import socket
import stat
import struct
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import FrameType
from typing import TextIO

from testbed.core.json_types import JSONObject, JSONValue
from testbed.core.schema.linkprofile import LinkParams
from testbed.metrics.series_format import Sample, encode_line
from testbed.net.delayline_model import DelayLineModel
from testbed.net.tun import open_tun

log = logging.getLogger("testbed.delayline")

READ_SIZE = 65536
# Packets read per wake-up before due packets are written: a flood must not starve releases.
DRAIN_BATCH = 64
# Packets due this soon are released now: waiting for less than the kernel's default timer slack
# (50 us) would only add a wake-up.
EARLY_S = 50e-6
# Bound on the learnt early wake-up (and so on the final spin before a release).
MAX_WAKE_EARLY = 300e-6
# A packet written more than this after its due time counts as late (the host's doing).
LATE_S = 1e-3
UNMATCHED = "unmatched"
SET_FIELDS = ("delay_s", "jitter_s", "loss", "loss_correlation")
_DST = struct.Struct("!I")


class ConfigError(ValueError):
    """An invalid delay-line configuration, naming the field at fault."""


@dataclass(frozen=True)
class DirectionSpec:
    """One direction of the delay line's CONFIG.json: which packets, and how they are treated."""

    name: str
    dst_subnet: str
    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0
    loss_correlation: float = 0.0
    seed: int = 0

    @classmethod
    def from_link(cls, name: str, dst_subnet: str, link: LinkParams, seed: int = 0) -> DirectionSpec:
        """The delay-line part of a shaped link direction (its rate and queue live in the kernel)."""
        return cls(name, dst_subnet, link.delay_s, link.jitter_s, link.loss, link.loss_correlation, seed)

    @classmethod
    def from_json(cls, obj: object, where: str = "direction") -> DirectionSpec:
        if not isinstance(obj, dict):
            raise ConfigError(f"{where}: expected an object, got {type(obj).__name__}")
        known = {f.name for f in fields(cls)}
        extra = sorted(set(obj) - known)
        if extra:
            raise ConfigError(f"{where}: unknown field(s) {extra} (known: {sorted(known)})")
        for key in ("name", "dst_subnet"):
            if not isinstance(obj.get(key), str) or not obj[key]:
                raise ConfigError(f"{where}.{key}: required, a non-empty string")
        for key in SET_FIELDS:
            if key in obj and not _is_number(obj[key]):
                raise ConfigError(f"{where}.{key}: expected a number, got {obj[key]!r}")
        if "seed" in obj and (not isinstance(obj["seed"], int) or isinstance(obj["seed"], bool)):
            raise ConfigError(f"{where}.seed: expected an integer, got {obj['seed']!r}")
        spec = cls(**obj)
        try:
            ipaddress.IPv4Network(spec.dst_subnet, strict=False)
            spec.model()
        except ValueError as e:
            raise ConfigError(f"{where} {spec.name!r}: {e}") from None
        return spec

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    def model(self) -> DelayLineModel:
        return DelayLineModel(self.delay_s, self.jitter_s, self.loss, self.loss_correlation, self.seed)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def parse_config(obj: object) -> list[DirectionSpec]:
    if not isinstance(obj, dict) or not isinstance(obj.get("directions"), list):
        raise ConfigError('config: expected {"directions": [...]}')
    specs = [DirectionSpec.from_json(d, f"directions[{i}]") for i, d in enumerate(obj["directions"])]
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1} | ({UNMATCHED} & set(names)))
    if dup:
        raise ConfigError(f"config: direction names must be unique and not {UNMATCHED!r}: {dup}")
    return specs


def load_config(path: Path | str) -> list[DirectionSpec]:
    try:
        obj = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not JSON: {e}") from None
    try:
        return parse_config(obj)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def write_config(path: Path | str, directions: Sequence[DirectionSpec]) -> None:
    Path(path).write_text(json.dumps({"directions": [d.to_json() for d in directions]}, indent=2) + "\n")


class _Direction:
    """A direction's model and queue. Two parallel deques, so queueing allocates no tuple."""

    __slots__ = (
        "name",
        "net",
        "mask",
        "model",
        "rel",
        "pkts",
        "queue_bytes",
        "packets_out",
        "bytes_out",
        "write_errors",
        "late_s",
        "late_packets",
    )

    def __init__(self, name: str, subnet: str | None, model: DelayLineModel) -> None:
        self.name = name
        if subnet is None:
            self.net, self.mask = 0, 0
        else:
            n = ipaddress.IPv4Network(subnet, strict=False)
            self.net, self.mask = int(n.network_address), int(n.netmask)
        self.model = model
        self.rel: deque[float] = deque()
        self.pkts: deque[bytes] = deque()
        self.queue_bytes = 0
        self.packets_out = 0
        self.bytes_out = 0
        self.write_errors = 0  # packets the kernel refused (device down, malformed): dropped
        # How far behind their due times packets went out (a loaded host wakes the loop late):
        # the lateness summed, and the packets more than LATE_S late. What is late is the host's,
        # not the model's, and a measurement over the line can tell the two apart.
        self.late_s = 0.0
        self.late_packets = 0

    def counters(self) -> dict[str, float]:
        m = self.model
        return {
            "packets_in": m.packets_in,
            "bytes_in": m.bytes_in,
            "packets_dropped": m.packets_dropped,
            "bytes_dropped": m.bytes_dropped,
            "packets_out": self.packets_out,
            "bytes_out": self.bytes_out,
            "queue_packets": len(self.rel),
            "queue_bytes": self.queue_bytes,
            "write_errors": self.write_errors,
            "late_s": self.late_s,
            "late_packets": self.late_packets,
        }


class DelayLine:
    """The delay-line loop on an attached TUN fd (which it owns and closes)."""

    def __init__(
        self,
        tun_fd: int,
        directions: Sequence[DirectionSpec],
        control_path: Path | str | None = None,
        stats_path: Path | str | None = None,
        stats_interval: float = 0.1,
    ) -> None:
        # Owns tun_fd from here on: any failure below closes it with everything else.
        self._fd = tun_fd
        self._stop_r = self._stop_w = -1
        try:
            self._ep = select.epoll()
        except BaseException:
            os.close(tun_fd)
            raise
        self._ctl: socket.socket | None = None
        self._ctl_path = None if control_path is None else Path(control_path)
        self._stats_fh: TextIO | None = None
        self._stats_interval = stats_interval
        self._stopping = False
        self._blocked = False
        self.write_blocked = 0  # writes that would have blocked: the packet stayed queued
        self._wake_late = 0.0  # running estimate of how late select() wakes up
        try:
            if stats_interval <= 0:
                raise ValueError(f"stats_interval must be > 0, got {stats_interval}")
            self._dirs = [_Direction(d.name, d.dst_subnet, d.model()) for d in directions]
            self._unmatched = _Direction(UNMATCHED, None, DelayLineModel(0.0))
            self._all = [*self._dirs, self._unmatched]
            self._by_name = {d.name: d for d in self._dirs}
            self._stop_r, self._stop_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self._ep.register(self._fd, select.EPOLLIN)
            self._ep.register(self._stop_r, select.EPOLLIN)
            if stats_path is not None:
                Path(stats_path).parent.mkdir(parents=True, exist_ok=True)
                self._stats_fh = open(stats_path, "a", encoding="utf-8")
            if self._ctl_path is not None:
                self._ctl = _bind_control(self._ctl_path)  # last: the socket file means "ready"
                self._ep.register(self._ctl.fileno(), select.EPOLLIN)
        except BaseException:
            self.close()
            raise

    # -- lifecycle -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the loop to exit; safe from a signal handler or another thread."""
        self._stopping = True
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")

    def close(self) -> None:
        """Write the final stats, close everything and remove the control socket file."""
        if self._stats_fh is not None:
            with contextlib.suppress(OSError, ValueError):
                self._write_stats()
            self._stats_fh.close()
            self._stats_fh = None
        if self._ctl is not None:
            self._ctl.close()
            self._ctl = None
            if self._ctl_path is not None:
                with contextlib.suppress(FileNotFoundError):
                    self._ctl_path.unlink()
        for fd in (self._fd, self._stop_r, self._stop_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._stop_r = self._stop_w = -1
        self._ep.close()  # idempotent

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        mono = time.monotonic
        tun, ctl = self._fd, (self._ctl.fileno() if self._ctl is not None else -1)
        next_stats = mono() + self._stats_interval if self._stats_fh is not None else math.inf
        now = mono()
        while not self._stopping:
            for fd, ev in self._wait(self._timeout(now, next_stats)):
                if fd == tun:
                    if ev & select.EPOLLOUT:
                        self._set_blocked(False)
                    if ev & select.EPOLLIN:
                        self._drain(mono())
                elif fd == ctl:
                    self._on_control()
            now = mono()
            if not self._blocked:
                self._release(now)
            if now >= next_stats:
                self._write_stats()
                # Keep the grid; after a stall, skip missed samples instead of bursting them.
                next_stats = max(next_stats + self._stats_interval, now)

    def _timeout(self, now: float, next_stats: float) -> float | None:
        t = next_stats
        if not self._blocked:  # while blocked, EPOLLOUT (not the clock) resumes writing
            for d in self._all:
                if d.rel and d.rel[0] < t:
                    t = d.rel[0]
        if t == math.inf:
            return None
        return max(t - now, 0.0)

    def _wait(self, timeout: float | None) -> list[tuple[int, int]]:
        if timeout is None:
            return self._ep.poll()
        # Timers wake late (timer slack plus this VM's wake-up latency, ~80 us measured): aim
        # that much early, learnt from past wakes; what is left is spun off by the loop.
        early = timeout - self._wake_late
        if early >= 1e-3:
            # epoll counts whole milliseconds and CPython rounds up, which would make every
            # release up to 1 ms late: sleep the whole milliseconds, then finish with select().
            return self._ep.poll(math.floor(early * 1e3) * 1e-3 - 1e-7)
        if early <= 0.0:
            return self._ep.poll(0)
        # select() takes microseconds; with three descriptors it costs no more than epoll.
        rfds = [self._fd, self._stop_r] + ([self._ctl.fileno()] if self._ctl is not None else [])
        t0 = time.monotonic()
        r, w, _ = select.select(rfds, [self._fd] if self._blocked else [], [], early)
        if not r and not w:
            late = time.monotonic() - t0 - early
            self._wake_late = min(max(self._wake_late + 0.1 * (late - self._wake_late), 0.0), MAX_WAKE_EARLY)
        return [(fd, select.EPOLLIN) for fd in r] + [(fd, select.EPOLLOUT) for fd in w]

    def _drain(self, now: float) -> None:
        read, fd, unpack = os.read, self._fd, _DST.unpack_from
        dirs, unmatched = self._dirs, self._unmatched
        for _ in range(DRAIN_BATCH):  # level-triggered: the rest is read on the next wake-up
            try:
                pkt = read(fd, READ_SIZE)
            except BlockingIOError:
                return
            n = len(pkt)
            d = unmatched
            if n >= 20 and pkt[0] >> 4 == 4:
                dst = unpack(pkt, 16)[0]
                for cand in dirs:
                    if dst & cand.mask == cand.net:
                        d = cand
                        break
            release = d.model.admit(now, n)
            if release is not None:
                d.rel.append(release)
                d.pkts.append(pkt)
                d.queue_bytes += n

    def _release(self, now: float) -> None:
        write, fd = os.write, self._fd
        limit = now + EARLY_S
        for d in self._all:
            rel, pkts = d.rel, d.pkts
            while rel and rel[0] <= limit:
                pkt = pkts[0]
                try:
                    write(fd, pkt)
                except BlockingIOError:
                    self.write_blocked += 1
                    self._set_blocked(True)
                    return
                except OSError as e:
                    if d.write_errors == 0:
                        log.warning(
                            "writing to the TUN failed (%s); such packets are dropped and counted as write_errors", e
                        )
                    d.write_errors += 1
                else:
                    d.packets_out += 1
                    d.bytes_out += len(pkt)
                    late = now - rel[0]
                    if late > 0.0:
                        d.late_s += late
                        if late > LATE_S:
                            d.late_packets += 1
                rel.popleft()
                pkts.popleft()
                d.queue_bytes -= len(pkt)

    def _set_blocked(self, blocked: bool) -> None:
        if blocked != self._blocked:
            self._blocked = blocked
            self._ep.modify(self._fd, select.EPOLLIN | (select.EPOLLOUT if blocked else 0))

    # -- control and stats ---------------------------------------------------------------------

    def _on_control(self) -> None:
        assert self._ctl is not None
        while True:
            try:
                data, addr = self._ctl.recvfrom(65536)
            except BlockingIOError:
                return
            try:
                reply = self.handle(json.loads(data))
            except (ValueError, TypeError) as e:
                reply = {"ok": False, "error": str(e)}
            if addr:
                try:
                    self._ctl.sendto(json.dumps(reply).encode(), addr)
                except OSError as e:  # the client gave up and removed its socket
                    log.warning("control reply to %r failed: %s", addr, e)

    def handle(self, msg: object) -> dict[str, object]:
        """Apply one control message; the reply to send back."""
        if not isinstance(msg, dict):
            raise ValueError("a control message is a JSON object")
        op = msg.get("op")
        if op == "stats":
            return self.stats()
        if op != "set":
            raise ValueError(f"unknown op {op!r} (known: 'set', 'stats')")
        extra = sorted(set(msg) - {"op", "direction", *SET_FIELDS})
        if extra:
            raise ValueError(f"set: unknown field(s) {extra}")
        name = msg.get("direction")
        if name == "*":
            targets = self._dirs
        elif isinstance(name, str) and name in self._by_name:
            targets = [self._by_name[name]]
        else:
            raise ValueError(f"set: unknown direction {name!r} (known: {sorted(self._by_name)} or '*')")
        params: dict[str, float] = {}
        for key in SET_FIELDS:
            if key in msg:
                if not _is_number(msg[key]):
                    raise ValueError(f"set: {key} must be a number, got {msg[key]!r}")
                params[key] = float(msg[key])
        # update() checks each field on its own before changing anything, so a value that fails
        # fails on the first target: no direction is left half-updated.
        for d in targets:
            d.model.update(**params)
        log.info("set %s: %s", name, params)
        return {"ok": True}

    def stats(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for d in self._all:
            m = d.model
            out[d.name] = {
                **d.counters(),
                "delay_s": m.delay_s,
                "jitter_s": m.jitter_s,
                "loss": m.loss,
                "loss_correlation": m.loss_correlation,
            }
        return {
            "ok": True,
            "ts": time.time(),
            "write_blocked": self.write_blocked,
            "cpu_wait_s": cpu_wait_s(),
            "directions": out,
        }

    def _write_stats(self) -> None:
        if self._stats_fh is None:
            return
        ts = time.time()
        lines = [
            encode_line(ts, "delayline", Sample(metric, value, {"direction": d.name}))
            for d in self._all
            for metric, value in d.counters().items()
        ]
        self._stats_fh.write("\n".join(lines) + "\n")
        self._stats_fh.flush()


def cpu_wait_s() -> float:
    """Seconds this thread has been runnable but waiting for a CPU (the scheduler's run_delay).
    A packet that reaches the TUN while the line waits is read, and so released, that much late,
    and no write's lateness shows it. 0.0 where the kernel keeps no such account."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _bind_control(path: Path) -> socket.socket:
    if len(os.fsencode(path)) >= 108:
        raise ValueError(f"control socket path too long for AF_UNIX (max 107 bytes): {path}")
    with contextlib.suppress(FileNotFoundError):
        # A socket left by a killed run would make bind() fail; anything else is not ours to remove.
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(os.fspath(path))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


# -- control client ----------------------------------------------------------------------------


@contextlib.contextmanager
def _client_socket() -> Iterator[socket.socket]:
    # Bound to a filesystem path so the reply can come back from another network namespace.
    tmp = tempfile.mkdtemp(prefix="dlctl-")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(os.path.join(tmp, "s"))
        yield sock
    finally:
        sock.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _decode_reply(data: bytes) -> JSONObject:
    reply = json.loads(data)
    if not isinstance(reply, dict):
        raise ValueError(f"malformed delay-line reply: {data[:200]!r}")
    return reply


def control(path: Path | str, msg: Mapping[str, object], timeout: float = 2.0) -> JSONObject:
    """Send one control message and return the reply (raises OSError/TimeoutError on failure;
    a rejected message comes back as {"ok": false, "error": ...})."""
    with _client_socket() as sock:
        sock.settimeout(timeout)
        sock.sendto(json.dumps(msg).encode(), os.fspath(path))
        return _decode_reply(sock.recv(65536))


@dataclass(frozen=True)
class Lateness:
    """How late a running delay line has written packets so far, over all its directions."""

    late_s: float  # lateness summed
    packets: int  # packets written
    late_packets: int  # of them, more than LATE_S late
    cpu_wait_s: float = 0.0  # the line's time runnable but off a CPU (`cpu_wait_s()`)

    def __sub__(self, before: Lateness) -> Lateness:
        return Lateness(
            self.late_s - before.late_s,
            self.packets - before.packets,
            self.late_packets - before.late_packets,
            self.cpu_wait_s - before.cpu_wait_s,
        )


def lateness(path: Path | str) -> Lateness:
    """The lateness counters of the delay line behind control socket `path`."""
    reply = control(path, {"op": "stats"})
    dirs = reply.get("directions")
    if not isinstance(dirs, dict):
        raise ValueError(f"malformed delay-line stats reply: directions {dirs!r}")
    return Lateness(
        sum(_stat(d, "late_s") for d in dirs.values()),
        sum(int(_stat(d, "packets_out")) for d in dirs.values()),
        sum(int(_stat(d, "late_packets")) for d in dirs.values()),
        _stat(reply, "cpu_wait_s"),
    )


def _stat(obj: JSONValue, key: str) -> float:
    v = obj.get(key) if isinstance(obj, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"malformed delay-line stats reply: {key} {v!r}")
    return v


async def send_control(path: Path | str, msg: Mapping[str, object], timeout: float = 2.0) -> JSONObject:
    """`control` for asyncio code."""
    loop = asyncio.get_running_loop()
    with _client_socket() as sock:
        sock.setblocking(False)
        await asyncio.wait_for(loop.sock_sendto(sock, json.dumps(msg).encode(), os.fspath(path)), timeout)
        return _decode_reply(await asyncio.wait_for(loop.sock_recv(sock, 65536), timeout))


# -- entry point -------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m testbed.net.delayline",
        description="Userspace delay line (delay, jitter, loss) on a TUN device.",
    )
    ap.add_argument("--tun", required=True, help="existing persistent TUN device in this namespace")
    ap.add_argument("--config", required=True, type=Path, help='JSON: {"directions": [...]}')
    ap.add_argument("--control", type=Path, help="UNIX datagram control socket path to create")
    ap.add_argument("--stats", type=Path, help="JSONL time-series file to append to")
    ap.add_argument("--stats-interval", type=float, default=0.1, help="seconds between stats samples")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s delayline %(levelname)s %(message)s")

    line: DelayLine | None = None
    stop_requested = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop_requested
        stop_requested = True
        if line is not None:
            line.stop()

    # Installed before the control socket exists, so a signal at any point still cleans up.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        directions = load_config(args.config)
        fd = open_tun(args.tun)
    except (OSError, ValueError) as e:
        log.error("%s", e)
        return 1
    try:
        line = DelayLine(fd, directions, args.control, args.stats, args.stats_interval)
    except (OSError, ValueError) as e:  # DelayLine closed the fd
        log.error("%s", e)
        return 1
    log.info(
        "on %s: %s",
        args.tun,
        "; ".join(
            f"{d.name} dst {d.dst_subnet} delay {d.delay_s * 1e3:g} ms jitter {d.jitter_s * 1e3:g} ms "
            f"loss {d.loss:g} corr {d.loss_correlation:g}"
            for d in directions
        )
        or "no directions",
    )
    try:
        if stop_requested:
            line.stop()
        line.run()
    except OSError as e:  # e.g. the TUN device was deleted under us
        log.error("stopped: %s", e)
        return 1
    finally:
        line.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
