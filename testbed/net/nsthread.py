"""Run code inside a network namespace from the main process, one thread at a time.

setns(2) with CLONE_NEWNET moves only the calling thread, and sockets (and /proc/sys/net) belong
to the namespace of the thread that opens them. So a dedicated thread that enters the namespace
and runs an asyncio loop lets the replayer and health checks talk to services inside namespaces
while the rest of the process stays in the root namespace. Threads the loop thread spawns (the
default executor for getaddrinfo, ...) inherit its namespace.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import os
import threading
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar

NETNS_DIR = "/run/netns"
CLONE_NEWNET = 0x40000000

T = TypeVar("T")

_libc: ctypes.CDLL | None = None


def netns_path(name: str) -> str:
    """Bind-mount of a named namespace (as `ip netns` and pyroute2 create them)."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"bad namespace name {name!r}")
    return os.path.join(NETNS_DIR, name)


def libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return _libc


def enter_netns(name: str) -> None:
    """Move the calling thread into namespace `name` (which must exist; never creates one): a
    name under /run/netns, or an absolute path such as /proc/PID/ns/net (a container's)."""
    fd = os.open(name if name.startswith("/") else netns_path(name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc().setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def run_in_netns(name: str, fn: Callable[..., T], *args: Any) -> T:
    """Call fn(*args) in a short-lived thread inside namespace `name` and return its result
    (exceptions propagate). The thread dies afterwards, so no thread is left in a foreign namespace.
    The name "" means the caller's own namespace: fn runs right here."""
    if name == "":
        return fn(*args)
    fut: concurrent.futures.Future[T] = concurrent.futures.Future()

    def body() -> None:
        try:
            enter_netns(name)
            fut.set_result(fn(*args))
        except BaseException as e:  # handed to the caller
            fut.set_exception(e)

    t = threading.Thread(target=body, name=f"netns-{name}", daemon=True)
    t.start()
    t.join()
    return fut.result()


def sysctl_path(key: str) -> str:
    """'net.ipv4.tcp_rmem' -> '/proc/sys/net/ipv4/tcp_rmem'. Only net.*: other sysctls are not
    per namespace, so writing them from a namespace would change the whole machine."""
    if not key.startswith("net.") or "/" in key or ".." in key:
        raise ValueError(f"sysctl {key!r}: only per-namespace net.* keys are allowed")
    return "/proc/sys/" + key.replace(".", "/")


def read_sysctl(key: str) -> str:
    """Value as the calling thread's namespace sees it, whitespace normalised to single spaces."""
    with open(sysctl_path(key)) as f:
        return " ".join(f.read().split())


def write_sysctl(key: str, value: str) -> str:
    """Write in the calling thread's namespace and read back; raises if the kernel kept another value."""
    with open(sysctl_path(key), "w") as f:
        f.write(value)
    got = read_sysctl(key)
    if got != " ".join(value.split()):
        raise OSError(f"sysctl {key}: wrote {value!r}, reads back {got!r}")
    return got


async def _awaited(aw: Awaitable[T]) -> T:
    return await aw


class NetnsLoop:
    """An asyncio event loop running in a thread that lives in namespace `netns`.

    with NetnsLoop("ptb3fa2-prfaas-p0") as nl:
        reply = nl.run(fetch("http://10.231.0.10:8000/health"), timeout=5)
    """

    def __init__(self, netns: str, name: str | None = None) -> None:
        self.netns = netns
        self._name = name or f"netns-loop-{netns}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready: concurrent.futures.Future[asyncio.AbstractEventLoop] = concurrent.futures.Future()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError(f"NetnsLoop({self.netns}) is not running")
        return self._loop

    def start(self) -> NetnsLoop:
        if self._thread is not None:
            raise RuntimeError(f"NetnsLoop({self.netns}) already started")
        self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
        self._thread.start()
        self._loop = self._ready.result()  # re-raises a failed setns
        return self

    def _main(self) -> None:
        try:
            enter_netns(self.netns)
            loop = asyncio.new_event_loop()
        except BaseException as e:
            self._ready.set_exception(e)
            return
        asyncio.set_event_loop(loop)
        self._ready.set_result(loop)
        try:
            loop.run_forever()
            # Stopped: cancel what is left so its sockets close inside the namespace.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()

    def submit(self, aw: Awaitable[T]) -> concurrent.futures.Future[T]:
        """Run a coroutine (or any awaitable created for this loop) on the namespace's loop;
        cancelling the returned future cancels it there."""
        return asyncio.run_coroutine_threadsafe(_awaited(aw), self.loop)

    async def run_from(self, make: Callable[[], Awaitable[T]], cleanup_timeout: float = 30.0) -> T:
        """Await, from another loop, the coroutine `make()` run on this namespace's loop. On
        cancellation, wait (up to `cleanup_timeout`) for the coroutine's own cleanup there: the
        concurrent future reports "cancelled" at once, but a replayer still records every
        unfinished request, and nothing may be torn down before it has."""
        started, finished = threading.Event(), threading.Event()

        async def tracked() -> T:
            started.set()
            try:
                return await make()
            finally:
                finished.set()

        fut = self.submit(tracked())
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            if started.is_set():
                await asyncio.to_thread(finished.wait, cleanup_timeout)
            raise

    def run(self, aw: Awaitable[T], timeout: float | None = None) -> T:
        fut = self.submit(aw)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def close(self) -> None:
        if self._thread is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._thread = None
        self._loop = None

    def __enter__(self) -> NetnsLoop:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
