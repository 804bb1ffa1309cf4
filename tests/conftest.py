from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator

import pytest


def docker_available() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture
def is_root() -> bool:
    return os.geteuid() == 0


@pytest.fixture
def scratch() -> Iterator[str]:
    """A namespace of its own holding a veth pair p0 <-> p1, both up; removed afterwards."""
    from testbed.net import plan as P
    from testbed.net.executor import Executor
    from testbed.net.teardown import teardown

    ns = "ptbt" + secrets.token_hex(3) + "-scratch"
    try:
        with Executor() as ex:
            ex.apply([P.AddNetns(ns), P.AddVeth(ns, "p0", ns, "p1"), P.LinkUp(ns, "p0"), P.LinkUp(ns, "p1")])
        yield ns
    finally:
        teardown(ns)


def pytest_configure(config: pytest.Config) -> None:
    """A shell starts background jobs (`make test &`) with SIGINT ignored: Ctrl-C would then leave
    the session running. Like the CLI, a test session is always stoppable (its fixtures tear down
    what the tests started)."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


TIERS = {"pure", "app", "netns", "docker", "slow", "clients", "observability", "profiles"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test belongs to a tier, so `make test-<tier>` and CI select exactly what they mean."""
    untiered = [i.nodeid for i in items if not TIERS & {m.name for m in i.iter_markers()}]
    if untiered:
        raise pytest.UsageError(
            "tests without a tier marker (pure/app/netns/docker/slow/clients/observability/profiles): "
            + ", ".join(untiered)
        )
