"""Typed run artefacts: `schema_version` on summary.json and run.json, files of older code read
as version 1, newer and malformed files refused in one line, and the models held to what a real
replay writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from summaries import summary_figures

from testbed.cli import main
from testbed.core.errors import UserError
from testbed.metrics.artefacts import RUN_VERSION, SUMMARY_VERSION, RunDirError, RunInfo, Summary, read_artefact
from testbed.metrics.summary import read_run_info, read_summary

pytestmark = pytest.mark.pure

RUN_JSON = {
    "name": "ci",
    "scenario": "paper-prfaas",
    "policy": "prfaas",
    "backend": "sim",
    "t0": 0.0,
    "t_end": 8.0,
    "scale": {"speedup": 10, "byte_scale": 256},
    "shaping": {"method": "sim"},
}


def _write(d: Path, summary: dict[str, Any], run: dict[str, Any] = RUN_JSON) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "summary.json").write_text(json.dumps(summary))
    (d / "run.json").write_text(json.dumps(run))
    return d


def _v1(figures: dict[str, Any]) -> dict[str, Any]:
    """The same figures as the writer before `schema_version` wrote them."""
    return {k: v for k, v in figures.items() if k != "schema_version"}


def _regress(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(["regress", *argv])
    out, err = capsys.readouterr()
    return rc, out + err


def test_a_file_without_schema_version_reads_as_version_1(tmp_path: Path) -> None:
    d = _write(tmp_path / "old", _v1(summary_figures()), {k: v for k, v in RUN_JSON.items()})
    s = read_summary(d)
    assert s.schema_version == 1 and s.layout == 2 and s.ttft_s.mean == 2.5
    assert read_run_info(d).schema_version == 1
    # Written again, only `schema_version` is what is new.
    assert {**s.to_json_dict(), "schema_version": SUMMARY_VERSION} == summary_figures()


def _v3(figures: dict[str, Any], warn: bool = False) -> dict[str, Any]:
    """The same figures as version 3 wrote them: `fidelity.warn` beside `validity`."""
    return {**figures, "schema_version": 3, "fidelity": {**figures["fidelity"], "warn": warn}}


def test_a_version_3_summary_with_fidelity_warn_reads_and_regresses_against_a_version_4_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = _write(tmp_path / "v3", _v3(summary_figures(), warn=True))
    s = read_summary(old)
    assert s.schema_version == 3 and s.fidelity.warn is True and s.valid  # validity is the verdict
    new = _write(tmp_path / "v4", summary_figures())
    assert "warn" not in read_summary(new).to_json_dict()["fidelity"]
    baseline = tmp_path / "baseline.yaml"
    rc, text = _regress(capsys, str(old), "--baseline", str(baseline), "--update")
    assert rc == 0, text
    rc, text = _regress(capsys, str(new), "--baseline", str(baseline))
    assert rc == 0, text


@pytest.mark.parametrize("baseline_from", ["v1", "v2"])
def test_regress_of_a_v1_summary_against_a_v2_one_with_identical_figures_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], baseline_from: str
) -> None:
    v2 = _write(tmp_path / "v2", summary_figures())
    v1 = _write(tmp_path / "v1", _v1(summary_figures()))
    ref, run = (v1, v2) if baseline_from == "v1" else (v2, v1)
    baseline = tmp_path / "baseline.yaml"
    rc, text = _regress(capsys, str(ref), "--baseline", str(baseline), "--update")
    assert rc == 0, text
    rc, text = _regress(capsys, str(run), "--baseline", str(baseline))
    assert rc == 0, text
    assert "regress: PASS, 9 metrics within tolerance" in text and "warning" not in text


def test_a_newer_version_is_refused_naming_file_and_version(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _write(tmp_path / "new", summary_figures(schema_version=SUMMARY_VERSION + 1))
    with pytest.raises(RunDirError) as e:
        read_summary(d)
    assert str(e.value) == (
        f"{d / 'summary.json'}: schema_version {SUMMARY_VERSION + 1} is newer than this testbed reads "
        f"(up to {SUMMARY_VERSION}); "
        "update the testbed to read it"
    )
    assert isinstance(e.value, UserError)
    rc, text = _regress(capsys, str(d), "--baseline", str(tmp_path / "b.yaml"), "--update")
    assert rc == 2 and f"schema_version {SUMMARY_VERSION + 1} is newer" in text
    (d / "run.json").write_text(json.dumps({**RUN_JSON, "schema_version": 9}))
    with pytest.raises(RunDirError, match=r"run\.json: schema_version 9 is newer"):
        read_run_info(d)


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"ttft_s__mean": "slow"}, "ttft_s.mean: Input should be a valid number, unable to parse string as a number"),
        ({"requests__total": None}, "requests.total: Input should be a valid integer"),
        ({"run__colour": "red"}, "run.colour: Extra inputs are not permitted"),
        ({"schema_version": "2"}, "schema_version: expected an integer, got '2'"),
    ],
)
def test_a_malformed_summary_is_one_line_naming_file_and_field(
    tmp_path: Path, over: dict[str, Any], field: str
) -> None:
    d = _write(tmp_path / "bad", summary_figures(**over))
    with pytest.raises(RunDirError) as e:
        read_summary(d)
    assert str(e.value) == f"{d / 'summary.json'}: {field}" and "\n" not in str(e.value)


def test_a_malformed_run_json_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _write(tmp_path / "bad", summary_figures(), {**RUN_JSON, "t0": "soon"})
    with pytest.raises(RunDirError, match=r"run\.json: t0: Input should be a valid number"):
        read_run_info(d)
    (d / "summary.json").unlink()
    assert main(["report", str(d)]) == 2
    assert "run.json: t0: Input should be a valid number" in capsys.readouterr().err


def test_keys_named_by_nodes_and_links_are_open_their_values_are_not(tmp_path: Path) -> None:
    link = summary_figures()["links"]["prfaas-p0{dest=127.0.0.1:4000}"]
    s = Summary.model_validate(
        summary_figures(
            links={"any-node{dest=x}": link, "other": link}, requests__failure_reasons={"timeout": 2, "reset": 1}
        )
    )
    assert set(s.links) == {"any-node{dest=x}", "other"} and s.requests.failure_reasons["reset"] == 1
    d = _write(tmp_path / "bad", summary_figures(links={"n": {**link, "extra": 1}}))
    with pytest.raises(RunDirError, match=r"links\.n\.extra: Extra inputs are not permitted"):
        read_summary(d)
    # run.json's shaping holds each backend's own facts: open there, typed where it is read.
    info = RunInfo.model_validate(
        {
            **RUN_JSON,
            "shaping": {
                "method": "tbf",
                "prefix": "ptb1",
                "tcp": {"cc": "bbr"},
                "links": {"a->b": {"rate_bps_wire": 1e6, "ifname": "v0"}},
            },
        }
    )
    assert info.shaping.method == "tbf" and info.shaping.links["a->b"].rate_bps_wire == 1e6
    assert info.to_json_dict()["shaping"]["tcp"] == {"cc": "bbr"}


def test_every_file_a_sim_replay_writes_validates_strictly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert (
        main(
            [
                "replay",
                "--backend",
                "sim",
                "--scenario",
                "paper-prfaas",
                "--set",
                "workload.requests=40",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    capsys.readouterr()
    summaries = sorted(out.rglob("summary.json"))
    assert summaries
    for path in summaries:
        raw = json.loads(path.read_text())
        s = read_artefact(path, Summary)  # unknown keys anywhere but named sections are errors
        assert raw["schema_version"] == SUMMARY_VERSION and s.schema_version == SUMMARY_VERSION
        # Nothing dropped, added or coerced on the way through the model: the model is the file.
        assert s.to_json_dict() == raw
        run_path = path.parent / "run.json"
        run_raw = json.loads(run_path.read_text())
        info = read_artefact(run_path, RunInfo)
        assert run_raw["schema_version"] == RUN_VERSION and info.to_json_dict() == run_raw
        assert info.sim is not None and info.sim.events > 0 and s.requests.total == 40


def test_the_notebooks_read_the_versions_the_testbed_writes() -> None:
    # The notebooks do not import the package: their copy of the version rule must follow it.
    import re

    root = Path(__file__).resolve().parent.parent / "analysis"
    for nb in sorted(root.glob("*.ipynb")):
        for m in re.finditer(r"KNOWN_SCHEMA_VERSION = (\d+)", nb.read_text()):
            assert int(m.group(1)) == max(SUMMARY_VERSION, RUN_VERSION), nb.name
