"""Scenarios as the studies load them: resolved once, an `auto` threshold by the analytical
optimiser at the scenario's own inter-DC link rate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from testbed import config
from testbed.config.resolved import ResolvedScenario
from testbed.core.schema.scenario import Scenario


def solve_threshold(scenario: Scenario, link_bps: float) -> float:
    """`testbed.model.optimise.solve_threshold`, imported when a scenario's threshold is `auto`:
    the optimiser (numpy, the analytical model) is most of a command's start-up otherwise."""
    from testbed.model.optimise import solve_threshold as solve

    return solve(scenario, link_bps)


def load(name_or_path: str | Path, overrides: dict[str, Any] | None = None) -> ResolvedScenario:
    return config.load(name_or_path, overrides, solve_threshold)


def resolve(spec: Scenario, source: str = "") -> ResolvedScenario:
    return config.resolve(spec, source, solve_threshold)
