"""The README's commands where a user meets them: no Docker engine, no compose plugin, no docker
at all, no root, a missing file, a bad value. Each is `python -m testbed` in a subprocess, and
each must say what is wrong in exactly one line on stderr (no traceback) and exit 2, before it
prints or writes anything else."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.config.privilege import AS_USER_ENV

pytestmark = pytest.mark.app

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = str(ROOT / "traces" / "samples" / "mooncake-sample.jsonl")
# `testbed down` here must never find another run's namespaces, whatever happens to the root check.
NOBODY = "ptbnobodysuses"

# A docker CLI whose compose plugin works (`docker compose version`) and nothing else: with it,
# a run gets past the CLI check and meets the engine.
DOCKER_WITH_COMPOSE = '#!/bin/sh\n[ "$1 $2" = "compose version" ] && exit 0\necho "docker: $1: no engine" >&2\nexit 1\n'
# A docker CLI without the compose plugin.
DOCKER_WITHOUT_COMPOSE = "#!/bin/sh\necho \"docker: '$1' is not a docker command.\" >&2\nexit 1\n"


def _bin(tmp: Path, docker: str | None) -> str:
    """PATH of a tmp dir holding only `docker` (when given) and python's own directory."""
    d = tmp / "bin"
    d.mkdir()
    if docker is not None:
        (d / "docker").write_text(docker)
        (d / "docker").chmod(0o755)
    return os.pathsep.join([str(d), str(Path(sys.executable).parent)])


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != AS_USER_ENV}
    full.update({"PYTHONPATH": str(ROOT), **env})
    return subprocess.run(
        [sys.executable, "-m", "testbed", *argv], env=full, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def _one_line(r: subprocess.CompletedProcess[str], *needles: str) -> str:
    err = r.stderr
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, err)
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# (condition, argv, what the line names); {out} is a directory that must not be created.
DOCKER_CASES = [
    (
        "no-engine",
        ["up", "--backend", "compose", "--scenario", "paper-prfaas", "--requests", "1", "--out", "{out}"],
        "no Docker engine answers at",
    ),
    (
        "no-engine",
        ["up", "--backend", "compose", "--hold", "--scenario", "paper-prfaas", "--out", "{out}"],
        "no Docker engine answers at",
    ),
    (
        "no-engine",
        ["crosscheck", "--scenario", "paper-prfaas", "--backend", "compose", "--requests", "1", "--out", "{out}"],
        "no Docker engine answers at",
    ),
    (
        "no-compose",
        ["up", "--backend", "compose", "--scenario", "paper-prfaas", "--requests", "1", "--out", "{out}"],
        "neither `docker compose` nor `docker-compose` is installed",
    ),
    (
        "no-compose",
        ["up", "--backend", "compose", "--hold", "--scenario", "paper-prfaas", "--out", "{out}"],
        "docker-compose",
    ),
    (
        "no-compose",
        ["crosscheck", "--scenario", "paper-prfaas", "--backend", "compose", "--requests", "1", "--out", "{out}"],
        "docker-compose",
    ),
    (
        "no-docker",
        ["up", "--backend", "compose", "--scenario", "paper-prfaas", "--requests", "1", "--out", "{out}"],
        "docker-compose",
    ),
    (
        "no-docker",
        ["up", "--backend", "swarm", "--scenario", "paper-prfaas", "--requests", "1", "--out", "{out}"],
        "swarm backend",
    ),
]


