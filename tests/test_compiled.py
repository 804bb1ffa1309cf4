"""The simulator's hot modules compiled by mypyc (`testbed.compiled`): a run is the same byte for
byte compiled or from the sources (`TESTBED_COMPILED=0`), run.json says which ran, and a build
older than its sources is never run (the replay says so).

The runs are skipped where the modules are not built (no C compiler), unless
TESTBED_REQUIRE_COMPILED=1 (as CI sets), where a missing build is a failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed import compiled


@pytest.mark.pure
def test_what_runs_follows_the_build_the_switch_and_the_sources() -> None:
    asked: list[int] = []

    def now(sig: str) -> object:
        def current() -> str:
            asked.append(1)
            return sig

        return current

    assert compiled.decide(None, False, None, now("a")) == "python"  # nothing built
    assert compiled.decide("a", False, None, now("a")) == "python"  # a build missing a module
    assert compiled.decide("a", True, "0", now("a")) == "python"  # turned off
    assert not asked  # the sources are read only where they decide
    assert compiled.decide("a", True, None, now("a")) == "compiled"
    assert compiled.decide("a", True, "1", now("a")) == "compiled"
    assert compiled.decide("a", True, None, now("b")) == compiled.STALE


@pytest.mark.pure
def test_the_signature_names_every_module_and_follows_a_source() -> None:
    sig = compiled.signature()
    assert [line.split()[0] for line in sig.splitlines()] == list(compiled.MODULES)
    src = compiled.source_path(compiled.MODULES[-1])
    st = src.stat()
    try:
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        assert compiled.signature() != sig
    finally:
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert compiled.signature() == sig


def _built() -> None:
    if compiled.implementation() == "compiled":
        return
    if os.environ.get("TESTBED_REQUIRE_COMPILED") == "1":
        raise RuntimeError(
            f"TESTBED_REQUIRE_COMPILED=1 but the hot modules run as {compiled.implementation()} "
            "(make install compiles them where a C compiler is)"
        )
    pytest.skip(f"the hot modules are not compiled here ({compiled.implementation()})")


def _replay(out: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "testbed", "replay", "--backend", "sim", "--out", str(out), *args],
        check=True,
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
    )


def _files(run: Path) -> dict[str, bytes]:
    # run.json and the lock hold the process's own facts (its pid, its wall time)
    return {
        str(f.relative_to(run)): f.read_bytes()
        for f in sorted(run.rglob("*"))
        if f.is_file() and f.name not in {"run.json", ".testbed.lock"}
    }


@pytest.mark.app
@pytest.mark.parametrize(
    "args",
    [
        ("--scenario", "paper-prfaas-cache", "--requests", "1500"),
        ("--scenario", "paper-naive", "--requests", "1500"),
        ("--scenario", "paper-homogeneous", "--set", "hardware.h20.scheduler.kind=vllm", "--requests", "800"),
        ("--scenario", "scenarios/faults/wan-outage-resets.yaml", "--requests", "1500"),
        ("--scenario", "paper-prfaas", "--trace", "traces/samples/mooncake-sample.jsonl"),
    ],
    ids=["cache-moves", "naive", "vllm-scheduler", "faults", "sessions"],
)
def test_a_simulated_run_is_the_same_compiled_or_from_the_sources(tmp_path: Path, args: tuple[str, ...]) -> None:
    _built()
    a, b = tmp_path / "compiled", tmp_path / "python"
    _replay(a, {compiled.ENV: "1"}, *args)
    _replay(b, {compiled.ENV: "0"}, *args)
    fa, fb = _files(a), _files(b)
    assert set(fa) == set(fb) and "summary.json" in fa
    for f in fa:
        assert fa[f] == fb[f], f
    assert json.loads((a / "run.json").read_text())["sim"]["modules"] == "compiled"
    assert json.loads((b / "run.json").read_text())["sim"]["modules"] == "python"


@pytest.mark.app
def test_a_build_older_than_a_source_runs_the_sources_and_says_so(tmp_path: Path) -> None:
    _built()
    src = compiled.source_path("testbed.sim.decode")
    st = src.stat()
    try:
        # A source edited since the build: its modification time is what tells.
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        done = _replay(tmp_path / "run", {}, "--scenario", "paper-prfaas", "--requests", "50")
    finally:
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert compiled.STALE_NOTE in done.stderr
    assert json.loads((tmp_path / "run" / "run.json").read_text())["sim"]["modules"] == compiled.STALE
