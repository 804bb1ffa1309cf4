"""What the router's calls meet at each instance: its process (up, paused: it answers nothing
until resumed, or down: killed) and the way to it. The router sits in the decode cluster's
datacenter, as every emulating backend puts it: its calls to instances elsewhere cross the WAN
(its delay, and nothing while it is dark). The fault runner changes the processes
(`testbed.sim.simulator.Simulation.kill` and the rest), the router asks and waits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from testbed.sim.events import ARRIVAL, Loop
from testbed.sim.net_view import Net
from testbed.sim.wan import rto_instant

Waiter = Callable[[Any], None]


class Reach:
    __slots__ = ("life", "loop", "net", "router_dc", "node_dc", "speedup", "_resumed", "_unreachable")

    def __init__(self, loop: Loop, net: Net, node_dc: dict[str, str], router_dc: str, speedup: float) -> None:
        self.loop = loop
        self.net = net
        self.node_dc = node_dc
        self.router_dc = router_dc
        self.speedup = speedup
        # Each instance's process: up, paused or down.
        self.life: dict[str, str] = dict.fromkeys(node_dc, "up")
        self._resumed: dict[str, list[Waiter]] = {}
        self._unreachable: dict[str, list[tuple[float, Waiter]]] = {}

    def answers(self, node: str) -> bool:
        return self.life[node] == "up"

    def when_resumed(self, node: str, fn: Waiter) -> None:
        """Run `fn` once the paused `node` resumes (dropped if it is killed instead)."""
        self._resumed.setdefault(node, []).append(fn)

    def reachable(self, node: str) -> bool:
        """The router's calls get through to `node` now."""
        return not self.net.dark(self.router_dc, self.node_dc[node])

    def when_reachable(self, node: str, fn: Waiter) -> None:
        """Run `fn` when a call sent to `node` now gets through: TCP retransmits it on its timer,
        so at the first retransmission after the link is back."""
        self._unreachable.setdefault(self.node_dc[node], []).append((self.loop.now, fn))

    def http_delay(self, node: str) -> float:
        """One way from the router to `node` and back the same: the WAN's delay if it is elsewhere."""
        dc = self.node_dc[node]
        return 0.0 if dc == self.router_dc else self.net.wan[(self.router_dc, dc)].delay

    # -- what faults do (the simulation acts on the instances themselves) -------------------------

    def killed(self, node: str) -> None:
        self.life[node] = "down"
        self._resumed.pop(node, None)

    def resumed(self, node: str) -> None:
        """The paused `node` runs again (up, its instance resumed): what waited for it goes on."""
        for fn in self._resumed.pop(node, []):
            fn(None)

    def links_back(self, t: float) -> None:
        """The WAN links are lit again at `t`: the calls waiting behind them are retransmitted."""
        for dc, waiting in list(self._unreachable.items()):
            if self.net.dark(self.router_dc, dc):
                continue
            del self._unreachable[dc]
            rtt = 2.0 * self.net.wan[(self.router_dc, dc)].delay
            for sent, fn in waiting:
                self.loop.at(rto_instant(sent, t, rtt, self.speedup), ARRIVAL, fn)
