"""What a backend needs of this host, checked before a run prints, writes or starts anything:
a missing tool, engine or privilege is then the one line a user reads (a UserError), not an
error after the run's banner and a half-made run directory. Each backend's registry entry names
its check (`BackendEntry.preflight`); `registry.check_host(name)` runs it."""

from __future__ import annotations

import shutil

from testbed.config.privilege import need_root
from testbed.deploy.base import BackendError


def netns_host() -> None:
    """Root, to create a network namespace per service."""
    need_root("the netns backend (a network namespace per service)", "give --backend local")


def compose_host() -> None:
    """A compose CLI (the plugin or docker-compose) and a Docker engine that answers."""
    from testbed.deploy.dockercli import compose_cli
    from testbed.deploy.engine import connect

    compose_cli()
    connect()


def swarm_host() -> None:
    """Root (the replayer joins a container's namespace), the docker CLI, an engine that answers."""
    from testbed.deploy.engine import connect

    need_root("the swarm backend (the replayer joins a container's network namespace)")
    if shutil.which("docker") is None:
        raise BackendError("the swarm backend deploys a stack with the docker CLI, which is not installed")
    connect()
