"""The local backend: one process per service, started and stopped by `testbed replay`."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from replay_exit import RAN

pytestmark = pytest.mark.app

FAST = [
    "--set",
    "scale.speedup=40",
    "--set",
    "scale.byte_scale=1024",
    "--set",
    "workload.output_tokens=32",
    "--set",
    "serving.stream_interval=4",
]


def _testbed(*args: str) -> list[str]:
    return [sys.executable, "-m", "testbed", *args]


def _children_of(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(p.name))
    return out


def _serve_processes(run_dir: Path) -> list[int]:
    """Processes whose command line names this run's deployment file."""
    needle = str(run_dir / "deployment.json").encode()
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if needle in (p / "cmdline").read_bytes():
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


def test_replay_cli_on_local_backend(tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = subprocess.run(
        _testbed(
            "replay",
            "--scenario",
            "paper-prfaas",
            "--requests",
            "12",
            "--rate",
            "3",
            "--out",
            str(out),
            "--json",
            "--backend",
            "local",
            *FAST,
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode in RAN, r.stderr[-2000:]
    summary = json.loads(r.stdout)
    assert summary["requests"]["total"] == 12 and summary["requests"]["completed"] == 12
    assert summary["run"]["shaping_method"] == "none"
    for f in ("run.json", "records.csv", "summary.json", "report.md", "ttft_cdf.png", "deployment.json"):
        assert (out / f).stat().st_size > 0, f
    assert len(list((out / "logs").glob("*.log"))) == 4 + 3 + 5 + 1
    assert _serve_processes(out) == []


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    "sig,started", [(signal.SIGINT, "foreground"), (signal.SIGTERM, "background")], ids=["SIGINT", "SIGTERM-background"]
)
def test_ctrl_c_or_sigterm_stops_services_and_keeps_records(tmp_path: Path, sig: signal.Signals, started: str) -> None:
    # "background": started as a shell starts `cmd &`, with SIGINT ignored; the SIGTERM that the
    # CLI turns into a Ctrl-C then did nothing and the run went on to its end (exit 0). A SIGTERM
    # in the foreground is the easier case of the same path (and the netns tests send one).
    # Arrivals over 6 wire seconds (rate 0.25 at speedup 40), a request ending ~0.3 s after it is
    # sent: when the third has ended, most are still to be sent, however busy the machine. At rate
    # 2 the whole run took ~1.5 s, and on a loaded machine it could end before the signal came.
    out = tmp_path / "run"
    proc = subprocess.Popen(
        _testbed(
            "replay",
            "--scenario",
            "paper-prfaas",
            "--requests",
            "60",
            "--rate",
            "0.25",
            "--out",
            str(out),
            "--backend",
            "local",
            *FAST,
            "--set",
            "workload.output_tokens=400",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ignore_sigint if started == "background" else None,
    )
    deadline = time.time() + 60
    records = out / "records.csv"
    # Wait until some requests have finished, so there is something to keep.
    while time.time() < deadline:
        if records.exists() and len(records.read_text().splitlines()) >= 4:
            break
        time.sleep(0.2)
    assert _serve_processes(out), "services should be running"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err[-2000:]
    assert "interrupted" in err
    assert _serve_processes(out) == []
    with records.open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 60 and len({r["request_id"] for r in rows}) == 60
    assert any(r["outcome"] == "completed" for r in rows)
    assert any(r["reason"].startswith(("interrupted", "not sent")) for r in rows)
    meta = json.loads((out / "run.json").read_text())
    assert meta["interrupted"] is True
    assert (out / "summary.json").exists() and (out / "report.md").exists()
    assert os.path.exists(out / "deployment.json")
