"""A scenario resolved once: the spec, its link profiles as objects, its scale and the routing
threshold in force. Every layer above receives this; none reads YAML again."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from testbed.config.live_path import live_path_costs
from testbed.config.profiles import ProfileError, load_profile
from testbed.config.scenarios import ScenarioError, load_scenario, override_origins, resolve_path
from testbed.core.json_types import JSONObject
from testbed.core.schema.linkprofile import LinkProfile
from testbed.core.schema.live_path import LivePathCosts
from testbed.core.schema.scaling import Scale
from testbed.core.schema.scenario import Scenario

# (spec, inter-DC link rate in bit/s) -> threshold in tokens. The analytical optimiser provides
# one (`testbed.model.optimise.solve_threshold`); config may not import the model layer.
ThresholdSolver = Callable[[Scenario, float], float]


class ResolvedScenario(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    spec: Scenario
    intra_dc: LinkProfile
    inter_dc: LinkProfile
    threshold: float | None  # tokens; None when the policy has no length threshold
    source: str = ""  # the file it came from, for messages
    live_path: LivePathCosts = LivePathCosts()  # what the simulator adds for the live path (`sim.live_path`)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def scale(self) -> Scale:
        return Scale.from_spec(self.spec.scale)

    def at_rate(self, rate: float) -> ResolvedScenario:
        """The same deployment under another offered load (links and threshold do not depend on it)."""
        wl = self.spec.workload.model_copy(update={"rate": rate})
        return self.model_copy(update={"spec": self.spec.model_copy(update={"workload": wl})})

    def to_json_dict(self) -> JSONObject:
        return self.model_dump(mode="json")


def resolve(
    spec: Scenario, source: str = "", solve: ThresholdSolver | None = None, origins: dict[str, str] | None = None
) -> ResolvedScenario:
    """`origins` (dotted path -> `--set a.b=v`): a link named by an override is blamed on it."""
    intra = _profile(spec, "intra_dc", source, origins or {})
    inter = _profile(spec, "inter_dc", source, origins or {})
    threshold: float | None = None
    t = spec.policy.threshold
    if spec.policy.name == "prfaas":
        if isinstance(t, int):
            threshold = float(t)
        elif t == "auto":
            if solve is None:
                raise ScenarioError(
                    f"{source or spec.name}: field 'policy.threshold': 'auto' needs the "
                    "analytical optimiser to resolve it"
                )
            threshold = float(solve(spec, inter.rate))
    return ResolvedScenario(
        spec=spec,
        intra_dc=intra,
        inter_dc=inter,
        threshold=threshold,
        source=source,
        live_path=live_path_costs(spec, source),
    )


def _profile(spec: Scenario, field: str, source: str, origins: dict[str, str]) -> LinkProfile:
    try:
        return load_profile(getattr(spec.links, field))
    except ProfileError as e:
        by = origins.get(f"links.{field}") or origins.get("links")
        raise ProfileError(f"{by or source or spec.name}: field 'links.{field}': {e}") from None


def load(
    name_or_path: str | Path, overrides: Mapping[str, object] | None = None, solve: ThresholdSolver | None = None
) -> ResolvedScenario:
    """Read, merge and validate a scenario file, then resolve it (profiles, threshold)."""
    spec = load_scenario(name_or_path, overrides)
    return resolve(spec, str(resolve_path(name_or_path)), solve, override_origins(overrides))
