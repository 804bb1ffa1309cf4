"""The jobs left to the docker CLI, each on a file the run directory keeps so a user can rerun it
by hand; everything else goes through the engine's API (`testbed.deploy.engine`).

- A compose file up and down: compose is a client-side tool (the `docker compose` plugin or
  Debian's `docker-compose`), the engine has no call that takes a compose file.
- A stack deployed and removed: stacks are a feature of the CLI too (it turns the file into
  services, networks and configs itself), so the SDK cannot deploy one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

from testbed.deploy.base import BackendError

CLI_TIMEOUT_S = 300.0


def run(
    cmd: list[str],
    timeout: float = CLI_TIMEOUT_S,
    check: bool = True,
    env: dict[str, str] | None = None,
    halt: threading.Event | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a CLI command; BackendError with its output when it cannot run, times out or (check) fails.
    `env`: added to this process's environment (what a compose or stack file passes on by name).
    Once `halt` is set, the command is stopped (SIGTERM, which `compose up` answers by creating
    nothing more) and BackendError raised: an interrupted start-up does not wait for it."""
    what = " ".join(cmd[:4]) + ("..." if len(cmd) > 4 else "")
    full_env = None if env is None else {**os.environ, **env}
    try:
        if halt is None:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
        else:
            r = _run_halting(cmd, timeout, halt, what, full_env)
    except FileNotFoundError:
        raise BackendError(f"{what}: {cmd[0]} is not installed") from None
    except subprocess.TimeoutExpired:
        raise BackendError(f"{what}: no answer within {timeout:g} s") from None
    if check and r.returncode != 0:
        raise BackendError(f"{what} failed ({r.returncode}):\n{(r.stderr or r.stdout)[-2000:]}")
    return r


def _run_halting(
    cmd: list[str], timeout: float, halt: threading.Event, what: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    deadline = time.monotonic() + timeout
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as p:
        while True:
            try:
                out, err = p.communicate(timeout=0.2)
                return subprocess.CompletedProcess(cmd, p.returncode, out, err)
            except subprocess.TimeoutExpired:
                pass
            if halt.is_set() or time.monotonic() > deadline:
                p.terminate()
                try:
                    p.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.communicate()
                if halt.is_set():
                    raise BackendError(f"{what}: stopped (interrupted)")
                raise subprocess.TimeoutExpired(cmd, timeout)


def compose_cli() -> list[str]:
    """`docker compose` (plugin) where present, else `docker-compose`."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise BackendError(
        "neither `docker compose` nor `docker-compose` is installed: install the Docker Compose "
        "plugin (or Debian's docker-compose)"
    )


def compose(
    cli: list[str],
    project: str,
    file: Path,
    *args: str,
    timeout: float = CLI_TIMEOUT_S,
    check: bool = True,
    env: dict[str, str] | None = None,
    halt: threading.Event | None = None,
) -> subprocess.CompletedProcess[str]:
    """`COMPOSE -p PROJECT -f FILE ARGS...` (up, down)."""
    return run([*cli, "-p", project, "-f", str(file), *args], timeout=timeout, check=check, env=env, halt=halt)


def stack_deploy(
    file: Path, project: str, timeout: float = CLI_TIMEOUT_S, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`docker stack deploy` of a stack file, with the image as it is on each node (no registry)."""
    return run(
        ["docker", "stack", "deploy", "--resolve-image", "never", "-c", str(file), project], timeout=timeout, env=env
    )


def stack_rm(project: str) -> None:
    """`docker stack rm`, where there is a CLI. It may fail or hang: the label sweep that follows
    removes the same objects."""
    if shutil.which("docker"):
        try:
            run(["docker", "stack", "rm", project], check=False)
        except BackendError:
            pass
