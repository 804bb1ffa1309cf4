"""What a simulated `testbed replay` process imports: only what the command needs. The live
machinery (asyncio, the deployment), the analytical model (for a fixed threshold), pandas
(which pyarrow would import for `pa.array` of a list), pyarrow itself (a short run writes no
Parquet) and the installed version (`--version` only) each cost a whole process tens to hundreds
of milliseconds, a large share of a short run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.app

UNNEEDED = (
    "pandas",
    "pyarrow",
    "asyncio",
    "testbed.live.deployment",
    "testbed.model.optimise",
    "matplotlib",
)
# Not `secrets` and `hashlib`: the testbed's own path needs neither (a lock's token is os.urandom),
# but pydantic's releases differ in whether `pydantic.types` imports `secrets` at start.


def test_a_simulated_replay_imports_none_of_what_it_does_not_need(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": 250 * i, "input_length": 600 + 50 * i, "output_length": 20, "hash_ids": [i]})
            + "\n"
            for i in range(8)
        )
    )
    argv = ["replay", "--scenario", "paper-homogeneous", "--backend", "sim", "--trace", str(trace)]
    argv += ["--out", str(tmp_path / "run")]
    code = (
        "import json, sys\nfrom testbed.cli import main\n"
        f"rc = main({argv!r})\n"
        f"print(json.dumps([rc, [m for m in {UNNEEDED!r} if m in sys.modules]]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    rc, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert rc == 0, out.stderr
    assert loaded == []
    run = tmp_path / "run"
    assert (run / "records.csv").is_file() and (run / "decisions.jsonl").is_file() and (run / "summary.json").is_file()
    assert not (run / "records.parquet").exists() and not (run / "decisions.parquet").exists()


def test_the_version_alone_imports_no_command() -> None:
    """`testbed --version` prints the version without any command's module (it imported them all:
    0.7 s for one line)."""
    code = (
        "import json, sys\nfrom testbed.cli import COMMAND_MODULES, main\n"
        "try:\n    main(['--version'])\nexcept SystemExit as e:\n    rc = e.code\n"
        "print(json.dumps([rc, [m for m in COMMAND_MODULES if m in sys.modules]]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    rc, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert rc == 0, out.stderr
    assert out.stdout.startswith("testbed "), out.stdout
    assert loaded == []
