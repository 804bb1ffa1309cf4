"""Every flag and argument of every subcommand says what it does in --help, and one flag means
one default: a flag several commands share defaults alike wherever it appears (the exceptions,
each with its reason, are listed here)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from testbed.cli import build_parser, main

pytestmark = pytest.mark.pure

# A flag with different defaults on different commands, and why.
DIFFERENT_DEFAULTS = {
    # Commands that generate or sample a workload name their own sizes.
    "--backend": "profile's --backend is the serving engine (sglang); every deployment command's is auto",
    "--requests": "per command: trace synth has no default, capacity probes 240, replay the scenario's",
    "--out": "each command names its own output",
    "--format": "trace synth writes mooncake; readers detect the format (auto)",
    "--seed": "trace synth seeds its generator (1); run commands take the scenario's workload.seed",
    "--port": "each command's own service",
    "--probes": "capacity and feasibility each use their own bisection depth",
    "--rates": "per command",
    "--spread": "per command",
    "--wait-growth": "capacity: only with several scenarios; feasibility: always",
    "--json": "a switch",
    "--vocab": "one command",
    "--scenario": "bench measures paper-prfaas unless told; the others require one",
    "--speedup": "linkcheck scales a link profile's own times (1: as written); run commands take the scenario's",
    "--link-gbps": "plan reads its base's inter-DC link; model and sweep quote the paper's 100 Gbit/s",
    "--source": "model: a trace's source label; feasibility: which profile family (paper)",
    "--tolerance": "regress: per-metric bounds; profile: a fit's tolerance",
    "--overhead": "calibrate fits it unless given; profile adds none",
}


def _actions(p: argparse.ArgumentParser, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], argparse.Action]]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, child in a.choices.items():
                yield from _actions(child, (*path, name))
        elif not isinstance(a, (argparse._HelpAction, argparse._VersionAction)) or a.help is None:
            yield path, a


def test_every_option_has_help() -> None:
    missing = [
        f"testbed {' '.join(path)} {'/'.join(a.option_strings) or a.dest}"
        for path, a in _actions(build_parser(), ())
        if not a.help
    ]
    assert not missing, "options without help:\n" + "\n".join(missing)


def test_a_shared_flag_has_one_default() -> None:
    defaults: dict[str, dict[object, list[str]]] = {}
    for path, a in _actions(build_parser(), ()):
        for flag in a.option_strings:
            if flag.startswith("--") and a.default is not argparse.SUPPRESS:
                defaults.setdefault(flag, {}).setdefault(repr(a.default), []).append(" ".join(path))
    split = {f: d for f, d in defaults.items() if len(d) > 1 and f not in DIFFERENT_DEFAULTS}
    assert not split, "\n".join(f"{f}: {d}" for f, d in split.items())


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("testbed ") and out.split()[1][0].isdigit(), out
