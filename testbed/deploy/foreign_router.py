"""A real PD router in the router's place (`router.kind`: vllm-router, sglang-router; the
`routers` extra installs both, and the testbed's image has them): its command line from the
deployment, bound to the router's address, pointed at every prefill and decode node, its
Prometheus endpoint on a port of its own (vllm-router's default 127.0.0.1:29000 would collide
between two runs). Local and netns start it as the router's process; in a container
(`testbed serve router`, compose) it replaces the serve process (`exec_router`)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import NoReturn

from testbed.core.errors import UserError
from testbed.live.deployment import Deployment

# Where a router in its own network namespace (or container) serves its Prometheus metrics
# (vllm-router's default port, on the router's address).
NAMESPACE_PROMETHEUS_PORT = 29000
# In the run directory: the URL of the foreign router's Prometheus endpoint (the runner scrapes
# it at the end of the replay into ROUTER_METRICS).
ROUTER_METRICS_URL = "router-metrics-url"
ROUTER_METRICS = "router-metrics.prom"


def binary(kind: str) -> list[str]:
    """The command that starts `kind`, from this Python's environment first; UserError if absent."""
    if kind == "vllm-router":
        exe = Path(sys.executable).parent / "vllm-router"
        found = str(exe) if exe.exists() else shutil.which("vllm-router")
        if found is None:
            raise UserError(
                "router.kind vllm-router: the vllm-router binary is not installed; install the routers extra "
                "(pip install -e '.[routers]', or `make install`)"
            )
        return [found]
    if kind == "sglang-router":
        if importlib.util.find_spec("sglang_router") is None:
            raise UserError(
                "router.kind sglang-router: the sglang_router package is not installed; install the routers "
                "extra (pip install -e '.[routers]', or `make install`)"
            )
        return [sys.executable, "-m", "sglang_router.launch_router"]
    raise UserError(f"router.kind {kind!r}: not a foreign router")


def router_argv(dep: Deployment, prometheus_port: int) -> list[str]:
    """The foreign router's command line for `dep` (its scenario's `router`)."""
    spec = dep.scenario.router
    host = dep.http_binds("router")[0]
    argv = binary(spec.kind)
    argv.append("--vllm-pd-disaggregation" if spec.kind == "vllm-router" else "--pd-disaggregation")
    for n in sorted(dep.nodes.values(), key=lambda n: (n.role, n.id)):
        argv += [f"--{n.role}", n.http.url]
        if n.role == "prefill" and spec.kind == "sglang-router":
            argv.append(str(n.http.port))  # the bootstrap service is on the node's HTTP port
    for flag, v in (
        ("--policy", spec.policy),
        ("--prefill-policy", spec.prefill_policy),
        ("--decode-policy", spec.decode_policy),
    ):
        if v is not None:
            argv += [flag, v]
    argv += ["--host", host, "--port", str(dep.router.port)]
    argv += ["--prometheus-host", host, "--prometheus-port", str(prometheus_port)]
    if dep.run_dir:
        (Path(dep.run_dir) / ROUTER_METRICS_URL).write_text(f"http://{host}:{prometheus_port}/metrics\n")
    return argv + list(spec.options)


def exec_router(dep: Deployment) -> NoReturn:
    """Replace this process (`testbed serve router` in the router's container, its routes to the
    other datacenters already added) with the foreign router: bound to the router's address in
    `dep`, Prometheus on NAMESPACE_PROMETHEUS_PORT of that address (the container has it alone),
    the URL written into the run directory for the runner to scrape."""
    argv = router_argv(dep, NAMESPACE_PROMETHEUS_PORT)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)
