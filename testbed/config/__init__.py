"""Scenarios and link profiles: YAML files read and validated once, resolved into the objects
every other layer receives (`ResolvedScenario`). May import `testbed.core` only."""

from testbed.config.overrides import overrides_for
from testbed.config.profiles import ProfileError, load_profile
from testbed.config.resolved import ResolvedScenario, ThresholdSolver, load, resolve
from testbed.config.scenarios import ScenarioError, load_scenario

__all__ = [
    "ProfileError",
    "ResolvedScenario",
    "ScenarioError",
    "ThresholdSolver",
    "load",
    "load_profile",
    "load_scenario",
    "overrides_for",
    "resolve",
]
