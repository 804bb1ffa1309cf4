"""Prometheus for a running deployment: a scrape config generated from its `deployment.json`,
and, on the host backends, the `prometheus` binary run against it for the length of a hold or
replay (`--prometheus`).

Node ports change with every hold and are written only to `deployment.json`, so the targets are
a file_sd file (`targets.json`) beside a fixed `prometheus.yml`: regenerating the file points a
Prometheus that keeps running at the next hold (it rereads the file). Each target is labelled
with what a dashboard groups by: `role` (router, prefill, decode), and for nodes `cluster`,
`cluster_kind` (prfaas: the senders whose KV egress is all WAN traffic) and `datacenter`. The
metrics carry `model_name` and `engine` themselves.

The backends whose services listen on this host's loopback (local, inproc) are scraped directly;
netns, compose and swarm would need Prometheus inside the client namespace or as a service of
the stack, which is not done yet.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:  # the CLI imports this module for its defaults: keep that cheap (asyncio too)
    import asyncio

    from testbed.core.json_types import JSONObject
    from testbed.live.deployment import Deployment

JOB = "testbed"
SCRAPE_INTERVAL = "1s"  # holds are watched live; the rate() windows of the dashboards are a few of these
HOST_BACKENDS = ("local", "inproc")
DEFAULT_LISTEN = "127.0.0.1:9090"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


class TargetGroup(TypedDict):
    """One file_sd target group: addresses and the labels their series get."""

    targets: list[str]
    labels: dict[str, str]


def scrape_targets(dep: Deployment) -> list[TargetGroup]:
    """file_sd target groups: the router and every node, each with its labels."""
    kinds = {c.name: c.kind for c in dep.scenario.clusters}
    groups: list[TargetGroup] = [{"targets": [f"{dep.router.host}:{dep.router.port}"], "labels": {"role": "router"}}]
    for nid in sorted(dep.nodes):
        n = dep.nodes[nid]
        groups.append(
            {
                "targets": [f"{n.http.host}:{n.http.port}"],
                "labels": {
                    "role": n.role,
                    "cluster": n.cluster,
                    "cluster_kind": kinds[n.cluster],
                    "datacenter": n.datacenter,
                },
            }
        )
    return groups


def prometheus_config(targets_file: str, interval: str = SCRAPE_INTERVAL) -> JSONObject:
    """prometheus.yml: one job reading `targets_file` (file_sd, reread when it changes)."""
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {
                "job_name": JOB,
                "metrics_path": "/metrics",
                "file_sd_configs": [{"files": [targets_file], "refresh_interval": "5s"}],
            }
        ],
    }


def write_scrape_config(dep: Deployment, out: Path) -> Path:
    """Write `out/prometheus.yml` and `out/targets.json` for `dep`; return the config's path.
    The targets file is replaced whole, so a running Prometheus never reads half of it."""
    out.mkdir(parents=True, exist_ok=True)
    targets = out / "targets.json"
    tmp = targets.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(scrape_targets(dep), indent=1))
    tmp.replace(targets)
    import yaml

    cfg = out / "prometheus.yml"
    cfg.write_text(yaml.safe_dump(prometheus_config(str(targets.resolve())), sort_keys=False))
    return cfg


def unavailable(backend: str, binary: str | None) -> str | None:
    """Why `--prometheus` cannot run here, in one line; None if it can."""
    if backend not in HOST_BACKENDS:
        return (
            f"--prometheus: only on the {' and '.join(HOST_BACKENDS)} backends for now (on {backend} the "
            "services are not on this host's loopback; generate the config with "
            "examples/observability/scrape_config.py and run Prometheus where it reaches them)"
        )
    if binary is None:
        return "--prometheus: no `prometheus` binary on PATH (Debian: apt-get install prometheus)"
    return None


def find_binary() -> str | None:
    return shutil.which("prometheus")


class PrometheusProcess:
    """The `prometheus` binary scraping one deployment, its data and log under `workdir`."""

    def __init__(self, binary: str, dep: Deployment, workdir: Path, listen: str = DEFAULT_LISTEN) -> None:
        self.binary, self.dep, self.workdir, self.listen = binary, dep, workdir, listen
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://{self.listen}"

    async def start(self) -> None:
        import asyncio

        cfg = write_scrape_config(self.dep, self.workdir)
        log = (self.workdir / "prometheus.log").open("ab")
        try:
            self._proc = await asyncio.create_subprocess_exec(
                self.binary,
                f"--config.file={cfg}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address={self.listen}",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        finally:
            log.close()
        await self._until_ready()

    async def _until_ready(self) -> None:
        import asyncio

        import aiohttp

        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_TIMEOUT_S
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
            while True:
                assert self._proc is not None
                if self._proc.returncode is not None:
                    raise RuntimeError(
                        f"prometheus exited with {self._proc.returncode} before it was ready "
                        f"(see {self.workdir / 'prometheus.log'})"
                    )
                try:
                    if await self._scraping(s):
                        return
                except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
                    pass
                if loop.time() > deadline:
                    await self.stop()
                    raise RuntimeError(
                        f"prometheus not scraping every service from {self.listen} within "
                        f"{READY_TIMEOUT_S:g} s "
                        f"(see {self.workdir / 'prometheus.log'})"
                    )
                await asyncio.sleep(0.2)

    async def _scraping(self, s: Any) -> bool:
        """Ready, and every service scraped once: Prometheus hands new file_sd targets to its
        scrapers only every few seconds, and a run's first requests would go unseen."""
        async with s.get(f"{self.url}/-/ready") as r:
            if r.status != 200:
                return False
        async with s.get(f"{self.url}/api/v1/targets") as r:
            active = (await r.json())["data"]["activeTargets"]
        return len(active) == 1 + len(self.dep.nodes) and all(t["health"] == "up" for t in active)

    async def stop(self) -> None:
        import asyncio

        p, self._proc = self._proc, None
        if p is None or p.returncode is not None:
            return
        p.terminate()
        try:
            await asyncio.wait_for(p.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            p.kill()
            await p.wait()
