"""The run flags mean the same in every command that replays a workload: capacity and sweep on a
trace (--trace, --sample, --seed, --requests, --speedup, --rate) and crosscheck's --speedup are
applied as replay applies them, which each run's run.json shows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from testbed.cli import main

pytestmark = pytest.mark.app

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "traces" / "samples" / "mooncake-sample.jsonl"
# 8 of 12 requests drawn with seed 3 from the sample trace, at speedup 3.
TRACE_FLAGS = ["--trace", str(SAMPLE), "--sample", "12", "--seed", "3", "--requests", "8", "--speedup", "3"]
PICKED = f"{SAMPLE} | sample(12, seed=3) | head(8)"


def _meta(run_dir: Path) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((run_dir / "run.json").read_text())
    return meta


def test_capacity_on_a_trace_takes_the_run_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "capacity",
            "--scenario",
            "paper-prfaas",
            "--backend",
            "sim",
            *TRACE_FLAGS,
            "--probes",
            "2",
            "--lo",
            "1",
            "--hi",
            "2",
            "--out",
            str(tmp_path),
            "--json",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    probes = json.loads(out)["probes"]
    assert [p["rate"] for p in probes] == [1.0, 2.0]
    for p in probes:
        meta = _meta(Path(p["run_dir"]))
        assert meta["scale"]["speedup"] == 3.0
        assert meta["trace"] == {"source": f"{PICKED} | rescale_rate({p['rate']:g})", "requests": 8, "arrivals": "open"}
        assert meta["offered_rate"] == pytest.approx(p["rate"])


def test_sweep_on_a_trace_takes_the_run_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "sweep",
            "--scenario",
            "paper-prfaas",
            "--backend",
            "sim",
            "--param",
            "policy.threshold=10000,40000",
            *TRACE_FLAGS,
            "--rate",
            "2",
            "--out",
            str(tmp_path),
            "--json",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    points = json.loads(out)["points"]
    assert len(points) == 2
    for p in points:
        assert p["status"] == "ok" and p["requests"] == 8
        meta = _meta(tmp_path / p["run_dir"])
        assert meta["scale"]["speedup"] == 3.0 and meta["threshold"] == p["policy.threshold"]
        assert meta["trace"] == {"source": f"{PICKED} | rescale_rate(2)", "requests": 8, "arrivals": "open"}
    assert "8 requests per point at 2.00 req/s offered" in (tmp_path / "sweep.md").read_text()


def test_crosscheck_takes_speedup(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "crosscheck",
            "--scenario",
            "paper-prfaas",
            "--skip-emulation",
            "--requests",
            "4",
            "--speedup",
            "3",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    assert _meta(tmp_path / "sim")["scale"]["speedup"] == 3.0


def test_capacity_without_a_trace_seeds_the_workload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "capacity",
            "--scenario",
            "paper-prfaas",
            "--backend",
            "sim",
            "--requests",
            "6",
            "--seed",
            "11",
            "--speedup",
            "2",
            "--probes",
            "1",
            "--lo",
            "1",
            "--out",
            str(tmp_path),
            "--json",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    meta = _meta(Path(json.loads(out)["probes"][0]["run_dir"]))
    assert meta["scale"]["speedup"] == 2.0 and "seed=11" in meta["trace"]["source"]
    assert meta["trace"]["requests"] == 6
