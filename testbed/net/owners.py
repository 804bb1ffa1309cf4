"""Who owns a run's resources while it lives: one file per run prefix (`ptb` + 4 hex), naming
the process that runs it (pid and its start time, so a reused pid is not taken for it), the
backend, the run directory and the command line. A backend claims its prefix before it creates
anything (namespaces, containers, networks) and releases it after its teardown, so any resource
`testbed down` finds whose owner file names a live process belongs to a live run, which `down`
leaves alone unless told `--force PREFIX`. A run killed with `kill -9` leaves its file behind
with a dead owner: its resources are leftovers, removed as before.

Root's runs (netns, compose, swarm) write under /run/prfaas-testbed/owners; another user's under
their own temporary folder. `down` reads both.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from testbed.config.run_lock import current_command, process_start

ROOT_DIR = Path("/run/prfaas-testbed/owners")


def _user_dir(uid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"prfaas-testbed-{uid}" / "owners"


def owner_dir() -> Path:
    """Where this process's runs are recorded."""
    uid = os.geteuid()
    return ROOT_DIR if uid == 0 else _user_dir(uid)


def owner_dirs() -> list[Path]:
    """Every folder `down` reads: root's and each user's."""
    return [ROOT_DIR, *sorted(Path(tempfile.gettempdir()).glob("prfaas-testbed-*/owners"))]


@dataclass(frozen=True)
class Owner:
    key: str  # the run's prefix (namespaces) or Docker project
    backend: str
    pid: int
    start: int | None
    host: str
    run_dir: str
    command: str

    def live(self) -> bool:
        """Its process still runs (here: an owner on another host is taken as live)."""
        if self.host != socket.gethostname():
            return True
        started = process_start(self.pid)
        return started is not None and started == self.start

    def describe(self) -> str:
        return f"{self.key}: {self.backend} run in {self.run_dir}, pid {self.pid} (`{self.command}`)"


def claim(key: str, backend: str, run_dir: Path | str) -> Path:
    """Record this process as the owner of `key`'s resources; the file's path."""
    me = os.getpid()
    owner = Owner(key, backend, me, process_start(me), socket.gethostname(), str(run_dir), current_command())
    d = owner_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{key}.json"
    tmp = path.with_suffix(f".{me}.tmp")
    tmp.write_text(json.dumps(asdict(owner)))
    tmp.replace(path)
    return path


def release(key: str) -> None:
    """This process's resources of `key` are gone: forget it (only if this process owns it)."""
    path = owner_dir() / f"{key}.json"
    o = _read(path)
    if o is not None and o.pid == os.getpid():
        path.unlink(missing_ok=True)


def forget(key: str, dirs: list[Path] | None = None) -> None:
    """`down` removed a dead owner's resources: its file goes too, wherever it is."""
    for d in owner_dirs() if dirs is None else dirs:
        try:
            (d / f"{key}.json").unlink(missing_ok=True)
        except OSError:
            pass  # another user's record: its owner's `down` (or root's) removes it


def _read(path: Path) -> Owner | None:
    try:
        raw = json.loads(path.read_text())
        return Owner(**{k: raw[k] for k in Owner.__dataclass_fields__})
    except (OSError, ValueError, TypeError, KeyError):
        return None


def read_owners(dirs: list[Path] | None = None) -> dict[str, Owner]:
    """Every recorded owner by key (a live one wins where two folders name the same key)."""
    out: dict[str, Owner] = {}
    for d in owner_dirs() if dirs is None else dirs:
        for f in sorted(d.glob("*.json")):
            o = _read(f)
            if o is not None and (o.key not in out or o.live()):
                out[o.key] = o
    return out


def live_owners(dirs: list[Path] | None = None) -> dict[str, Owner]:
    return {k: o for k, o in read_owners(dirs).items() if o.live()}


def owner_of(name: str, owners: Mapping[str, Owner]) -> Owner | None:
    """The owner of a resource named `name` (a namespace `ptb70b0-wan`, a project `ptb70b0`)."""
    for key, o in owners.items():
        if name == key or name.startswith(key + "-"):
            return o
    return None
