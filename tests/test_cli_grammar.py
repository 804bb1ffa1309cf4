"""One CLI grammar: a single-valued flag given twice is an error naming it, in every subcommand
that takes one scenario; the commands that compare scenarios take several."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.cli import build_parser

pytestmark = pytest.mark.pure

ONE_SCENARIO = [
    ["replay"], ["up"], ["sweep", "--set-grid", "x=1"], ["bench", "fidelity"],
]


def _parse(argv: list[str]) -> object:
    return build_parser(argv).parse_args(argv)


@pytest.mark.parametrize("cmd", ONE_SCENARIO, ids=lambda c: c[0])
def test_scenario_twice_is_refused_naming_the_flag(cmd: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = [cmd[0], "--scenario", "paper-prfaas", "--scenario", "paper-homogeneous", *cmd[1:]]
    with pytest.raises(SystemExit) as e:
        _parse(argv)
    assert e.value.code == 2
    assert "--scenario given more than once" in capsys.readouterr().err



@pytest.mark.parametrize("argv", [
    ["replay", "--scenario", "paper-prfaas", "--out", "a", "--out", "b"],
    ["replay", "--scenario", "paper-prfaas", "--backend", "sim", "--backend", "local"],
    ["up", "--scenario", "paper-prfaas", "--trace", "a.jsonl", "--trace", "b.jsonl"],
    ["sweep", "--scenario", "paper-prfaas", "--param", "x=1", "--backend", "sim", "--backend", "local"],
    ["crosscheck", "--scenario", "paper-prfaas", "--out", "a", "--out", "b"],
    ["capacity", "--scenario", "paper-prfaas", "--backend", "sim", "--backend", "local"],
    ["plan", "--trace", "a.jsonl", "--trace", "b.jsonl"],
    ["bench", "fidelity", "--out", "a", "--out", "b"],
    ["feasibility", "--out", "a", "--out", "b"],
], ids=lambda a: f"{a[0]}{[x for x in a if x.startswith('--')][-1]}")
def test_out_trace_and_backend_twice_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    flag = [x for x in argv if x.startswith("--")][-1]
    with pytest.raises(SystemExit) as e:
        _parse(argv)
    assert e.value.code == 2
    assert f"{flag} given more than once" in capsys.readouterr().err

def test_one_scenario_is_taken() -> None:
    args = _parse(["replay", "--scenario", "paper-prfaas"])
    assert getattr(args, "scenario") == "paper-prfaas"


@pytest.mark.parametrize("cmd", [["capacity"], ["crosscheck"]])
def test_comparing_commands_take_several(cmd: list[str]) -> None:
    args = _parse([*cmd, "--scenario", "paper-prfaas", "--scenario", "paper-homogeneous"])
    assert getattr(args, "scenario") == ["paper-prfaas", "paper-homogeneous"]


def test_a_fault_scenario_is_refused_by_the_simulator(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    from testbed.cli import main

    rc = main(["replay", "--backend", "sim", "--scenario", "scenarios/faults/decode-kill.yaml",
               "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "field 'faults'" in err and "netns" in err, err


def test_calibrate_takes_one_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _parse(["calibrate", "--scenario", "paper-prfaas", "--scenario", "paper-homogeneous"])
    assert e.value.code == 2 and "--scenario given more than once" in capsys.readouterr().err


FAULTS = "scenarios/faults/decode-kill.yaml"


@pytest.mark.parametrize("cmd", [
    ["replay", "--backend", "sim", "--requests", "2", "--compare", "paper-prfaas", FAULTS],
    ["crosscheck", "--skip-emulation", "--requests", "2", "--scenario", "paper-prfaas", "--scenario", FAULTS],
    ["sweep", "--backend", "sim", "--requests", "2", "--scenario", FAULTS, "--param", "policy.threshold=1,2"],
], ids=lambda c: c[0])
def test_a_fault_scenario_is_refused_before_anything_is_simulated(cmd: list[str], tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from testbed.cli import main

    out = tmp_path / "out"
    rc = main([*cmd, "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] == [err.splitlines()[-1]], err
    assert "field 'faults'" in err and "Traceback" not in err
    assert not out.exists() or not any(out.rglob("run.json")), sorted(out.rglob("*"))
