"""Which shaping this kernel supports, probed in a throwaway namespace with the very operations
the plans use: netem under an HTB class, HTB with a bfifo leaf, a persistent TUN.

netem missing shows up as ENOENT ("Specified qdisc kind is unknown"): a clean availability test.
"""

from __future__ import annotations

import errno
import os
from dataclasses import asdict, dataclass

from testbed.net import owners
from testbed.net.executor import Executor, NetError
from testbed.net.plan import (
    HTB_ROOT,
    AddNetns,
    AddTun,
    AddVeth,
    BfifoLeaf,
    HtbClass,
    HtbRoot,
    LinkUp,
    NetemLeaf,
    Operation,
)
from testbed.net.teardown import remove_namespaces
from testbed.net.topology import Method


class ShapingUnavailable(NetError):
    """The requested shaping method cannot run on this kernel."""


@dataclass(frozen=True)
class ShapingCaps:
    netem: bool
    htb: bool
    tun: bool
    detail: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _try(ex: Executor, ops: list[Operation], what: str, notes: list[str]) -> bool:
    try:
        ex.apply(ops)
    except NetError as e:
        absent = " (absent)" if e.errno == errno.ENOENT else ""
        notes.append(f"{what}: no{absent}: {e}")
        return False
    notes.append(f"{what}: yes")
    return True


def _open_tun(notes: list[str]) -> bool:
    try:
        os.close(os.open("/dev/net/tun", os.O_RDWR))
        return True
    except OSError as e:
        notes.append(f"tun: no: /dev/net/tun: {e.strerror} (errno {e.errno})")
        return False


def probe_shaping() -> ShapingCaps:
    """Probe in `ptb-probe-<pid>`; the namespace is always removed again."""
    ns = f"ptb-probe-{os.getpid()}"
    notes: list[str] = []
    remove_namespaces([ns])  # a leftover from a crashed probe of a process that had this pid
    owners.claim(ns, "probe", "")
    try:
        with Executor() as ex:
            try:
                ex.apply([AddNetns(ns), AddVeth(ns, "p0", ns, "p1"), LinkUp(ns, "p0"), LinkUp(ns, "p1")])
            except NetError as e:
                return ShapingCaps(False, False, False, f"cannot create a probe namespace: {e}")
            cls = HTB_ROOT | 0x10
            htb = _try(
                ex,
                [
                    HtbRoot(ns, "p0"),
                    HtbClass(ns, "p0", cls, 100_000_000, 200_000, 65536),
                    BfifoLeaf(ns, "p0", cls, 1 << 20),
                ],
                "htb",
                notes,
            )
            netem = htb and _try(
                ex,
                [
                    HtbRoot(ns, "p1"),
                    HtbClass(ns, "p1", cls, 100_000_000, 200_000, 65536),
                    NetemLeaf(ns, "p1", cls, 0.001, 0.0, 0.0, 0.0, 1000),
                ],
                "netem",
                notes,
            )
            if not htb:
                notes.append("netem: not probed (needs htb for the rate)")
            tun = _open_tun(notes) and _try(ex, [AddTun(ns, "tun0"), LinkUp(ns, "tun0")], "tun", notes)
    finally:
        remove_namespaces([ns])
        owners.release(ns)
    return ShapingCaps(netem=netem, htb=htb, tun=tun, detail="; ".join(notes))


def choose_method(caps: ShapingCaps, want: str = "auto") -> Method:
    """ "auto": netem when the kernel has it, else HTB + the userspace delay line ("fallback")."""
    fallback_ok = caps.htb and caps.tun
    if want == "none":
        return "none"
    if want == "netem":
        if not caps.netem:
            raise ShapingUnavailable(
                f"shaping method 'netem' requested but this kernel lacks it; "
                f"use 'fallback' (HTB + userspace delay line) or 'auto' [{caps.detail}]"
            )
        return "netem"
    if want == "fallback":
        if not fallback_ok:
            raise ShapingUnavailable(f"shaping method 'fallback' needs HTB and TUN [{caps.detail}]")
        return "fallback"
    if want == "auto":
        if caps.netem:
            return "netem"
        if fallback_ok:
            return "fallback"
        raise ShapingUnavailable(f"no shaping method available on this kernel [{caps.detail}]")
    raise ValueError(f"shaping method {want!r}: one of auto, netem, fallback, none")
