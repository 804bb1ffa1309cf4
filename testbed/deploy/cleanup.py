"""Removal of what testbed runs leave behind, every kind in one place: network namespaces and the
processes inside them (found by name prefix, `testbed.net.teardown`), and the Docker objects of
compose and swarm runs (found by the project label each carries: containers, networks, volumes,
swarm services and configs). The backends' stop() and `testbed down` both use it; each call is
idempotent, and a second one finds nothing.

A project is a run's prefix (`ptb` + 4 hex characters); the bare prefix `ptb` selects every run.

A live run's resources are never swept, whatever the prefix: each backend records the run's owner
under its prefix while it lives (`testbed.net.owners`; a local run's process journal names its
owner too), and every sweep leaves the resources of a live owner alone and says so. `--force
PREFIX` (`LiveRuns.force`) names a live run whose resources go all the same.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from testbed.deploy import dockercli
from testbed.deploy.base import BackendError
from testbed.deploy.engine import PROJECT_LABEL, Engine, Sweep, try_connect
from testbed.net import owners
from testbed.net.owners import Owner, owner_of
from testbed.net.procs import JOURNAL_DIR, sweep_orphans
from testbed.net.teardown import TeardownReport, namespaces, remove_namespaces

PREFIX = "ptb"
DOCKER_KINDS = ("containers", "networks", "volumes", "services", "configs")
SWARM_SWEEP_S = 90.0
SWEEP_PAUSE_S = 1.0

Warn = Callable[[str], None]


def _stderr(line: str) -> None:
    print(f"cleanup: {line}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class LiveRuns:
    """The runs whose owner lives (by prefix), and those of them `--force` gives up anyway."""

    owners: Mapping[str, Owner] = field(default_factory=dict)
    force: frozenset[str] = frozenset()

    def spared(self, name: str) -> Owner | None:
        """The live owner that keeps the resource `name` (a namespace, a project), if any."""
        o = owner_of(name, self.owners)
        return None if o is None or o.key in self.force else o

    def spared_keys(self) -> set[str]:
        return {k for k in self.owners if k not in self.force}


NO_LIVE_RUNS = LiveRuns()


def project_label(project: str) -> str:
    """The label filter of a project's objects; for the bare prefix, of every project's."""
    return PROJECT_LABEL if project == PREFIX else f"{PROJECT_LABEL}={project}"


def _sweep(
    engine: Engine, kind: str, label: str, warn: Warn, driver: str | None = None, spare: Collection[str] = ()
) -> Sweep:
    try:
        return engine.sweep(kind, label, driver, spare) if spare else engine.sweep(kind, label, driver)
    except BackendError as e:
        warn(str(e))
        return Sweep()


def _warn_failed(kind: str, sweep: Sweep, warn: Warn) -> None:
    for key, why in sweep.failed.items():
        warn(f"could not remove {kind[:-1]} {key}: {why}")


def remove_compose_project(
    engine: Engine, project: str, warn: Warn = _stderr, spare: Collection[str] = ()
) -> dict[str, list[str]]:
    """Every container, network and volume labelled with the project: what `compose down` would
    remove, also when the compose file is gone. Those of the projects in `spare` stay."""
    label = project_label(project)
    out: dict[str, list[str]] = {}
    for kind in ("containers", "networks", "volumes"):
        s = _sweep(engine, kind, label, warn, spare=spare)
        _warn_failed(kind, s, warn)
        out[kind] = s.found
    return out


def remove_swarm_project(
    engine: Engine,
    project: str,
    timeout: float = SWARM_SWEEP_S,
    warn: Warn = _stderr,
    stack_rm: Callable[[str], None] = dockercli.stack_rm,
    pause: float = SWEEP_PAUSE_S,
    spare: Collection[str] = (),
) -> dict[str, list[str]]:
    """`docker stack rm` (on a manager), then remove whatever is still labelled with the project:
    services, containers, volumes, overlay networks, configs, until none is left. Networks go only
    once their containers have, which the swarm does asynchronously: an object that will not go
    yet is tried again each pass, and named if it is still there at the timeout."""
    out: dict[str, list[str]] = {k: [] for k in ("services", "containers", "networks", "configs", "volumes")}
    try:
        _, manager = engine.swarm_state()
    except BackendError as e:
        warn(str(e))
        manager = False
    label = project_label(project)
    table: list[tuple[str, str | None]] = [("containers", None), ("volumes", None)]
    if manager:
        if project != PREFIX:
            stack_rm(project)
        table = [("services", None), *table, ("networks", "overlay"), ("configs", None)]
    deadline = time.monotonic() + timeout
    while True:
        passed = {kind: _sweep(engine, kind, label, warn, driver, spare) for kind, driver in table}
        for kind, s in passed.items():
            out[kind] += [i for i in s.found if i not in out[kind]]
        if not any(s.found for s in passed.values()):
            return out
        if time.monotonic() > deadline:
            for kind, s in passed.items():
                _warn_failed(kind, s, warn)
            return out
        time.sleep(pause)


def remove_docker_leftovers(
    project: str, engine: Engine | None = None, warn: Warn = _stderr, spare: Collection[str] = ()
) -> dict[str, list[str]]:
    """Swarm and compose objects of the project, per kind (every kind listed, found or not);
    nothing where no engine can be reached, nor of the projects in `spare`."""
    if project in spare:
        return {k: [] for k in DOCKER_KINDS}
    if engine is None:
        engine = try_connect()
    if engine is None:
        return {k: [] for k in DOCKER_KINDS}
    swarm = remove_swarm_project(engine, project, warn=warn, spare=spare)
    rest = remove_compose_project(engine, project, warn=warn, spare=spare)
    merged = {k: list(dict.fromkeys(swarm.get(k, []) + rest.get(k, []))) for k in {**swarm, **rest}}
    return {k: merged.get(k, []) for k in DOCKER_KINDS}


class Leftovers(Protocol):
    """What one sweep removed, for `testbed down`'s report."""

    @property
    def errors(self) -> tuple[str, ...]: ...
    def to_dict(self) -> dict[str, object]: ...
    def summary(self) -> str:
        """ "" when there is nothing to say."""
        ...


