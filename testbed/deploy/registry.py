"""Every deployment backend, one entry each: its name, a one-line description, how to build it
and what it can honour. Commands take their `--backend` choices, defaults and help from here,
`auto` resolves here, and a scenario asking for what the chosen backend cannot do is refused
here, before anything starts. Adding a backend is one `register` call.

The simulator is an entry too (`simulator`, no factory): it runs without a Backend object
(`testbed.run.runner.run_sim`) but is chosen, listed and checked like the others.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from testbed.config.privilege import is_root
from testbed.config.resolved import ResolvedScenario
from testbed.core.errors import UserError
from testbed.core.fault_timeline import datacenters
from testbed.core.json_types import JSONObject
from testbed.core.schema.scenario import NODE_FAULTS
from testbed.deploy.base import Backend
from testbed.deploy.host_capacity import CONTAINER_HEALTH_TIMEOUT_S, PROCESS_HEALTH_TIMEOUT_S
from testbed.deploy.preflight import compose_host, netns_host, swarm_host

if TYPE_CHECKING:
    from testbed.deploy.cleanup import Leftovers, LiveRuns, Sweeper, Warn
    from testbed.deploy.engine import Engine

AUTO = "auto"


@dataclass(frozen=True)
class Capabilities:
    wan_shaping: bool = False  # real delay and rate on the inter-DC links (the simulator: modelled)
    link_schedules: bool = False  # the inter-DC profile's changes over time are applied
    node_faults: bool = False  # kill, pause, restart, slow
    link_faults: bool = False  # outage, rate_drop, partition, tcp_reset (on the WAN)
    deadlines: bool = True  # a request past serving.deadline_s fails
    needs_root: bool = False
    needs_docker: bool = False
    can_hold: bool = False  # `testbed up --hold`: open for outside clients
    simulator: bool = False  # virtual time, no services (run by `run_sim`)
    foreign_router: bool = False  # a real PD router (router.kind) can start in the router's place


# (scenario, run directory, what goes into every service's deployment, the router's port on this
# host: None not published, 0 any) -> a Backend not yet started
Factory = Callable[[ResolvedScenario, Path, JSONObject | None, int | None], Backend]
Need = Callable[[Capabilities], bool]


@dataclass(frozen=True)
class BackendEntry:
    name: str
    description: str
    caps: Capabilities
    factory: Factory | None = None  # None for the simulator
    # For `auto`: candidates in ascending rank; `unavailable()` says why this one cannot run on
    # this machine now (None: it can). The last candidate is the fallback, taken regardless.
    auto_rank: int | None = None
    unavailable: Callable[[], str | None] = lambda: None
    # What `testbed down` runs to remove what a killed run of this backend left (backends that
    # leave the same kind of objects share one); None: nothing outlives the process.
    leftovers: Sweeper | None = None
    # What this host must have for the backend (root, a tool, an engine): raises a UserError
    # naming what is missing, before a run prints or writes anything.
    preflight: Callable[[], None] = lambda: None
    # Processes of this host a deployment runs beyond one per node and the router (a WAN router),
    # and how long the backend waits for all of them to answer (its health timeout); None: its
    # services do not run as processes of this host (in-process, a swarm's nodes, the simulator).
    host_services: tuple[int, float] | None = None
    # A limit of the backend's own on a scenario's size (netns: hosts per datacenter subnet):
    # why it cannot run `rs`, or None. A hard limit, checked with the capabilities.
    size_limit: Callable[[ResolvedScenario], str | None] = lambda rs: None

    def create(
        self, rs: ResolvedScenario, run_dir: Path, extra: JSONObject | None = None, host_port: int | None = None
    ) -> Backend:
        if self.factory is None:
            raise ValueError(f"the {self.name} backend runs without a Backend object")
        return self.factory(rs, run_dir, extra, host_port)


_ENTRIES: dict[str, BackendEntry] = {}


def register(entry: BackendEntry) -> BackendEntry:
    if entry.name == AUTO:
        raise ValueError(f"{AUTO!r} is not a backend name: it picks one")
    if entry.name in _ENTRIES:
        raise ValueError(f"backend {entry.name!r} is registered already")
    _ENTRIES[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    del _ENTRIES[name]


def entries(need: Need | None = None) -> list[BackendEntry]:
    """In registration order, those whose capabilities `need` keeps (all without one)."""
    return [e for e in _ENTRIES.values() if need is None or need(e.caps)]


def names(need: Need | None = None) -> list[str]:
    return [e.name for e in entries(need)]


def get(name: str) -> BackendEntry:
    try:
        return _ENTRIES[name]
    except KeyError:
        raise UserError(f"unknown backend {name!r} ({', '.join(_ENTRIES)})") from None


def check_host(name: str) -> None:
    """UserError naming what backend `name` lacks on this host (its entry's `preflight`)."""
    get(name).preflight()


def check_capacity(name: str, scenarios: Iterable[ResolvedScenario], force: bool = False) -> None:
    """UserError with the figures when a deployment of one of `scenarios` on backend `name` would
    not fit this host (`testbed.deploy.host_capacity`); `force` (--force-capacity) skips it."""
    from testbed.core.schema.topology import node_specs
    from testbed.deploy.host_capacity import check, need_of

    e = get(name)
    if e.host_services is None or force:
        return
    extra, budget = e.host_services
    for rs in scenarios:
        specs = node_specs(rs.spec)
        decode = sum(s.role == "decode" for s in specs)
        check(need_of(len(specs) + 1 + extra, decode, len(specs) - decode, rs.spec.transfer.connections, budget, name))


def sweepers(root: bool = True) -> list[Sweeper]:
    """Each backend's leftover sweep once, in registration order (for `testbed down`); without
    `root`, only those of backends that run without it."""
    out: list[Sweeper] = []
    for e in _ENTRIES.values():
        if e.caps.needs_root and not root:
            continue
        if e.leftovers is not None and e.leftovers not in out:
            out.append(e.leftovers)
    return out


def is_simulated(name: object) -> bool:
    """Whether a backend name (as run.json records it) is the simulator's; unknown names are not."""
    e = _ENTRIES.get(name) if isinstance(name, str) else None
    return e is not None and e.caps.simulator


# -- what commands need (filters of `entries`) ----------------------------------------------


def any_backend(c: Capabilities) -> bool:
    return True


def emulates(c: Capabilities) -> bool:
    """Real services on a real (or loopback) network: what a comparison against the simulator needs."""
    return not c.simulator


def holds_open(c: Capabilities) -> bool:
    return c.can_hold


# -- `auto` --------------------------------------------------------------------------------


def _auto_candidates() -> list[BackendEntry]:
    return sorted((e for e in _ENTRIES.values() if e.auto_rank is not None), key=lambda e: e.auto_rank or 0)


def auto_help() -> str:
    c = _auto_candidates()
    return f"{AUTO}: " + " if it can run here, else ".join(e.name for e in c) if c else ""


def pick_backend(requested: str, flag: str = "--backend") -> tuple[str, str | None]:
    """The backend to run and a warning to print, if any. `auto` is the first candidate this
    machine can run (netns: real shaped links, when this process may create namespaces), else
    the fallback with a warning that says what is not emulated. A backend named explicitly that
    needs root, without root, is a UserError."""
    if requested != AUTO:
        e = get(requested)
        if e.caps.needs_root and not is_root():
            others = names(lambda c: not c.needs_root and not c.simulator)
            raise UserError(
                f"{flag} {requested}: the {requested} backend needs root: run as root, "
                f"or give {flag} {'|'.join(others)}"
            )
        return requested, None
    cands = _auto_candidates()
    if not cands:
        raise UserError(f"{flag} {AUTO}: no backend is a candidate")
    why: list[str] = []
    hints: list[str] = []
    for e in cands[:-1]:
        reason = e.unavailable()
        if reason is None:
            return e.name, None
        why.append(reason)
        if e.caps.needs_root and not is_root():
            hints.append(f"; run as root for the {e.name} backend")
    chosen = cands[-1]
    if not why:
        return chosen.name, None
    lost = "" if chosen.caps.wan_shaping else ". WAN delay, rate limits, loss and link schedules are NOT emulated"
    return (
        chosen.name,
        f"{'; '.join(why)}: using the {chosen.name} backend ({chosen.description}){lost}{''.join(hints)}",
    )


# -- argparse ------------------------------------------------------------------------------


def backend_option(need: Need = any_backend, default: str = AUTO, lead: str = "") -> dict[str, Any]:
    """`choices`, `default` and `help` of a `--backend` flag offering the backends `need` keeps
    (and `auto`, when one of its candidates is among them)."""
    offered = entries(need)
    with_auto = any(e.auto_rank is not None for e in offered)
    parts = [f"{e.name}: {e.description}" for e in offered] + ([auto_help()] if with_auto else [])
    text = (f"{lead}; " if lead else "") + "; ".join(parts) + f" (default: {default})"
    return {
        "choices": [AUTO] * with_auto + [e.name for e in offered],
        "default": default,
        "help": text.replace("%", "%%"),
    }


# -- what a scenario asks for --------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    field: str  # the scenario field asking, with its value: faults[0].kind='kill'
    what: str  # what it asks for, in words
    need: Need


def requests(rs: ResolvedScenario) -> list[Request]:
    """What `rs` asks of a backend beyond running its services, each with the field that asks."""
    sc = rs.spec
    out: list[Request] = []
    for i, f in enumerate(sc.faults):
        if isinstance(f, NODE_FAULTS):
            out.append(Request(f"faults[{i}].kind={f.kind!r}", "a node fault", lambda c: c.node_faults))
        else:
            out.append(Request(f"faults[{i}].kind={f.kind!r}", "a link fault", lambda c: c.link_faults))
    # A profile's schedule is the experiment (the link changes under load); its static delay and
    # rate are not: a run on unshaped loopback still tests the services, and says so (warning).
    if rs.inter_dc.schedule and len(datacenters(sc)) > 1:
        out.append(
            Request(
                f"links.inter_dc={sc.links.inter_dc!r}",
                f"a WAN link that changes over time ({len(rs.inter_dc.schedule)} step(s) in its schedule)",
                lambda c: c.link_schedules,
            )
        )
    if sc.router.kind != "testbed":
        out.append(
            Request(
                f"router.kind={sc.router.kind!r}",
                "a foreign router (its binary started in the router's place)",
                lambda c: c.foreign_router,
            )
        )
    if sc.serving.deadline_s is not None:
        out.append(
            Request(f"serving.deadline_s={sc.serving.deadline_s:g}", "a per-request deadline", lambda c: c.deadlines)
        )
    return out


def refusal(backend: str, rs: ResolvedScenario) -> str | None:
    """Why `backend` cannot honour `rs` (the first field it cannot), or None."""
    e = get(backend)
    if (why := e.size_limit(rs)) is not None:
        return f"scenario {rs.name!r} on the {e.name} backend: {why}"
    for r in requests(rs):
        if not r.need(e.caps):
            able = names(r.need) or ["none"]
            return (
                f"scenario {rs.name!r}: {r.field} asks for {r.what}, which the {e.name} backend cannot honour; "
                f"backends that can: {', '.join(able)}"
            )
    return None


def refuse_unhonoured(backend: str, scenarios: Iterable[ResolvedScenario]) -> None:
    """UserError naming the first scenario field `backend` cannot honour. Commands call it before
    running anything, so a comparison or a sweep does not stop (or record an error per point)
    halfway through; the runner calls it again for callers that did not."""
    for rs in scenarios:
        if (why := refusal(backend, rs)) is not None:
            raise UserError(why)


# -- the backends --------------------------------------------------------------------------


def _no_namespaces() -> str | None:
    if not is_root():
        return "not root"
    if not Path("/var/run/netns").exists() and not os.access("/var/run", os.W_OK):
        return "cannot create network namespaces"
    return None


def _netns_size(rs: ResolvedScenario) -> str | None:
    from collections import Counter

    from testbed.core.schema.topology import local_dc, node_specs
    from testbed.net.topology import HOST_FIRST

    per_dc = Counter(s.datacenter for s in node_specs(rs.spec))
    per_dc[local_dc(rs.spec)] += 2  # the router and the client beside the decode cluster
    most = 255 - HOST_FIRST
    dc, n = per_dc.most_common(1)[0]
    if n > most:
        return f"datacenter {dc!r} would hold {n} hosts, and at most {most} fit in its /24 subnet"
    return None


def _netns(rs: ResolvedScenario, run_dir: Path, extra: JSONObject | None, host_port: int | None) -> Backend:
    from testbed.deploy.netns import NetnsBackend

    return NetnsBackend(rs, run_dir, extra=extra, host_port=host_port or 0)


def _compose(rs: ResolvedScenario, run_dir: Path, extra: JSONObject | None, host_port: int | None) -> Backend:
    from testbed.deploy.compose import ComposeBackend

    return ComposeBackend(rs, run_dir, extra=extra, host_port=host_port)


def _swarm(rs: ResolvedScenario, run_dir: Path, extra: JSONObject | None, host_port: int | None) -> Backend:
    from testbed.deploy.swarm import SwarmBackend

    return SwarmBackend(rs, run_dir, extra=extra, host_port=host_port or 0)


# Imported when `testbed down` runs, not with the registry (the Docker SDK is slow to import).
def _sweep_namespaces(prefix: str, engine: Engine | None, warn: Warn, live: LiveRuns) -> Leftovers:
    from testbed.deploy.cleanup import sweep_namespaces

    return sweep_namespaces(prefix, engine, warn, live)


def _sweep_processes(prefix: str, engine: Engine | None, warn: Warn, live: LiveRuns) -> Leftovers:
    from testbed.deploy.cleanup import sweep_processes

    return sweep_processes(prefix, engine, warn, live)


def _sweep_docker(prefix: str, engine: Engine | None, warn: Warn, live: LiveRuns) -> Leftovers:
    from testbed.deploy.cleanup import sweep_docker

    return sweep_docker(prefix, engine, warn, live)


def loopback_factory(name: str, processes: bool) -> Factory:
    """Every service on 127.0.0.1: one process each (`processes`) or all in this event loop."""

    def make(rs: ResolvedScenario, run_dir: Path, extra: JSONObject | None, host_port: int | None) -> Backend:
        from testbed.deploy.loopback import LoopbackBackend

        return LoopbackBackend(name, rs, run_dir, extra, host_port or 0, processes=processes)

    return make


register(
    BackendEntry(
        "netns",
        "a namespace per service and shaped WAN links (root)",
        Capabilities(
            wan_shaping=True,
            link_schedules=True,
            node_faults=True,
            link_faults=True,
            needs_root=True,
            can_hold=True,
            foreign_router=True,
        ),
        _netns,
        auto_rank=0,
        unavailable=_no_namespaces,
        leftovers=_sweep_namespaces,
        preflight=netns_host,
        host_services=(1, PROCESS_HEALTH_TIMEOUT_S),
        size_limit=_netns_size,
    )
)
register(
    BackendEntry(
        "compose",
        "one container per service, a WAN router container (Docker)",
        Capabilities(
            wan_shaping=True,
            node_faults=True,
            link_faults=True,
            needs_docker=True,
            can_hold=True,
            foreign_router=True,
        ),
        _compose,
        leftovers=_sweep_docker,
        preflight=compose_host,
        host_services=(1, CONTAINER_HEALTH_TIMEOUT_S),
    )
)
register(
    BackendEntry(
        "swarm",
        "the compose deployment as a Docker Swarm stack, each datacenter on the nodes labelled for it "
        "(root, a swarm manager)",
        Capabilities(wan_shaping=True, needs_root=True, needs_docker=True, can_hold=True),
        _swarm,
        leftovers=_sweep_docker,
        preflight=swarm_host,
    )
)
register(
    BackendEntry(
        "local",
        "one process per service on loopback",
        Capabilities(node_faults=True, can_hold=True, foreign_router=True),
        loopback_factory("local", processes=True),
        auto_rank=1,
        leftovers=_sweep_processes,
        host_services=(0, PROCESS_HEALTH_TIMEOUT_S),
    )
)
register(
    BackendEntry(
        "inproc", "all in this process", Capabilities(can_hold=True), loopback_factory("inproc", processes=False)
    )
)
register(
    BackendEntry(
        "sim",
        "the discrete-event simulator in virtual time (no services, a flow-level link model)",
        Capabilities(wan_shaping=True, link_schedules=True, node_faults=True, link_faults=True, simulator=True),
    )
)
