"""The network as the simulator's parts see it (`Net`: a path is a handle they only hand back),
and which network a run gets (`new_network`): `testbed.sim.network.Network`, or its compiled twin
where it is built and the run's links never change."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

from testbed.core import native
from testbed.core.schema.linkprofile import LinkProfile
from testbed.core.schema.scenario import TransferSpec
from testbed.sim.events import NET, Loop
from testbed.sim.net_links import MarkFn, Path
from testbed.sim.network import Network
from testbed.sim.tcp import TcpModel


class WanView(Protocol):
    """What the simulator reads of a WAN link: its parameters and its byte counter."""

    @property
    def name(self) -> str: ...
    @property
    def rate_bps(self) -> float: ...
    @property
    def delay(self) -> float: ...
    @property
    def loss(self) -> float: ...
    @property
    def tcp(self) -> TcpModel: ...
    @property
    def counter(self) -> CounterView: ...


class CounterView(Protocol):
    def at(self, t: float) -> float: ...


class PathHandle(Protocol):
    """A path as the simulator holds it (`Path`, or `testbed_native.NetPath`)."""

    @property
    def delay(self) -> float: ...


class Net(Protocol):
    """`Network`, or its compiled twin for a run whose links never change (`new_network`). A path
    is the network's own handle (`Path`, or `testbed_native.NetPath`): the simulator only hands
    it back and reads its `delay`."""

    @property
    def wan(self) -> Mapping[tuple[str, str], WanView]: ...
    @property
    def rebalances(self) -> int: ...
    def path(self, src: str, dst: str) -> Any: ...
    def position(self, p: Any) -> float: ...
    def stream(self, p: Any, t: float, rate: float) -> None: ...
    def push(self, p: Any, t: float, nbytes: float) -> None: ...
    def end_stream(self, p: Any, t: float, nbytes: float) -> None: ...
    def mark(self, p: Any, pos: float, fn: MarkFn, arg: Any) -> None: ...
    def withdraw(self, p: Any, lo: float, hi: float) -> None: ...
    def sent_at(self, node: str, t: float) -> float: ...
    def sent_rate(self, node: str) -> float: ...
    def received_at(self, node: str, t: float) -> float: ...
    def backlog(self, node: str, t: float) -> float: ...
    def dark(self, a: str, b: str) -> bool: ...
    def schedule_changes(self) -> None: ...


@dataclass(frozen=True)
class _LinkCounter:
    net: Any
    link: int

    def at(self, t: float) -> float:
        return float(self.net.link_bytes(self.link, t))


@dataclass(frozen=True)
class _WanLink:
    """A WAN link of the compiled network: fixed parameters, the twin's counter."""

    name: str
    rate_bps: float
    delay: float
    loss: float
    tcp: TcpModel
    counter: _LinkCounter


def new_network(
    loop: Loop,
    node_dc: dict[str, str],
    intra: LinkProfile,
    inter: LinkProfile,
    transfer: TransferSpec,
    byte_scale: float,
    speedup: float,
    faults: bool,
) -> Net:
    """The simulator's network: the compiled twin where it is built (`testbed.core.native`) and
    the links never change in the run (no faults, no schedule of link changes, none dark, every
    path able to carry), else `Network`. Both give the same rates, events and counts."""
    py = Network(loop, node_dc, intra, inter, transfer, byte_scale, speedup)
    ext = native.module()
    if ext is None or faults or intra.schedule or inter.schedule:
        return py
    nodes = list(node_dc)
    dcs = list(dict.fromkeys(node_dc.values()))
    links = [py.nic_out[n] for n in nodes] + [py.nic_in[n] for n in nodes] + list(py.wan.values())
    if any(lk.loss >= 1.0 for lk in links):
        return py
    index = {id(lk): i for i, lk in enumerate(links)}
    first = {dc: next(n for n in nodes if node_dc[n] == dc) for dc in dcs}
    route: dict[tuple[int, int], tuple[float, float]] = {}
    for i, a in enumerate(dcs):
        for j, b in enumerate(dcs):
            src, dst = first[a], first[b]
            through = (py.nic_out[src], py.wan[(a, b)], py.nic_in[dst]) if a != b else (py.nic_out[src], py.nic_in[dst])
            p = Path(
                src, dst, through, (), transfer.connections, py.chunk, py.inter_tcp if a != b else py.intra_tcp, a != b
            )
            if p.conn_rate <= 0.0:
                return py
            route[(i, j)] = (p.delay, p.conn_rate)
    n = len(nodes)
    flow = _compiled_class(ext)(
        loop,
        NET,
        nodes,
        [dcs.index(node_dc[x]) for x in nodes],
        [(lk.capacity, i) for i, lk in enumerate(links)],
        list(range(n)),
        list(range(n, 2 * n)),
        {(dcs.index(a), dcs.index(b)): index[id(lk)] for (a, b), lk in py.wan.items()},
        len(links) + 2 * n,
        list(range(len(links), len(links) + n)),
        list(range(len(links) + n, len(links) + 2 * n)),
        route,
        transfer.connections,
        py.chunk,
    )
    flow.bind()
    flow.wan = {
        pair: _WanLink(lk.name, lk.rate_bps, lk.delay, lk.loss, lk.tcp, _LinkCounter(flow, index[id(lk)]))
        for pair, lk in py.wan.items()
    }
    compiled: Net = flow
    return compiled


@cache
def _compiled_class(ext: Any) -> type:
    """The compiled network with what the simulator reads beside its mechanism (made once)."""

    class CompiledNetwork(ext.FlowNet):  # type: ignore[misc]
        """`testbed_native.FlowNet` with the WAN links' parameters (they never change here)."""

        wan: dict[tuple[str, str], _WanLink]

        def dark(self, a: str, b: str) -> bool:
            return a != b and (self.wan[(a, b)].loss >= 1.0 or self.wan[(b, a)].loss >= 1.0)

        def schedule_changes(self) -> None:
            """No link changes in a run this network serves (`new_network`)."""

    return CompiledNetwork