# (prefix, an engine to use or None for any that answers, where warnings go, the live runs to
# leave alone) -> what it removed. Each backend's registry entry names the one that removes what
# its runs leave.
Sweeper = Callable[[str, Engine | None, Warn, LiveRuns], Leftovers]


def sweep_namespaces(
    prefix: str, engine: Engine | None = None, warn: Warn = _stderr, live: LiveRuns = NO_LIVE_RUNS
) -> TeardownReport:
    """Every namespace whose name starts with `prefix` (and what runs inside), but a live run's."""
    return remove_namespaces([n for n in namespaces(prefix) if live.spared(n) is None], label=prefix)


@dataclass(frozen=True)
class ProcessLeftovers:
    stopped: dict[str, list[str]]
    errors: tuple[str, ...] = ()
    spared: dict[str, str] = field(default_factory=dict)  # live local runs: name -> its runner

    def to_dict(self) -> dict[str, object]:
        return {"local_runs": self.stopped, "local_runs_spared": self.spared}

    def summary(self) -> str:
        return "\n".join(
            [
                f"stopped the services of {group}, whose run was gone: {', '.join(keys)}"
                for group, keys in self.stopped.items()
            ]
            + [
                f"left live local run {group} alone ({who}); `testbed down --force {group}` stops it"
                for group, who in self.spared.items()
            ]
        )


def sweep_processes(
    prefix: str,
    engine: Engine | None = None,
    warn: Warn = _stderr,
    live: LiveRuns = NO_LIVE_RUNS,
    journal_dir: Path = JOURNAL_DIR,
) -> ProcessLeftovers:
    """The services of local runs whose runner died (kill -9): the run named `prefix`'s (its
    journal is `<prefix>.json`), or every such run's with the bare prefix. A live runner's
    services are left alone (it stops its own) unless `live.force` names its run."""
    o = sweep_orphans(journal_dir, None if prefix == PREFIX else prefix, force=live.force)
    for e in o.errors:
        warn(e)
    return ProcessLeftovers(o.stopped, tuple(o.errors), o.spared)


@dataclass(frozen=True)
class DockerLeftovers:
    removed: dict[str, list[str]]
    errors: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        return {"docker": self.removed}

    def summary(self) -> str:
        if not any(self.removed.values()):
            return ""
        return "docker: removed " + ", ".join(f"{len(v)} {k}" for k, v in self.removed.items())


def ctl_dir(project: str) -> Path:
    """The host folder a compose run shares with its WAN router container (the delay line's
    control socket): bind-mounted, so it outlives a killed run like its containers do."""
    return Path(f"/tmp/{project}-ctl")


