"""Files a user names that are no input: not UTF-8, a device, a FIFO, a directory, too large.
Each is refused with one line naming the file and why, instead of a traceback, a hang or a read
that never ends. /dev/null stands for a device: read, it ends at once, so the old behaviour
(an empty file taken as input) shows without eating memory as /dev/zero did."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed.cli import main
from testbed.config.input_files import MAX_CONFIG_BYTES
from testbed.config.profiles import ProfileError, load_profile
from testbed.config.scenarios import ScenarioError, load_scenario
from testbed.core.errors import UserError
from testbed.hardware.measurements import MeasurementError, read_aiperf, read_prefill_csv, read_vllm
from testbed.metrics.regress import RegressError, load_baseline
from testbed.traces.loader import load_trace
from testbed.traces.types import TraceError

pytestmark = pytest.mark.pure

DEVICE = "/dev/null"


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    """A FIFO nobody writes to. Should a reader open it (the old code did, and blocked), a
    watchdog opens and closes its writing end every 3 s: the open returns, the read sees EOF,
    and the test fails on what was loaded rather than hanging."""
    p = tmp_path / "pipe.yaml"
    os.mkfifo(p)
    done = threading.Event()

    def unblock() -> None:
        while not done.wait(3.0):
            _release_reader(p)

    t = threading.Thread(target=unblock, daemon=True)
    t.start()
    yield p
    done.set()
    t.join()


def _release_reader(p: Path) -> None:
    """Open and close the writing end, if a reader waits (else the open fails with ENXIO)."""
    try:
        os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def _refused(load: Callable[[], Any], error: type[Exception], text: str) -> str:
    t0 = time.monotonic()
    with pytest.raises(error) as e:
        load()
    assert time.monotonic() - t0 < 2.5, "refused only after the watchdog unblocked the open"
    assert isinstance(e.value, UserError) or error is RegressError  # regress prints its own one line
    msg = str(e.value)
    assert text in msg and "\n" not in msg, msg
    return msg


def test_a_scenario_that_is_not_utf8_is_one_line_naming_the_byte(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = tmp_path / "latin1.yaml"
    p.write_bytes(b"name: caf\xe9\n")
    rc = main(["replay", "--scenario", str(p), "--backend", "sim", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.strip().splitlines() == [f"error: {p}: not UTF-8 at byte 9 (invalid continuation byte)"], err


def test_a_device_as_scenario_or_profile_is_refused() -> None:
    assert _refused(lambda: load_scenario(DEVICE), ScenarioError, "not a regular file (character device)").startswith(
        DEVICE
    )
    _refused(lambda: load_profile(DEVICE), ProfileError, f"{DEVICE}: not a regular file (character device)")


def test_a_fifo_as_scenario_or_profile_is_refused_without_opening_it(fifo: Path) -> None:
    _refused(lambda: load_scenario(fifo), ScenarioError, f"{fifo}: not a regular file (FIFO)")
    _refused(lambda: load_profile(fifo), ProfileError, f"{fifo}: not a regular file (FIFO)")


def test_an_oversized_scenario_is_refused_before_it_is_read(tmp_path: Path) -> None:
    p = tmp_path / "huge.yaml"
    with p.open("wb") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)  # sparse: nothing to write, and reading it would fail otherwise
    _refused(lambda: load_scenario(p), ScenarioError, f"{p}: larger than 16 MiB")
    p.write_text("name: x\n" + "#" * 100 + "\n")
    with pytest.raises(ScenarioError, match="invalid scenario"):  # a small file is read as before
        load_scenario(p)


def test_a_scenario_extending_a_device_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "child.yaml"
    p.write_text(f"extends: {DEVICE}\n")
    _refused(lambda: load_scenario(p), ScenarioError, f"{DEVICE}: not a regular file (character device)")


@pytest.mark.parametrize("fmt", ["mooncake", "azure", "burstgpt", "auto"])
def test_a_device_or_directory_as_trace_is_refused(fmt: str, tmp_path: Path) -> None:
    _refused(lambda: load_trace(DEVICE, fmt), TraceError, f"{DEVICE}: not a regular file (character device)")
    _refused(lambda: load_trace(tmp_path, fmt), TraceError, f"{tmp_path}: not a regular file (directory)")


@pytest.mark.parametrize("fmt", ["mooncake", "azure", "auto"])
def test_a_fifo_as_trace_is_refused_without_opening_it(fmt: str, fifo: Path) -> None:
    _refused(lambda: load_trace(fifo, fmt), TraceError, f"{fifo}: not a regular file (FIFO)")


def test_trace_info_on_a_device_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["trace", "info", DEVICE, "--format", "mooncake"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().splitlines() == [f"trace info: {DEVICE}: not a regular file (character device)"], err


def test_calibration_inputs_refuse_devices_and_fifos(fifo: Path) -> None:
    for read in (read_prefill_csv, read_aiperf, read_vllm):
        _refused(lambda read=read: read(DEVICE), MeasurementError, f"{DEVICE}: not a regular file (character device)")
        _refused(lambda read=read: read(fifo), MeasurementError, f"{fifo}: not a regular file (FIFO)")


def test_an_oversized_measurement_table_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "prefill.csv"
    with p.open("wb") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)
    _refused(lambda: read_prefill_csv(p), MeasurementError, f"{p}: larger than 16 MiB")


def test_a_regression_baseline_must_be_a_regular_file() -> None:
    _refused(lambda: load_baseline(Path(DEVICE)), RegressError, f"{DEVICE}: not a regular file (character device)")
