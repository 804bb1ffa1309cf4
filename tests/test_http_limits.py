"""Every HTTP service bounds what a client may hold: idle connections and ones that trickle a
request's headers are closed after `serving.idle_timeout_s`, and a request's head is bounded in
lines. The clients run in a child process, so this process's RSS is the services' own."""

from __future__ import annotations

import asyncio
import gc
import sys
from typing import Any

import aiohttp
import pytest
from procinfo import vmrss

from testbed.config.scenarios import load_scenario
from testbed.core.schema.scenario import Scenario
from testbed.deploy.inproc import InProcessBackend
from testbed.deploy.plan import loopback_deployment
from testbed.live.common import MAX_HEADERS
from testbed.run.load import resolve

pytestmark = pytest.mark.app

IDLE_S = 1.5
# Closing is due IDLE_S after the connection was accepted; on a busy 2-core machine accepting
# 2,000 connections and running the close callbacks takes seconds more, so allow well beyond.
SLACK_S = 20.0


def _scenario(**serving: Any) -> Scenario:
    return load_scenario(
        "paper-homogeneous",
        {
            "clusters": [
                {"name": "pd", "datacenter": "local", "kind": "pd", "hardware": "h20", "prefill": 1, "decode": 1}
            ],
            "serving": serving,
        },
    )


# Opens `idle` connections that send nothing and `slow` ones that send a request line, then a
# header line every 0.25 s, never ending the head. Prints the count once all are open, then
# waits (until `deadline` s) for the server to close each and prints how many it closed and
# the latest close, in seconds after that connection opened.
CLIENTS = r"""
import selectors, socket, sys, time
host, port, idle, slow, deadline = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
sel = selectors.DefaultSelector()
opened = {}
socks = []
for i in range(idle + slow):
    s = socket.create_connection((host, port))
    s.setblocking(False)
    opened[s] = time.monotonic()
    socks.append(s)
    if i >= idle:
        s.send(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    sel.register(s, selectors.EVENT_READ)
print(len(socks), flush=True)
trickle = socks[idle:]
closed, latest = 0, 0.0
end = time.monotonic() + deadline
next_byte = time.monotonic()
while closed < len(socks) and time.monotonic() < end:
    for key, _ in sel.select(0.05):
        s = key.fileobj
        try:
            data = s.recv(65536)
        except OSError:
            data = b""
        if not data:   # closed by the server (an answer to a trickled head would be data: none comes)
            sel.unregister(s)
            s.close()
            closed += 1
            latest = max(latest, time.monotonic() - opened[s])
            if s in trickle:
                trickle.remove(s)
    if time.monotonic() >= next_byte:
        next_byte += 0.25
        for s in trickle:
            try:
                s.send(b"X-Slow: 1\r\n")
            except OSError:
                pass
print(closed, round(latest, 2), flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("service", ["router", "pd-p0", "pd-d0"])
async def test_idle_and_slow_header_connections_are_closed_after_the_idle_timeout(
    service: str, capsys: pytest.CaptureFixture[str]
) -> None:
    dep = loopback_deployment(resolve(_scenario(idle_timeout_s=IDLE_S)), None)
    ep = dep.router if service == "router" else dep.nodes[service].http
    idle, slow = 2000, 50
    async with InProcessBackend(dep):
        gc.collect()
        before = vmrss()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            CLIENTS,
            ep.host,
            str(ep.port),
            str(idle),
            str(slow),
            str(IDLE_S + SLACK_S),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None and proc.stdin is not None
            assert int(await asyncio.wait_for(proc.stdout.readline(), 120)) == idle + slow
            held = vmrss() - before
            closed_s, latest_s = (
                (await asyncio.wait_for(proc.stdout.readline(), IDLE_S + SLACK_S + 60)).decode().split()
            )
            await asyncio.sleep(0.5)  # the server side of the last closes
            gc.collect()
            after = vmrss() - before
            # The node still serves.
            async with aiohttp.ClientSession() as s, s.get(f"{ep.url}/health") as r:
                assert r.status == 200
            proc.stdin.write(b"\n")
            await proc.stdin.drain()
            await asyncio.wait_for(proc.wait(), 10)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    with capsys.disabled():
        print(
            f"\n{service}: {idle + slow} connections: RSS +{held / 2**20:.1f} MiB while open, +{after / 2**20:.1f} MiB "
            f"after; {closed_s} closed by the server, the last {latest_s} s after it opened"
        )
    assert int(closed_s) == idle + slow
    assert IDLE_S * 0.9 <= float(latest_s) <= IDLE_S + SLACK_S
    assert after < 20 << 20


async def test_a_request_head_of_too_many_lines_is_refused() -> None:
    dep = loopback_deployment(resolve(_scenario()), None)
    async with InProcessBackend(dep), aiohttp.ClientSession() as s:
        for url in (dep.router.url, dep.nodes["pd-d0"].http.url):
            async with s.get(f"{url}/health", headers={f"X-H{i}": "1" for i in range(MAX_HEADERS - 10)}) as r:
                assert r.status == 200
            async with s.get(f"{url}/health", headers={f"X-H{i}": "1" for i in range(MAX_HEADERS + 10)}) as r:
                assert r.status == 400
