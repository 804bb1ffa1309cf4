"""The analysis notebooks execute cleanly on tiny generated inputs (the `analysis` extra)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from replay_exit import RAN, replay_until_valid

from testbed.cli import main

nbformat = pytest.importorskip("nbformat", reason="needs the analysis extra: pip install -e '.[analysis]'")
nbclient = pytest.importorskip("nbclient", reason="needs the analysis extra: pip install -e '.[analysis]'")
pytest.importorskip("pandas", reason="needs the analysis extra: pip install -e '.[analysis]'")

# Execution runs ~25 s here (five tiny replays, three kernels): under 60 s, so the app tier.

ANALYSIS = Path(__file__).resolve().parent.parent / "analysis"
NOTEBOOKS = ("paper_comparison", "link_usage", "threshold_sweep", "feasibility_map")
INPUT = {
    "paper_comparison": "RUNS_DIR",
    "link_usage": "RUN_DIR",
    "threshold_sweep": "SWEEP_DIR",
    "feasibility_map": "MAP_DIR",
}
FAST = [
    "--backend",
    "inproc",
    "--set",
    "scale.speedup=40",
    "--set",
    "workload.output_tokens=16",
    "--set",
    "serving.stream_interval=4",
    "--requests",
    "6",
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nb")
    cmp_dir, sweep_dir = root / "compare", root / "sweep"
    assert (
        replay_until_valid(
            [
                "replay",
                "--compare",
                "paper-homogeneous",
                "paper-prfaas",
                "paper-naive",
                *FAST,
                "--out",
                str(cmp_dir),
                "--json",
            ]
        )
        in RAN
    )
    assert (
        main(
            [
                "sweep",
                "--scenario",
                "paper-prfaas",
                "--param",
                "policy.threshold=10000,40000",
                *FAST,
                "--out",
                str(sweep_dir),
                "--json",
            ]
        )
        == 0
    )
    map_dir = root / "map"
    assert (
        main(
            [
                "feasibility",
                "--model",
                "kimi-linear",
                "--model",
                "minimax-m2.5",
                "--rates",
                "10,100",
                "--rtts",
                "30,150",
                "--sim",
                "none",
                "--no-break-even",
                "--out",
                str(map_dir),
                "--json",
            ]
        )
        == 0
    )
    return {"RUNS_DIR": cmp_dir, "RUN_DIR": cmp_dir / "paper-prfaas", "SWEEP_DIR": sweep_dir, "MAP_DIR": map_dir}


@pytest.mark.pure
def test_notebooks_only_read_run_files() -> None:
    for name in NOTEBOOKS:
        nb = nbformat.read(ANALYSIS / f"{name}.ipynb", as_version=4)
        nbformat.validate(nb)
        assert nb.metadata.kernelspec.name == "python3"
        src = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
        assert "import testbed" not in src and "from testbed" not in src
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), f"{name}: outputs committed"


@pytest.mark.app
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(
    name: str, inputs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for var, path in inputs.items():
        monkeypatch.setenv(var, str(path))
    capsys.readouterr()
    nb = nbformat.read(ANALYSIS / f"{name}.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ANALYSIS)}}
    )
    # The kernel inherits the variables above; raises CellExecutionError naming the cell if any cell fails.
    client.execute()
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, f"{name}: no figure drawn"
    text = json.dumps([c.outputs for c in nb.cells if c.cell_type == "code"])
    assert str(inputs[INPUT[name]]) in text