@pytest.mark.parametrize(
    "condition, argv, needle", DOCKER_CASES, ids=[f"{c}-{' '.join(a[:2])}" for c, a, _ in DOCKER_CASES]
)
def test_without_docker_each_command_is_one_line_and_exit_2(
    condition: str, argv: list[str], needle: str, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    if condition == "no-engine":
        env = {"PATH": _bin(tmp_path, DOCKER_WITH_COMPOSE), "DOCKER_HOST": f"unix://{tmp_path}/dead.sock"}
    elif condition == "no-compose":
        env = {"PATH": _bin(tmp_path, DOCKER_WITHOUT_COMPOSE)}
    else:
        env = {"PATH": _bin(tmp_path, None)}
    line = _one_line(_run([a.format(out=out) for a in argv], env, tmp_path), needle)
    assert line.startswith("error: ")
    if condition == "no-engine":
        assert "dead.sock" in line  # where it looked, so the user knows which engine
    assert not out.exists()  # refused before the run directory was made


ROOT_CASES = [
    (["netcaps"], "needs root"),
    (["linkcheck", "cross-region-100g"], "needs root"),
    (
        ["replay", "--backend", "netns", "--scenario", "paper-prfaas", "--requests", "1", "--out", "{out}"],
        "netns backend",
    ),
    (
        ["capacity", "--backend", "netns", "--scenario", "paper-prfaas", "--requests", "1", "--out", "{out}"],
        "netns backend",
    ),
    # crosscheck's default is auto (local without root), as everywhere: netns named explicitly.
    (
        ["crosscheck", "--scenario", "paper-prfaas", "--backend", "netns", "--requests", "1", "--out", "{out}"],
        "needs root",
    ),
    (["up", "--backend", "swarm", "--scenario", "paper-prfaas", "--requests", "1", "--out", "{out}"], "needs root"),
]


@pytest.mark.parametrize("argv, needle", ROOT_CASES, ids=[" ".join(a[:3]) for a, _ in ROOT_CASES])
def test_without_root_each_command_is_one_line_and_exit_2(argv: list[str], needle: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    # Run as root (CI, this machine), the process is told to answer as a user's would.
    env = {AS_USER_ENV: "1"} if os.geteuid() == 0 else {}
    _one_line(_run([a.format(out=out) for a in argv], env, tmp_path), needle, "run as root")
    assert not out.exists()


FILE_CASES = [
    (["report", "{tmp}/nope"], "run.json: missing"),
    (["compare", "{tmp}/nope", "{tmp}/nope2"], "run.json: missing"),
    (
        ["replay", "--scenario", "paper-prfaas", "--backend", "sim", "--trace", "{tmp}/none.jsonl", "--out", "{tmp}/r"],
        "none.jsonl",
    ),
    (
        [
            "capacity",
            "--scenario",
            "paper-prfaas",
            "--backend",
            "sim",
            "--trace",
            "{tmp}/none.jsonl",
            "--out",
            "{tmp}/r",
        ],
        "none.jsonl",
    ),
    (
        [
            "sweep",
            "--scenario",
            "paper-prfaas",
            "--backend",
            "sim",
            "--param",
            "policy.threshold=1,2",
            "--trace",
            "{tmp}/none.jsonl",
            "--out",
            "{tmp}/r",
        ],
        "none.jsonl",
    ),
    (["model", "--scenario", "no-such-scenario"], "not found"),
    (["model", "--scenario", "paper-prfaas", "--trace", "{tmp}/none.jsonl"], "none.jsonl"),
    (["model", "--bandwidth", "--length", "lots"], "not a token count"),
    (["trace", "info", "{tmp}/none.jsonl"], "none.jsonl"),
    (["plan", "--trace", "{tmp}/none.jsonl"], "none.jsonl"),
    (["replay", "--scenario", "paper-prfaas", "--speedup", "0"], "--speedup"),
    (["capacity", "--scenario", "paper-prfaas", "--seed", "3", "--trace", SAMPLE, "--backend", "sim"], "--sample"),
    (["trace", "synth", "--requests", "2", "--rate", "1", "--out", "{tmp}"], "an existing directory"),
]


@pytest.mark.parametrize("argv, needle", FILE_CASES, ids=[" ".join(a[:2]) for a, _ in FILE_CASES])
def test_a_bad_file_or_value_is_one_line_and_exit_2(argv: list[str], needle: str, tmp_path: Path) -> None:
    _one_line(_run([a.format(tmp=tmp_path) for a in argv], {}, tmp_path), needle)
    assert not (tmp_path / "r").exists()


# The root cases again, and the README's other commands a user without root meets (make
# replay-wan, an `up --hold` on netns, linkcheck --compare-methods, compose against an engine
# whose socket this user may not open), run by a real unprivileged user rather than a root
# process told to answer as one: what the kernel and the engine refuse is then the kernel's
# and the engine's own refusal.
UNPRIVILEGED_CASES = [
    *ROOT_CASES,
    (
        [
            "replay",
            "--compare",
            "paper-prfaas",
            "paper-prfaas-dense",
            "--backend",
            "netns",
            "--rate",
            "3.0",
            "--requests",
            "1",
            "--out",
            "{out}",
        ],
        "netns backend",
    ),
    (["up", "--hold", "--backend", "netns", "--scenario", "paper-prfaas"], "netns backend"),
    (["linkcheck", "--compare-methods"], "needs root"),
]
DOCKER_SOCKET = Path("/var/run/docker.sock")


def _unprivileged(request: pytest.FixtureRequest) -> tuple[list[str], dict[str, str], Path]:
    """(python argv, environment, a working directory) for user `nobody`; skip where there is none
    or this process cannot switch to it. The interpreter is this one when `nobody` may execute it;
    else (a venv over an interpreter under root's home, as pyenv's) the system's python of the
    same version with this venv's site-packages on the path."""
    import pwd
    import shutil
    import sysconfig
    import tempfile

    if os.geteuid() != 0:
        pytest.skip("switching to an unprivileged user needs root (a non-root run is covered above)")
    try:
        pw = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user `nobody` on this machine")
    # pytest's tmp_path lies under a 0700 directory of root's: the user gets one of its own.
    work = Path(tempfile.mkdtemp(prefix="ptb-unprivileged-"))
    request.addfinalizer(lambda: shutil.rmtree(work, ignore_errors=True))
    home = work / "home"
    home.mkdir()
    for d in (work, home):
        os.chown(d, pw.pw_uid, pw.pw_gid)
    env = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT)}
    candidates = [
        sys.executable,
        shutil.which(f"python{sys.version_info.major}.{sys.version_info.minor}", path="/usr/bin:/bin") or "",
    ]
    for exe in filter(None, candidates):
        extra = "" if exe == sys.executable else os.pathsep + sysconfig.get_paths()["purelib"]
        probe = (
            subprocess.run(
                [exe, "-c", "import testbed.cli"],
                user=pw.pw_uid,
                group=pw.pw_gid,
                extra_groups=[],
                env={**env, "PYTHONPATH": str(ROOT) + extra},
                cwd=work,
                capture_output=True,
                timeout=60,
            )
            if _can_exec(exe, pw.pw_uid)
            else None
        )
        if probe is not None and probe.returncode == 0:
            return [exe], {**env, "PYTHONPATH": str(ROOT) + extra}, work
    pytest.skip("no python interpreter that user `nobody` may run with this checkout")


