"""TUN devices for the userspace delay line: attach to a persistent TUN, read raw IPv4 headers.

The device itself is created (persistent, owned by its namespace) by the network plan with
pyroute2; the delay line only attaches to it. Attaching opens /dev/net/tun in the caller's
network namespace, so it must run inside the namespace that holds the device.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct

TUN_DEVICE = "/dev/net/tun"
TUNSETIFF = 0x400454CA
TUNSETPERSIST = 0x400454CB
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFNAMSIZ = 16
_IFREQ = struct.Struct("16sH22x")  # struct ifreq: name, ifr_flags, padding to 40 bytes


def _set_iff(fd: int, name: str) -> None:
    raw = name.encode()
    if not raw or len(raw) >= IFNAMSIZ:
        raise ValueError(f"interface name must be 1..{IFNAMSIZ - 1} bytes, got {name!r}")
    # IFF_NO_PI: packets are bare IP, no 4-byte protocol header. The flag is taken from this call
    # even when the device was created with packet info (pyroute2's default).
    fcntl.ioctl(fd, TUNSETIFF, _IFREQ.pack(raw, IFF_TUN | IFF_NO_PI))


def open_tun(name: str) -> int:
    """A non-blocking fd attached to the existing TUN device `name` (IFF_TUN | IFF_NO_PI).

    Raises OSError from the kernel (e.g. EINVAL when `name` is a TAP or another kind of device,
    EPERM without CAP_NET_ADMIN on a device owned by someone else, EBUSY when another process
    is attached already)."""
    # TUNSETIFF on a missing name would silently create a fresh, unrouted device.
    try:
        socket.if_nametoindex(name)
    except OSError:
        raise FileNotFoundError(errno.ENODEV, f"no device {name!r} in this network namespace") from None
    fd = os.open(TUN_DEVICE, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _set_iff(fd, name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def ipv4_dst(packet: bytes) -> bytes:
    """The 4 raw destination-address bytes of an IPv4 packet; b"" for anything else."""
    if len(packet) < 20 or packet[0] >> 4 != 4:
        return b""
    return bytes(packet[16:20])


def ipv4_src(packet: bytes) -> bytes:
    """The 4 raw source-address bytes of an IPv4 packet; b"" for anything else."""
    if len(packet) < 20 or packet[0] >> 4 != 4:
        return b""
    return bytes(packet[12:16])
