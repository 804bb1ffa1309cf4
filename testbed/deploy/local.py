"""Local backend: one process per service on loopback (`testbed serve`), no link shaping.

One process per node instance mirrors the container deployment (one container per instance):
a node's event loop is never delayed by another node's work, and a crash takes down one node.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import TracebackType

import aiohttp

from testbed.live.deployment import Deployment

HEALTH_TIMEOUT_S = 60.0


class BackendError(RuntimeError):
    pass


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class LocalBackend:
    def __init__(self, dep: Deployment, run_dir: Path) -> None:
        self.dep = dep
        self.run_dir = run_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _spawn(self, node_id: str, role: str, dep_file: Path) -> None:
        log = self.run_dir / "logs" / f"{node_id}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as fh:
            # A session of its own: Ctrl-C reaches only us, and we stop services in order.
            self.procs[node_id] = subprocess.Popen(
                [sys.executable, "-m", "testbed", "serve", role, "--deployment", str(dep_file), "--id", node_id],
                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    async def _wait_healthy(self) -> None:
        eps = {"router": self.dep.router.url, **{k: v.http.url for k, v in self.dep.nodes.items()}}
        deadline = asyncio.get_running_loop().time() + HEALTH_TIMEOUT_S
        pending = dict(eps)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
            while pending:
                for nid, url in list(pending.items()):
                    proc = self.procs[nid]
                    if proc.poll() is not None:
                        raise BackendError(f"service {nid} exited with code {proc.returncode}; last log lines:\n"
                                           + _tail(self.run_dir / "logs" / f"{nid}.log"))
                    try:
                        async with s.get(f"{url}/health") as r:
                            if r.status == 200:
                                del pending[nid]
                    except (aiohttp.ClientError, asyncio.TimeoutError):
                        pass
                if pending and asyncio.get_running_loop().time() > deadline:
                    nid = sorted(pending)[0]
                    raise BackendError(f"service {nid} not healthy after {HEALTH_TIMEOUT_S:g} s; last log lines:\n"
                                       + _tail(self.run_dir / "logs" / f"{nid}.log"))
                if pending:
                    await asyncio.sleep(0.1)

    async def __aenter__(self) -> Deployment:
        dep_file = self.run_dir / "deployment.json"
        self.dep.write(dep_file)
        try:
            for nid, n in self.dep.nodes.items():
                self._spawn(nid, n.role, dep_file)
            self._spawn("router", "router", dep_file)
            await self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self.dep

    def stop(self, grace: float = 5.0) -> None:
        """Router first (no new work), then nodes; SIGTERM, then SIGKILL after `grace`."""
        order = ["router"] + [n for n in self.procs if n != "router"]
        for nid in order:
            p = self.procs.get(nid)
            if p is not None and p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for nid in order:
            p = self.procs.get(nid)
            if p is None:
                continue
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        self.procs.clear()

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.stop()