def _remove_dirs(found: list[Path]) -> list[str]:
    """Remove each folder of `found` that is one (never through a symlink); the ones removed."""
    gone = []
    for d in found:
        if d.is_dir() and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)
            gone.append(str(d))
    return gone


def remove_ctl_dirs(prefix: str, spare: Collection[str] = ()) -> list[str]:
    """The control folders of the project `prefix` (of every project with the bare prefix), but
    a live run's (`spare`)."""
    found = [ctl_dir(prefix)] if prefix != PREFIX else sorted(ctl_dir(PREFIX).parent.glob(f"{PREFIX}*-ctl"))
    return _remove_dirs([d for d in found if d.name.removesuffix("-ctl") not in spare])


# The folders of the swarm labs (`testbed.deploy.swarm_lab`): one per lab, its nodes' sockets.
LAB_DIR = Path("/run/prfaas-testbed/lab")


def remove_lab_dirs(prefix: str, lab_dir: Path = LAB_DIR) -> list[str]:
    """The folders of the lab named `prefix` (of every lab with the bare prefix); the lab's
    containers, volumes and network carry its project label and go with the label sweeps."""
    found = [lab_dir / prefix] if prefix != PREFIX else sorted(lab_dir.glob(f"{PREFIX}*"))
    return _remove_dirs(found)


def sweep_docker(
    prefix: str, engine: Engine | None = None, warn: Warn = _stderr, live: LiveRuns = NO_LIVE_RUNS
) -> DockerLeftovers:
    spare = live.spared_keys()
    removed = remove_docker_leftovers(prefix, engine, warn, spare)
    return DockerLeftovers(
        {**removed, "control_dirs": remove_ctl_dirs(prefix, spare), "lab_dirs": remove_lab_dirs(prefix)}
    )


@dataclass(frozen=True)
class SparedRuns:
    """The live runs whose resources (namespaces, Docker objects) a sweep left alone."""

    runs: dict[str, str]  # prefix -> who owns it

    @property
    def errors(self) -> tuple[str, ...]:
        return ()

    def to_dict(self) -> dict[str, object]:
        return {"live_runs_spared": self.runs}

    def summary(self) -> str:
        return "\n".join(
            f"left live run {k} alone ({who}); `testbed down --force {k}` removes it" for k, who in self.runs.items()
        )


@dataclass(frozen=True)
class DownReport:
    parts: tuple[Leftovers, ...]

    @property
    def errors(self) -> tuple[str, ...]:
        return tuple(e for p in self.parts for e in p.errors)

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for p in self.parts:
            out.update(p.to_dict())
        return out

    def summary(self) -> str:
        texts = [t for p in self.parts if (t := p.summary())]
        # The namespace sweep says when it found nothing; another sweep that removed something
        # makes that line read as a contradiction ("nothing to remove", then "stopped ...").
        found = [t for t in texts if not t.startswith("nothing to remove")]
        return "\n".join(found or texts)


def down(
    sweepers: Sequence[Sweeper],
    prefix: str = PREFIX,
    engine: Engine | None = None,
    warn: Warn = _stderr,
    force: Collection[str] = (),
    owner_dirs: list[Path] | None = None,
) -> DownReport:
    """Everything every kind of run left whose name starts with (namespaces) or whose project is
    (Docker objects) `prefix`, one sweeper per kind (`testbed.deploy.registry.sweepers`), except
    what a live run owns, unless `force` names that run. ValueError for a prefix that is not a
    testbed one, before anything is touched."""
    if not prefix.startswith(PREFIX):
        raise ValueError(f"prefix {prefix!r}: must start with {PREFIX!r}")
    recorded = owners.read_owners(owner_dirs)
    live = LiveRuns({k: o for k, o in recorded.items() if o.live()}, frozenset(force))
    parts = [sweep(prefix, engine, warn, live) for sweep in sweepers]
    for k in recorded:
        if k.startswith(prefix) and k not in live.owners:
            owners.forget(k, owner_dirs)  # its run is gone, and now what it left too
    spared = {
        k: o.describe().split(": ", 1)[1]
        for k, o in live.owners.items()
        if k not in live.force and (k.startswith(prefix) or prefix.startswith(k))
    }
    return DownReport((*parts, SparedRuns(spared)))