def _can_exec(exe: str, uid: int) -> bool:
    try:
        subprocess.run([exe, "-c", ""], user=uid, extra_groups=[], capture_output=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


@pytest.mark.parametrize("argv, needle", UNPRIVILEGED_CASES, ids=[" ".join(a[:3]) for a, _ in UNPRIVILEGED_CASES])
def test_as_an_unprivileged_user_each_command_is_one_line_and_exit_2(
    argv: list[str], needle: str, request: pytest.FixtureRequest
) -> None:
    python, env, cwd = _unprivileged(request)
    out = cwd / "run"
    r = subprocess.run(
        [*python, "-m", "testbed", *(a.format(out=out) for a in argv)],
        env=env,
        cwd=cwd,
        user="nobody",
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=120,
    )
    _one_line(r, needle, "run as root")
    assert not out.exists()


def test_as_an_unprivileged_user_a_docker_socket_it_may_not_open_is_one_line(request: pytest.FixtureRequest) -> None:
    python, env, cwd = _unprivileged(request)
    if not DOCKER_SOCKET.is_socket() or DOCKER_SOCKET.stat().st_mode & 0o002:
        pytest.skip(f"no {DOCKER_SOCKET} that only its owner and group may open")
    out = cwd / "run"
    env = {**env, "PATH": _bin(cwd, DOCKER_WITH_COMPOSE)}
    env.pop("DOCKER_HOST", None)
    r = subprocess.run(
        [
            *python,
            "-m",
            "testbed",
            "up",
            "--backend",
            "compose",
            "--scenario",
            "paper-prfaas",
            "--requests",
            "1",
            "--out",
            str(out),
        ],
        env=env,
        cwd=cwd,
        user="nobody",
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=120,
    )
    _one_line(r, "permission denied", "docker")
    assert not out.exists()


@pytest.fixture
def a_namespace() -> Iterator[str]:
    """A network namespace named like a run's (a netns run killed by someone with root)."""
    if os.geteuid() != 0:
        pytest.skip("creating a network namespace needs root")
    from pyroute2 import netns  # type: ignore[import-untyped]

    name = f"{NOBODY}{os.getpid()}"
    netns.create(name)
    try:
        yield name
    finally:
        netns.remove(name)


def test_down_without_root_refuses_a_prefix_whose_namespaces_exist_and_sweeps_one_without(
    a_namespace: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Only namespaces need root: a local run's prefix is swept by its user; a netns run's is
    refused in one line, as nothing of it could be removed."""
    _one_line(_run(["down", "--prefix", a_namespace], {AS_USER_ENV: "1"}, tmp_path), "needs root", "run as root")
    python, env, cwd = _unprivileged(request)
    r = subprocess.run(
        [*python, "-m", "testbed", "down", "--prefix", a_namespace],
        env=env,
        cwd=cwd,
        user="nobody",
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=120,
    )
    _one_line(r, "needs root", "run as root")
    free = _run(["down", "--prefix", NOBODY + "free", "--json"], {AS_USER_ENV: "1"}, tmp_path)
    assert free.returncode == 0 and json.loads(free.stdout)["local_runs"] == {}, free.stderr
