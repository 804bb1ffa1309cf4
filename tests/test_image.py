"""The container image: built offline if needed, it holds the project, its scenarios and profiles."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.deploy.image import (
    HEALTHCHECK_CODE,
    IMAGE,
    SOURCE_LABEL,
    ImageError,
    _stream,
    ensure_image,
    image_labels,
    source_files,
    source_hash,
)

pytestmark = pytest.mark.docker


def _engine_reachable() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_engine = pytest.mark.skipif(
    not _engine_reachable(), reason="no Docker engine (`docker info` fails or no docker CLI)"
)
_names = itertools.count()


# -- the source hash (no engine needed) --------------------------------------------------------


def _tree(root: Path) -> None:
    files = {
        "pyproject.toml": "[project]\nname = 'x'\n",
        "compose/Dockerfile": "FROM scratch\n",
        "compose/README.md": "not in the image\n",
        "testbed/__init__.py": "",
        "testbed/sub/mod.py": "X = 1\n",
        "testbed/__pycache__/mod.py": "cache\n",
        "testbed/data.txt": "not python\n",
        "scenarios/a.yaml": "name: a\n",
        "netem_profiles/lan.yaml": "rate: 1gbit\n",
        "notes.txt": "elsewhere\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


@pytest.mark.pure
def test_source_hash_covers_exactly_the_image_sources(tmp_path: Path) -> None:
    _tree(tmp_path)
    assert [p.as_posix() for p in source_files(tmp_path)] == [
        "compose/Dockerfile",
        "netem_profiles/lan.yaml",
        "pyproject.toml",
        "scenarios/a.yaml",
        "testbed/__init__.py",
        "testbed/sub/mod.py",
    ]
    h = source_hash(tmp_path)
    assert len(h) == 64 and h == source_hash(tmp_path)

    # Not covered, or only touched: same hash.
    (tmp_path / "notes.txt").write_text("changed\n")
    (tmp_path / "compose/README.md").write_text("changed\n")
    (tmp_path / "testbed/__pycache__/mod.py").write_text("changed\n")
    os.utime(tmp_path / "testbed/sub/mod.py", (1, 1))
    assert source_hash(tmp_path) == h

    # Content, a new file, a rename, the Dockerfile: each changes it.
    seen = {h}
    for change in (
        lambda: (tmp_path / "testbed/sub/mod.py").write_text("X = 2\n"),
        lambda: (tmp_path / "testbed/new.py").write_text(""),
        lambda: (tmp_path / "testbed/new.py").rename(tmp_path / "testbed/new2.py"),
        lambda: (tmp_path / "compose/Dockerfile").write_text("FROM scratch\nLABEL a=b\n"),
        lambda: (tmp_path / "scenarios/a.yaml").write_text("name: b\n"),
    ):
        change()
        now = source_hash(tmp_path)
        assert now not in seen
        seen.add(now)


@pytest.mark.pure
def test_source_hash_separates_path_from_content(tmp_path: Path) -> None:
    (tmp_path / "testbed").mkdir()
    (tmp_path / "testbed/ab.py").write_text("c")
    first = source_hash(tmp_path)
    (tmp_path / "testbed/ab.py").unlink()
    (tmp_path / "testbed/a.py").write_text("bc")
    assert source_hash(tmp_path) != first


@pytest.mark.pure
def test_a_failed_step_streams_its_output_and_raises_with_the_last_lines(tmp_path: Path) -> None:
    lines: list[str] = []
    with pytest.raises(ImageError) as err:
        _stream(
            ["sh", "-c", "for i in $(seq 100); do echo line $i; done; echo oops >&2; exit 3"],
            "wheelhouse",
            lines.append,
            tmp_path,
        )
    assert lines == [f"line {i}" for i in range(1, 101)] + ["oops"]
    msg = str(err.value)
    assert msg.startswith("wheelhouse failed (exit 3); last lines:\n")
    assert msg.endswith("line 100\noops") and "line 70\n" not in msg


# -- the image ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def image() -> str:
    if not _engine_reachable():
        pytest.skip("no Docker engine (`docker info` fails or no docker CLI)")
    lines: list[str] = []
    t0 = time.monotonic()
    name = ensure_image(log=lines.append)
    took = time.monotonic() - t0
    print(f"ensure_image: {took:.1f} s; " + "; ".join(ln for ln in lines if ln.startswith("image:")))
    return name


@pytest.fixture
def run(image: str) -> Iterator[_Runner]:
    r = _Runner(image)
    try:
        yield r
    finally:
        for name in r.names:
            subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)


class _Runner:
    def __init__(self, image: str) -> None:
        self.image = image
        self.names: list[str] = []

    def __call__(
        self, *args: str, entrypoint: str | None = None, timeout: float = 180.0
    ) -> subprocess.CompletedProcess[str]:
        name = f"ptb-imgtest-{os.getpid()}-{next(_names)}"
        self.names.append(name)
        argv = ["docker", "run", "--rm", "--name", name]
        if entrypoint is not None:
            argv += ["--entrypoint", entrypoint]
        return subprocess.run([*argv, self.image, *args], capture_output=True, text=True, timeout=timeout)


@needs_engine
def test_image_matches_the_sources(image: str) -> None:
    assert image == IMAGE
    labels = image_labels(IMAGE)
    assert labels is not None and labels.get(SOURCE_LABEL) == source_hash()
    lines: list[str] = []
    t0 = time.monotonic()
    ensure_image(log=lines.append)  # up to date: no build, quick
    assert time.monotonic() - t0 < 10
    assert lines == [f"image: {IMAGE} is up to date (sources {source_hash()[:12]})"]


@needs_engine
def test_help_lists_the_subcommands(run: _Runner) -> None:
    r = run("--help")
    assert r.returncode == 0, r.stderr
    for sub in ("replay", "serve", "model", "trace", "report", "down"):
        assert sub in r.stdout


@needs_engine
def test_model_reads_the_shipped_scenarios(run: _Runner) -> None:
    r = run("model", "--scenario", "paper-prfaas", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    (sc,) = [s for s in out["scenarios"] if s["scenario"] == "paper-prfaas"]
    assert sc["lambda_max"] == pytest.approx(3.18, abs=0.01)


@needs_engine
def test_every_role_has_what_it_needs(run: _Runner) -> None:
    """WAN router: the delay line module, pyroute2, iproute2; every role: the link profiles."""
    script = (
        "set -e; ip -V; python3 -c 'import testbed.net.delayline, pyroute2'; "
        "python3 -c 'from testbed.config.profiles import load_profile; load_profile(\"cross-region-100g\")'; "
        "python3 -c 'import importlib.metadata as m; print(m.version(\"prfaas-testbed\"))'; "
        "test -f /app/traces/samples/mooncake-sample.jsonl"
    )
    r = run("-c", script, entrypoint="sh")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "iproute2" in r.stdout and "0.1.0" in r.stdout


@needs_engine
def test_healthcheck_command(run: _Runner) -> None:
    """The documented health check: 0 when the URL answers 2xx, non-zero on 404 or a closed port."""
    probe = f"python3 -c '{HEALTHCHECK_CODE}'"
    script = (
        "python3 -m http.server --bind 127.0.0.1 8000 >/dev/null 2>&1 & "
        "for i in $(seq 50); do " + probe + " http://127.0.0.1:8000/ 2>/dev/null && break; sleep 0.1; done; "
        f"{probe} http://127.0.0.1:8000/; echo ok=$?; "
        f"{probe} http://127.0.0.1:8000/health 2>/dev/null; echo missing=$?; "
        f"{probe} http://127.0.0.1:8001/health 2>/dev/null; echo closed=$?"
    )
    r = run("-c", script, entrypoint="sh")
    assert r.returncode == 0, r.stderr
    assert "ok=0" in r.stdout and "missing=1" in r.stdout and "closed=1" in r.stdout
