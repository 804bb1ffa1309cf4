"""The backend registry: a backend registered in one call (here a toy one, in this file) is offered
by every command whose needs it meets, resolves, and replays through the normal runner path; a
scenario asking for what the chosen backend cannot honour is refused before anything starts,
naming the field and the backends that can."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from replay_exit import RAN

from testbed.cli import build_parser, main
from testbed.config.resolved import ResolvedScenario
from testbed.core.errors import UserError
from testbed.deploy import registry
from testbed.deploy.base import Backend
from testbed.deploy.cleanup import Leftovers, LiveRuns, Warn
from testbed.deploy.engine import Engine
from testbed.deploy.loopback import LoopbackBackend
from testbed.deploy.registry import BackendEntry, Capabilities
from testbed.run.load import load

TOY = "toy"
made: list[Path] = []


def _toy(rs: ResolvedScenario, run_dir: Path, extra: dict[str, Any] | None, host_port: int | None) -> Backend:
    made.append(run_dir)
    return LoopbackBackend(TOY, rs, run_dir, extra, host_port or 0, processes=False)


@pytest.fixture
def toy() -> Iterator[BackendEntry]:
    """Every service in this process under a new name: node faults declared, no hold."""
    made.clear()
    entry = registry.register(
        BackendEntry(TOY, "a toy: every service in this process", Capabilities(node_faults=True), _toy)
    )
    yield entry
    registry.unregister(TOY)


def _parses(argv: list[str]) -> Any:
    return build_parser(argv).parse_args(argv)


def _offers(argv: list[str], flag: str, name: str) -> bool:
    try:
        _parses([*argv, flag, name])
    except SystemExit:
        return False
    return True


COMMANDS = {
    "replay": (["replay", "--scenario", "paper-prfaas"], "--backend", "auto", registry.any_backend),
    "up": (["up", "--scenario", "paper-prfaas"], "--backend", "auto", registry.holds_open),
    "capacity": (["capacity", "--scenario", "paper-prfaas"], "--backend", "auto", registry.any_backend),
    "sweep": (["sweep", "--scenario", "paper-prfaas", "--param", "x=1"], "--backend", "auto", registry.any_backend),
    "crosscheck": (["crosscheck", "--scenario", "paper-prfaas"], "--backend", "auto", registry.emulates),
    "feasibility": (["feasibility"], "--confirm-backend", "auto", registry.emulates),
}


@pytest.mark.pure
@pytest.mark.parametrize("cmd", COMMANDS)
def test_backend_choices_and_defaults_come_from_the_registry(cmd: str, toy: BackendEntry) -> None:
    argv, flag, default, need = COMMANDS[cmd]
    assert getattr(_parses(argv), flag[2:].replace("-", "_")) == default
    for e in registry.entries():
        assert _offers(argv, flag, e.name) == need(e.caps), e.name
    # The toy holds nothing open: every command but `up` offers it.
    assert _offers(argv, flag, TOY) == (cmd != "up")
    assert not _offers(argv, flag, "nowhere")


@pytest.mark.pure
def test_auto_is_the_first_candidate_that_can_run(toy: BackendEntry) -> None:
    registry.unregister(TOY)
    registry.register(BackendEntry(TOY, "a toy", Capabilities(), _toy, auto_rank=-1, unavailable=lambda: None))
    assert registry.pick_backend("auto") == (TOY, None)
    registry.unregister(TOY)
    registry.register(
        BackendEntry(TOY, "a toy", Capabilities(), _toy, auto_rank=-1, unavailable=lambda: "no toy box here")
    )
    name, warning = registry.pick_backend("auto")
    assert name != TOY and (warning is None or warning.startswith("no toy box here"))
    with pytest.raises(ValueError, match="registered already"):
        registry.register(BackendEntry(TOY, "again", Capabilities(), _toy))


@pytest.mark.pure
@pytest.mark.parametrize(
    "scenario,overrides,backend,field,able",
    [
        ("scenarios/faults/decode-kill.yaml", {}, "inproc", "faults[0].kind='kill'", "netns, compose, local, sim, toy"),
        ("scenarios/faults/wan-outage-resets.yaml", {}, "local", "faults[0].kind='outage'", "netns, compose, sim"),
        ("scenarios/faults/wan-outage-resets.yaml", {}, TOY, "faults[0].kind='outage'", "netns, compose, sim"),
        (
            "paper-prfaas",
            {"links": {"inter_dc": "cross-region-100g-halving"}},
            "local",
            "links.inter_dc='cross-region-100g-halving'",
            "netns, sim",
        ),
        (
            "paper-prfaas",
            {"links": {"inter_dc": "cross-region-100g-halving"}},
            "compose",
            "links.inter_dc='cross-region-100g-halving'",
            "netns, sim",
        ),
    ],
)
def test_a_request_the_backend_cannot_honour_names_the_field_and_the_backends_that_can(
    scenario: str, overrides: dict[str, Any], backend: str, field: str, able: str, toy: BackendEntry
) -> None:
    rs = load(scenario, overrides)
    with pytest.raises(UserError) as e:
        registry.refuse_unhonoured(backend, [rs])
    msg = str(e.value)
    assert "\n" not in msg and f"scenario {rs.name!r}: {field} " in msg and f"the {backend} backend" in msg, msg
    assert msg.endswith(f"backends that can: {able}"), msg


@pytest.mark.pure
def test_what_a_backend_can_do_is_not_refused(toy: BackendEntry) -> None:
    kill = load("scenarios/faults/decode-kill.yaml")
    registry.refuse_unhonoured(TOY, [kill])
    registry.refuse_unhonoured("local", [kill])
    registry.refuse_unhonoured("netns", [load("scenarios/faults/wan-outage-resets.yaml")])
    # The simulator runs every fault kind, and deadlines, in virtual time.
    for f in ("decode-kill", "prefill-kill", "wan-outage-resets"):
        registry.refuse_unhonoured("sim", [load(f"scenarios/faults/{f}.yaml")])
    registry.refuse_unhonoured("sim", [load("paper-prfaas", {"serving": {"deadline_s": 60}})])
    # A static WAN profile on loopback is still a meaningful run (the warning says so), not refused.
    registry.refuse_unhonoured("inproc", [load("paper-prfaas")])
    registry.refuse_unhonoured("sim", [load("paper-prfaas", {"links": {"inter_dc": "cross-region-100g-halving"}})])


@pytest.mark.pure
def test_the_runner_refuses_before_any_service_starts(tmp_path: Path, toy: BackendEntry) -> None:
    from testbed.run.runner import run_replay_async
    from testbed.traces.loader import trace_from_workload

    rs = load("scenarios/faults/wan-outage-resets.yaml", {"workload": {"requests": 2}})
    with pytest.raises(UserError, match=r"faults\[0\]\.kind='outage'"):
        asyncio.run(run_replay_async(rs, trace_from_workload(rs.spec.workload), tmp_path / "run", TOY))
    assert made == [] and not (tmp_path / "run").exists()


@pytest.mark.pure
def test_replay_refuses_a_comparison_before_its_first_scenario(
    tmp_path: Path, toy: BackendEntry, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        [
            "replay",
            "--backend",
            TOY,
            "--requests",
            "2",
            "--compare",
            "paper-prfaas",
            "scenarios/faults/wan-outage-resets.yaml",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.splitlines() == [
        "error: scenario 'faults-wan-outage-resets': faults[0].kind='outage' asks for a link fault, which the toy "
        "backend cannot honour; backends that can: netns, compose, sim"
    ], err
    assert made == [] and not (tmp_path / "out").exists()


@pytest.mark.app
def test_a_registered_backend_replays_through_the_cli(
    tmp_path: Path, toy: BackendEntry, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    rc = main(
        [
            "replay",
            "--scenario",
            "paper-prfaas",
            "--backend",
            TOY,
            "--requests",
            "6",
            "--set",
            "scale.speedup=40",
            "--set",
            "workload.output_tokens=16",
            "--set",
            "serving.stream_interval=4",
            "--out",
            str(out),
            "--json",
        ]
    )
    printed, err = capsys.readouterr()
    assert rc in RAN, err
    assert made == [out]
    summary = json.loads(printed)
    assert summary["requests"]["total"] == 6 and summary["requests"]["completed"] == 6
    assert json.loads((out / "run.json").read_text())["backend"] == TOY
    from testbed.metrics.records import read_records

    recs = read_records(out / "records.csv")
    assert len(recs) == 6 and all(r.outcome == "completed" for r in recs)


def _no_toy_box() -> None:
    raise UserError("the toy backend needs a toy box: install one")


@pytest.mark.pure
@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "--scenario", "paper-prfaas"],
        ["capacity", "--scenario", "paper-prfaas"],
        ["sweep", "--scenario", "paper-prfaas", "--param", "scale.speedup=2"],
    ],
)
def test_a_backends_host_check_is_its_entrys_and_runs_before_anything(
    tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """What a backend needs of the host is declared on its entry (no chain over backend names):
    a toy whose check fails is refused in one line, exit 2, before a run directory exists."""
    made.clear()
    registry.register(BackendEntry(TOY, "a toy", Capabilities(), _toy, preflight=_no_toy_box))
    try:
        out = tmp_path / "run"
        rc = main([*argv, "--backend", TOY, "--out", str(out)])
    finally:
        registry.unregister(TOY)
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().splitlines() == ["error: the toy backend needs a toy box: install one"]
    assert made == [] and not out.exists()


@dataclass(frozen=True)
class _ToyLeftovers:
    prefix: str
    errors: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        return {"toy": [self.prefix]}

    def summary(self) -> str:
        return f"toy: swept {self.prefix}"


def _sweep_toy(prefix: str, engine: Engine | None, warn: Warn, live: LiveRuns) -> Leftovers:
    return _ToyLeftovers(prefix)


@pytest.mark.pure
def test_testbed_down_runs_each_registered_sweep_once(toy: BackendEntry) -> None:
    from testbed.deploy.cleanup import down

    before = registry.sweepers()
    assert len(before) == 3  # namespaces (netns), Docker objects (compose and swarm share it), local processes
    registry.unregister(TOY)
    for name in (TOY, "toy2"):  # two backends leaving the same kind of objects: one sweep
        registry.register(BackendEntry(name, "a toy", Capabilities(), _toy, leftovers=_sweep_toy))
    try:
        assert registry.sweepers() == [*before, _sweep_toy]
    finally:
        registry.unregister("toy2")
    report = down([_sweep_toy, _sweep_toy], "ptb1", owner_dirs=[])
    assert report.to_dict() == {"toy": ["ptb1"], "live_runs_spared": {}}
    assert report.summary() == "toy: swept ptb1\ntoy: swept ptb1"
    with pytest.raises(ValueError, match="must start with 'ptb'"):
        down([_sweep_toy], "xyz")
