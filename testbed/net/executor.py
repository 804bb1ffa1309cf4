"""Apply plan operations to the kernel with pyroute2 (no `ip`/`tc` subprocesses).

One cached netlink handle per namespace, one small method per operation type, dispatched by a
table keyed by the operation's exact type. Any failure is raised as `NetError` naming the
operation and the kernel's error, e.g.
`ptb3fa2-wan: tc qdisc add dev dc1 ... netem ...: Specified qdisc kind is unknown. (errno 2)`.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import ipaddress
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

from pyroute2 import IPRoute, netns  # type: ignore[import-untyped]
from pyroute2 import config as _pyroute2_config
from pyroute2.netlink.exceptions import NetlinkError  # type: ignore[import-untyped]
from pyroute2.netlink.rtnl.tcmsg import plugins as _tc_plugins  # type: ignore[import-untyped]
from pyroute2.netlink.rtnl.tcmsg import sched_pfifo

from testbed.net import netem_codec, nsthread
from testbed.net.plan import (
    HTB_ROOT,
    AddAddress,
    AddBridge,
    AddNetns,
    AddRoute,
    AddRule,
    AddSrcFilter,
    AddTun,
    AddVeth,
    BfifoLeaf,
    ChangeHtbClass,
    ChangeNetem,
    HtbClass,
    HtbRoot,
    LinkUp,
    NetemLeaf,
    Operation,
    SetMaster,
    SetMtu,
    SetTxQueueLen,
    Sysctl,
)

ETH_P_IP = 0x0800
NETLINK_ROUTE = 0
SOL_NETLINK = 270
NETLINK_EXT_ACK = 11
# How long links brought up may take to turn operational (the kernel's link watcher runs them
# at most once a second; a slow guest takes longer).
LINK_UP_TIMEOUT_S = 10.0

# pyroute2 0.9.7 knows pfifo but not bfifo: an unknown kind is sent at the root with no options
# (EEXIST under HTB). Both share `struct tc_fifo_qopt { u32 limit; }`, so the pfifo codec
# encodes bfifo requests and decodes bfifo dumps (limit in bytes).
_tc_plugins.setdefault("bfifo", sched_pfifo)
# pyroute2 creates a namespace, and opens a handle in one, in a forked child that must answer
# within 2 s: a fork of a large process on a slow or loaded kernel (a user-mode-linux guest takes
# 2-5 s) missed that, failing with "no response from the child".
_pyroute2_config.default_communicate_timeout = max(_pyroute2_config.default_communicate_timeout, 30)
_pyroute2_config.default_create_socket_timeout = max(_pyroute2_config.default_create_socket_timeout, 60)

# pyroute2's netem codec cannot set a rate (see netem_codec): ours encodes as `tc` does.
_tc_plugins["netem"] = netem_codec


class NetError(RuntimeError):
    """A kernel operation failed; the message names the operation and the kernel's error."""

    def __init__(self, message: str, errno_: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno_


class Halted(NetError):
    """`Executor.apply` stopped early because its caller asked it to (the run was interrupted)."""


def kernel_error(e: BaseException) -> tuple[str, int | None]:
    """(kernel's text, errno) of a netlink or OS error."""
    if isinstance(e, NetlinkError):
        code = int(e.code)
        text = str(e.args[1]) if len(e.args) > 1 and e.args[1] else os.strerror(code)
        return text, code
    if isinstance(e, OSError) and e.errno is not None:
        return e.strerror or os.strerror(e.errno), e.errno
    return str(e) or type(e).__name__, None


def _err(op: Operation, e: BaseException) -> NetError:
    text, code = kernel_error(e)
    suffix = f" (errno {code})" if code is not None else ""
    return NetError(f"{op.describe()}: {text}{suffix}", code)


class _Handle:
    """A pyroute2 handle over a netlink socket made in a namespace; closes both."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.ipr = IPRoute(use_socket=sock, groups=0, ext_ack=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ipr, name)

    def close(self) -> None:
        try:
            self.ipr.close()
        finally:
            self.sock.close()


def _netlink_socket() -> socket.socket:
    """A NETLINK_ROUTE socket in the calling thread's namespace, set up as pyroute2 sets its own."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_ROUTE)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    sock.setsockopt(SOL_NETLINK, NETLINK_EXT_ACK, 1)
    return sock


def _open_handle(ns: str) -> Any:
    """A netlink handle in namespace `ns` ("": this process's own, a container's for the WAN
    router). The socket is made by a short-lived thread inside `ns` (a socket stays in the
    namespace it was made in) rather than by pyroute2's forked child: a fork of a large process
    costs milliseconds on a host, seconds on a slow kernel (a user-mode-linux guest). The thread
    never creates a namespace: a missing one is an error."""
    if not ns:
        return IPRoute(groups=0, ext_ack=True)  # groups=0: no multicast backlog accumulates
    return _Handle(nsthread.run_in_netns(ns, _netlink_socket))


TUNSETIFF = 0x400454CA
TUNSETPERSIST = 0x400454CB
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def _make_persistent_tun(ifname: str) -> None:
    """L3 TUN without packet info, persistent (lives on with no reader), in this thread's namespace."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", ifname.encode(), IFF_TUN | IFF_NO_PI))
        fcntl.ioctl(fd, TUNSETPERSIST, 1)
    finally:
        os.close(fd)


def _create_netns(name: str) -> None:
    """`ip netns add NAME` without a fork: a short-lived thread unshares its network namespace
    and bind-mounts it under /run/netns (pyroute2's `attach`, with the thread as the "pid")."""
    err: list[BaseException] = []

    def body() -> None:
        try:
            if nsthread.libc().unshare(nsthread.CLONE_NEWNET) != 0:
                code = ctypes.get_errno()
                raise OSError(code, f"unshare(CLONE_NEWNET): {os.strerror(code)}")
            netns.attach(name, f"self/task/{threading.get_native_id()}")
        except BaseException as e:  # handed to the caller
            err.append(e)

    t = threading.Thread(target=body, name=f"netns-add-{name}", daemon=True)
    t.start()
    t.join()
    if err:
        raise err[0]


class Executor:
    """Context manager applying operations; closes its netlink handles on exit."""

    def __init__(self) -> None:
        self._handles: dict[tuple[int, str], Any] = {}
        self.applied: list[Operation] = []

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        handles, self._handles = self._handles, {}
        for h in handles.values():
            h.close()

    def open(self, *namespaces: str) -> None:
        """Open the netlink handles of `namespaces` now rather than at their first operation."""
        for ns in namespaces:
            self._ipr(ns)

    def handle(self, ns: str) -> Any:
        """The calling thread's netlink handle in `ns`, for reading (counters, qdisc stats)."""
        return self._ipr(ns)

    def apply(self, ops: Iterable[Operation], halt: threading.Event | None = None) -> None:
        """Apply `ops` in order; once `halt` is set, stop before the next one (Halted): a plan of
        thousands of operations must not outlive the Ctrl-C that interrupted it."""
        ups: list[LinkUp] = []
        for op in ops:
            if halt is not None and halt.is_set():
                raise Halted(f"stopped before {op.describe()}: interrupted")
            self.apply_one(op)
            if isinstance(op, LinkUp):
                ups.append(op)
        self._await_operational(ups, halt)

    def _await_operational(self, ups: list[LinkUp], halt: threading.Event | None = None) -> None:
        """Return once the links just brought up carry packets. The kernel attaches a link's
        queueing discipline when its link watcher marks it operational, up to a second after
        `ip link set up` (longer on a slow machine); until then what is sent through it is
        dropped where no counter sees it. A link without carrier (a TUN nobody holds yet) has
        nothing to wait for."""
        deadline = time.monotonic() + LINK_UP_TIMEOUT_S
        pending = list(ups)
        while pending:
            pending = [op for op in pending if not self._operational(op)]
            if not pending:
                return
            if halt is not None and halt.is_set():
                raise Halted(f"stopped waiting for {len(pending)} link(s) to come up: interrupted")
            if time.monotonic() > deadline:
                raise NetError(
                    f"{pending[0].describe()}: not operational after {LINK_UP_TIMEOUT_S:.0f} s "
                    f"({len(pending)} link(s) still down)"
                )
            time.sleep(0.02)

    def _operational(self, op: LinkUp) -> bool:
        link = self._ipr(op.ns).get_links(self._index(op.ns, op.ifname))[0]
        return link.get_attr("IFLA_CARRIER") == 0 or link.get_attr("IFLA_OPERSTATE") in ("UP", "UNKNOWN")

    def apply_one(self, op: Operation) -> None:
        handler = _DISPATCH.get(type(op))
        if handler is None:
            raise NetError(f"{op.describe()}: no executor for {type(op).__name__}")
        try:
            handler(self, op)
        except NetError:
            raise
        except Exception as e:  # pyroute2 raises NetlinkError, OSError and plain Exceptions
            raise _err(op, e) from e
        self.applied.append(op)

    # -- helpers -------------------------------------------------------------------------------

    def _ipr(self, ns: str) -> Any:
        # One handle per (thread, namespace): pyroute2 refuses a handle over a given socket from
        # another thread, and a thread of its own gets one of its own.
        key = (threading.get_ident(), ns)
        h = self._handles.get(key)
        if h is None:
            h = _open_handle(ns)
            self._handles[key] = h
        return h

    def _index(self, ns: str, ifname: str) -> int:
        found = self._ipr(ns).link_lookup(ifname=ifname)
        if not found:
            raise OSError(errno.ENODEV, f"no interface {ifname!r} in {ns}")
        return int(found[0])

    def _drop(self, ns: str) -> None:
        for key in [k for k in self._handles if k[1] == ns]:
            self._handles.pop(key).close()

    # -- one method per operation ----------------------------------------------------------------

    def _add_netns(self, op: AddNetns) -> None:
        if op.ns in netns.listnetns():
            raise NetError(f"{op.describe()}: namespace exists (errno {errno.EEXIST})", errno.EEXIST)
        self._drop(op.ns)
        _create_netns(op.ns)
        if op.ns not in netns.listnetns():
            raise NetError(f"{op.describe()}: namespace did not appear in {nsthread.NETNS_DIR}")

    def _add_bridge(self, op: AddBridge) -> None:
        self._ipr(op.ns).link("add", ifname=op.ifname, kind="bridge")

    def _add_veth(self, op: AddVeth) -> None:
        self._ipr(op.peer_ns)  # fail early, naming the operation, if the peer namespace is missing
        self._ipr(op.ns).link(
            "add", ifname=op.ifname, kind="veth", peer={"ifname": op.peer_ifname, "net_ns_fd": op.peer_ns}
        )

    def _add_tun(self, op: AddTun) -> None:
        # TUNSETIFF makes the device in the namespace of the thread that calls it: a thread inside
        # op.ns (pyroute2's tuntap would make it wherever its handle's spec says, here: ours).
        nsthread.run_in_netns(op.ns, _make_persistent_tun, op.ifname)
        self._index(op.ns, op.ifname)

    def _set_master(self, op: SetMaster) -> None:
        master = self._index(op.ns, op.master)
        self._ipr(op.ns).link("set", index=self._index(op.ns, op.ifname), master=master)

    def _set_mtu(self, op: SetMtu) -> None:
        self._ipr(op.ns).link("set", index=self._index(op.ns, op.ifname), mtu=op.mtu)

    def _set_txqlen(self, op: SetTxQueueLen) -> None:
        self._ipr(op.ns).link("set", index=self._index(op.ns, op.ifname), txqlen=op.qlen)

    def _add_address(self, op: AddAddress) -> None:
        iface = ipaddress.ip_interface(op.cidr)
        try:
            self._ipr(op.ns).addr(
                "add", index=self._index(op.ns, op.ifname), address=str(iface.ip), prefixlen=iface.network.prefixlen
            )
        except NetlinkError as e:
            # The kernel answers EEXIST only for this very address and prefix: already done.
            if e.code != errno.EEXIST:
                raise

    def _link_up(self, op: LinkUp) -> None:
        self._ipr(op.ns).link("set", index=self._index(op.ns, op.ifname), state="up")

    def _add_route(self, op: AddRoute) -> None:
        spec: dict[str, object] = {"family": socket.AF_INET}
        if op.dst != "default":
            net = ipaddress.ip_network(op.dst)
            spec.update(dst=str(net.network_address), dst_len=net.prefixlen)
        else:
            spec.update(dst="0.0.0.0", dst_len=0)
        if op.gateway is not None:
            spec["gateway"] = op.gateway
        if op.dev is not None:
            spec["oif"] = self._index(op.ns, op.dev)
        if op.table is not None:
            spec["table"] = op.table
        self._ipr(op.ns).route("add", **spec)

    def _add_rule(self, op: AddRule) -> None:
        self._ipr(op.ns).rule("add", family=socket.AF_INET, iifname=op.iif, table=op.table, priority=op.priority)

    def _sysctl(self, op: Sysctl) -> None:
        # /proc/sys/net shows the namespace of the thread that opens it: write from inside.
        nsthread.run_in_netns(op.ns, nsthread.write_sysctl, op.key, op.value)

    def _htb_root(self, op: HtbRoot) -> None:
        # default 0: traffic no filter claims (ARP, unshaped pairs) bypasses the classes.
        self._ipr(op.ns).tc("add", "htb", self._index(op.ns, op.ifname), HTB_ROOT, default=0)

    def _htb_class(self, op: HtbClass, command: str = "add-class") -> None:
        rate = op.rate_bps // 8  # kernel rates are bytes/s; pyroute2 switches to rate64 above 2^32-1
        self._ipr(op.ns).tc(
            command,
            "htb",
            self._index(op.ns, op.ifname),
            op.classid,
            parent=HTB_ROOT,
            rate=rate,
            ceil=rate,
            burst=op.burst_bytes,
            cburst=op.burst_bytes,
            quantum=op.quantum,
        )

    def _change_htb_class(self, op: ChangeHtbClass) -> None:
        self._htb_class(op, "change-class")

    def _add_src_filter(self, op: AddSrcFilter) -> None:
        net = ipaddress.ip_network(op.src_cidr)
        if net.version != 4:
            raise ValueError(f"{op.src_cidr}: only IPv4 subnets are shaped")
        key = f"0x{int(net.network_address):08x}/0x{int(net.netmask):08x}+12"  # IPv4 source at byte 12
        self._ipr(op.ns).tc(
            "add-filter",
            "u32",
            self._index(op.ns, op.ifname),
            parent=HTB_ROOT,
            prio=op.prio,
            protocol=ETH_P_IP,
            target=op.classid,
            keys=[key],
        )

    def _bfifo(self, op: BfifoLeaf) -> None:
        self._ipr(op.ns).tc(
            "add", "bfifo", self._index(op.ns, op.ifname), op.handle, parent=op.parent, limit=op.limit_bytes
        )

    def _netem(self, op: NetemLeaf, command: str = "add") -> None:
        self._ipr(op.ns).tc(
            command,
            "netem",
            self._index(op.ns, op.ifname),
            op.handle,
            parent=op.parent,
            delay_us=round(op.delay_s * 1e6),
            jitter_us=round(op.jitter_s * 1e6),
            loss=op.loss,
            loss_corr=op.loss_correlation,
            limit=op.limit_packets,
            rate_bytes=None if op.rate_bps is None else op.rate_bps // 8,
        )

    def _change_netem(self, op: ChangeNetem) -> None:
        self._netem(op, "change")


_DISPATCH: dict[type[Operation], Callable[[Executor, Any], None]] = {
    AddNetns: Executor._add_netns,
    AddBridge: Executor._add_bridge,
    AddVeth: Executor._add_veth,
    AddTun: Executor._add_tun,
    SetMaster: Executor._set_master,
    SetMtu: Executor._set_mtu,
    SetTxQueueLen: Executor._set_txqlen,
    AddAddress: Executor._add_address,
    LinkUp: Executor._link_up,
    AddRoute: Executor._add_route,
    AddRule: Executor._add_rule,
    Sysctl: Executor._sysctl,
    HtbRoot: Executor._htb_root,
    HtbClass: Executor._htb_class,
    ChangeHtbClass: Executor._change_htb_class,
    AddSrcFilter: Executor._add_src_filter,
    BfifoLeaf: Executor._bfifo,
    NetemLeaf: Executor._netem,
    ChangeNetem: Executor._change_netem,
}


def apply(ops: Iterable[Operation]) -> None:
    """Apply `ops` with a fresh executor."""
    with Executor() as ex:
        ex.apply(ops)
