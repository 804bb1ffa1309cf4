"""Whole simulated runs with the compiled mechanisms and without (`TESTBED_NATIVE=0`): the run
directory reads the same byte for byte -- records, summary, decisions, time series -- and
run.json says which ran. Cache-aware routing with cache moves, WAN transfers with transfer-cache
holds, every prefill crossing, and a run with faults (the Python network, the other twins).

Skipped where the extension is not built, unless TESTBED_REQUIRE_NATIVE=1 (as CI sets)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from native_ext import required

required()


def _replay(tmp: Path, name: str, scenario: str, compiled: bool) -> Path:
    out = tmp / name
    env = dict(os.environ, TESTBED_NATIVE="1" if compiled else "0")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "testbed",
            "replay",
            "--scenario",
            scenario,
            "--backend",
            "sim",
            "--requests",
            "1500",
            "--out",
            str(out),
        ],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    return out


# What differs between two runs of the same inputs by design: the process's own facts (run.json)
# and its directory lock (its pid and start).
PROCESS_FILES = {"run.json", ".testbed.lock"}


def _files(run: Path) -> dict[str, bytes]:
    return {
        str(f.relative_to(run)): f.read_bytes()
        for f in sorted(run.rglob("*"))
        if f.is_file() and f.name not in PROCESS_FILES
    }


@pytest.mark.app
@pytest.mark.parametrize(
    "scenario", ["paper-prfaas-cache", "paper-prfaas", "paper-naive", "scenarios/faults/wan-outage-resets.yaml"]
)
def test_a_simulated_run_is_the_same_compiled_or_not(tmp_path: Path, scenario: str) -> None:
    a, b = _replay(tmp_path, "native", scenario, True), _replay(tmp_path, "python", scenario, False)
    fa, fb = _files(a), _files(b)
    assert set(fa) == set(fb) and "records.csv" in fa and "summary.json" in fa
    for f in fa:
        assert fa[f] == fb[f], f
    summary = json.loads(fa["summary.json"])
    assert summary["requests"]["completed"] > 0
    assert json.loads((a / "run.json").read_text())["sim"]["mechanisms"] == "native"
    assert json.loads((b / "run.json").read_text())["sim"]["mechanisms"] == "python"
