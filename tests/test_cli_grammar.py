"""One CLI grammar: a single-valued flag given twice is an error naming it, in every subcommand
that takes one scenario; the commands that compare scenarios take several."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.cli import build_parser

pytestmark = pytest.mark.pure

ONE_SCENARIO = [
    ["replay"],
    ["up"],
    ["sweep", "--set-grid", "x=1"],
    ["bench", "fidelity"],
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


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "--scenario", "paper-prfaas", "--out", "a", "--out", "b"],
        ["replay", "--scenario", "paper-prfaas", "--backend", "sim", "--backend", "local"],
        ["up", "--scenario", "paper-prfaas", "--trace", "a.jsonl", "--trace", "b.jsonl"],
        ["sweep", "--scenario", "paper-prfaas", "--param", "x=1", "--backend", "sim", "--backend", "local"],
        ["crosscheck", "--scenario", "paper-prfaas", "--out", "a", "--out", "b"],
        ["capacity", "--scenario", "paper-prfaas", "--backend", "sim", "--backend", "local"],
        ["plan", "--trace", "a.jsonl", "--trace", "b.jsonl"],
        ["bench", "fidelity", "--out", "a", "--out", "b"],
        ["feasibility", "--out", "a", "--out", "b"],
    ],
    ids=lambda a: f"{a[0]}{[x for x in a if x.startswith('--')][-1]}",
)
def test_out_trace_and_backend_twice_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    flag = [x for x in argv if x.startswith("--")][-1]
    with pytest.raises(SystemExit) as e:
        _parse(argv)
    assert e.value.code == 2
    assert f"{flag} given more than once" in capsys.readouterr().err


def test_one_scenario_is_taken() -> None:
    args = _parse(["replay", "--scenario", "paper-prfaas"])
    assert args.scenario == "paper-prfaas"


@pytest.mark.parametrize("cmd", [["capacity"], ["crosscheck"]])
def test_comparing_commands_take_several(cmd: list[str]) -> None:
    args = _parse([*cmd, "--scenario", "paper-prfaas", "--scenario", "paper-homogeneous"])
    assert args.scenario == ["paper-prfaas", "paper-homogeneous"]


def test_a_fault_scenario_runs_on_the_simulator(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from testbed.cli import main

    rc = main(
        [
            "replay",
            "--backend",
            "sim",
            "--scenario",
            "scenarios/faults/decode-kill.yaml",
            "--requests",
            "60",
            "--report",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0, err
    assert (tmp_path / "run" / "faults.jsonl").is_file()
    assert "## Faults" in (tmp_path / "run" / "report.md").read_text()


def test_calibrate_takes_one_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _parse(["calibrate", "--scenario", "paper-prfaas", "--scenario", "paper-homogeneous"])
    assert e.value.code == 2 and "--scenario given more than once" in capsys.readouterr().err


FAULTS = "scenarios/faults/decode-kill.yaml"


@pytest.mark.parametrize(
    "cmd",
    [
        ["replay", "--backend", "inproc", "--requests", "2", "--compare", "paper-prfaas", FAULTS],
        ["sweep", "--backend", "inproc", "--requests", "2", "--scenario", FAULTS, "--param", "policy.threshold=1,2"],
    ],
    ids=lambda c: c[0],
)
def test_a_fault_scenario_is_refused_before_anything_runs(
    cmd: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from testbed.cli import main

    out = tmp_path / "out"
    rc = main([*cmd, "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] == [err.splitlines()[-1]], err
    assert "faults[0].kind='kill'" in err and "Traceback" not in err
    assert not out.exists() or not any(out.rglob("run.json")), sorted(out.rglob("*"))


RUN_COMMANDS = [
    ["replay", "--scenario", "paper-prfaas"],
    ["up", "--scenario", "paper-prfaas"],
    ["capacity", "--scenario", "paper-prfaas"],
    ["sweep", "--scenario", "paper-prfaas", "--param", "x=1"],
    ["crosscheck", "--scenario", "paper-prfaas"],
]
ONCE = [
    ["--speedup", "2", "--speedup", "4"],
    ["--seed", "1", "--seed", "2"],
    ["--requests", "5", "--requests", "6"],
    ["--trace", "a.jsonl", "--trace", "b.jsonl"],
    ["--window", "0:10", "--window", "0:20"],
    ["--sample", "3", "--sample", "4"],
    ["--format", "mooncake", "--format", "azure"],
]


@pytest.mark.parametrize("flags", ONCE, ids=lambda f: f[0])
@pytest.mark.parametrize("cmd", RUN_COMMANDS, ids=lambda c: c[0])
def test_every_run_command_refuses_a_run_flag_twice(
    cmd: list[str], flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        _parse([*cmd, *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{flags[0]} given more than once" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("cmd", RUN_COMMANDS, ids=lambda c: c[0])
def test_every_run_command_takes_the_same_run_flags(cmd: list[str]) -> None:
    args = _parse(
        [
            *cmd,
            "--trace",
            "t.jsonl",
            "--format",
            "mooncake",
            "--window",
            "0:60",
            "--sample",
            "5",
            "--seed",
            "3",
            "--speedup",
            "2",
            "--requests",
            "4",
            "--keep-failed",
            "--trace-model",
            "GPT-4",
        ]
    )
    got = {
        k: getattr(args, k)
        for k in ("trace", "format", "window", "sample", "seed", "speedup", "requests", "keep_failed", "trace_models")
    }
    assert got == {
        "trace": "t.jsonl",
        "format": "mooncake",
        "window": (0.0, 60.0),
        "sample": 5,
        "seed": 3,
        "speedup": "2",
        "requests": 4,
        "keep_failed": True,
        "trace_models": ["GPT-4"],
    }


@pytest.mark.parametrize(
    "cmd",
    [
        ["capacity", "--scenario", "paper-prfaas"],
        ["sweep", "--scenario", "paper-prfaas", "--param", "x=1"],
        ["crosscheck", "--scenario", "paper-prfaas"],
    ],
    ids=lambda c: c[0],
)
def test_speedup_auto_only_where_one_run_follows(cmd: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse([*cmd, "--speedup", "auto"])
    assert "--speedup auto picks the speedup of one run" in capsys.readouterr().err
    assert _parse(["replay", "--speedup", "auto"]).speedup == "auto"


@pytest.mark.parametrize(
    "argv",
    [
        ["trace", "synth", "--requests", "1", "--rate", "1", "--out", "a", "--out", "b"],
        ["compare", "r1", "--out", "a", "--out", "b"],
        ["calibrate", "--out", "a", "--out", "b"],
        ["model", "--scenario", "paper-prfaas", "--trace", "a", "--trace", "b"],
    ],
    ids=lambda a: a[0],
)
def test_out_and_trace_twice_are_refused_in_the_other_commands(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    flag = [x for x in argv if x.startswith("--")][-1]
    with pytest.raises(SystemExit) as e:
        _parse(argv)
    assert e.value.code == 2 and f"{flag} given more than once" in capsys.readouterr().err


def test_a_parse_error_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _parse(["replay", "--speedup", "fast"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("testbed replay: error: argument --speedup:") and "testbed replay --help" in err
