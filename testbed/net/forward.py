"""A TCP port on the host that leads into a network namespace: what lets an outside client
(a load generator on the host) reach the router of a deployment whose services live in
namespaces.

The listener runs on the caller's event loop in the caller's namespace (e.g. 127.0.0.1:PORT).
For each accepted connection a socket is created by a thread that has entered the target
namespace (a socket belongs to the namespace it was created in, whichever thread uses it
later), connected to the target from the caller's loop, and bytes are relayed both ways; a
half-close is passed on, so HTTP clients that shut down their write side still get the answer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket

from testbed.net.nsthread import enter_netns

log = logging.getLogger("testbed.forward")
CHUNK = 1 << 16
CONNECT_TIMEOUT_S = 10.0


def _new_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    return s


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


class NetnsForwarder:
    """Listen on `listen` (host, port; port 0 picks one) and relay each connection to `target`
    through a socket opened inside namespace `netns` ("" = the caller's own)."""

    def __init__(self, netns: str, target: tuple[str, int], listen: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        self.netns = netns
        self.target = target
        self.listen = listen
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def address(self) -> tuple[str, int]:
        if self._server is None:
            raise RuntimeError("the forwarder is not listening")
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    async def start(self) -> tuple[str, int]:
        # One thread, in the namespace for its whole life: creating a socket takes microseconds.
        netns = self.netns

        def enter() -> None:
            if netns:
                enter_netns(netns)

        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"fwd-{netns or 'here'}", initializer=enter
        )
        # Fail here, not on the first client, if the namespace is not there.
        await asyncio.wrap_future(self._pool.submit(lambda: None))
        self._server = await asyncio.start_server(self._accepted, *self.listen)
        return self.address

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        assert self._pool is not None
        loop = asyncio.get_running_loop()
        sock = await loop.run_in_executor(self._pool, _new_socket)
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await loop.sock_connect(sock, self.target)
        except BaseException:
            sock.close()
            raise
        return await asyncio.open_connection(sock=sock)

    async def _accepted(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(cwriter)
        twriter: asyncio.StreamWriter | None = None
        try:
            try:
                treader, twriter = await self._connect()
            except (OSError, TimeoutError) as e:
                log.warning("forward to %s:%d in %s failed: %s", *self.target, self.netns or "this namespace", e)
                return
            self._writers.add(twriter)
            await asyncio.gather(_pipe(creader, twriter), _pipe(treader, cwriter))
        finally:
            for w in (cwriter, twriter):
                if w is not None:
                    self._writers.discard(w)
                    w.close()
                    with contextlib.suppress(Exception):
                        await w.wait_closed()

    async def close(self) -> None:
        """Stop listening and reset every relayed connection."""
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            await self._server.wait_closed()
            self._server = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
