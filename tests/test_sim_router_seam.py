"""The simulated router's seam: `Reach` keeps the instances' processes and the way to them."""

from __future__ import annotations

from typing import Any, cast

import pytest

from testbed.sim.events import EventLoop
from testbed.sim.net_view import Net
from testbed.sim.reach import Reach
from testbed.sim.wan import rto_instant

pytestmark = pytest.mark.pure


class _Path:
    delay = 0.25


class _Net:
    """The network as the router and `Reach` use it without faults: KV marks and the WAN."""

    def __init__(self) -> None:
        self.marks: list[tuple[Any, Any, float]] = []  # (callback, its argument, byte position)
        self.dark_pairs: set[tuple[str, str]] = set()
        self.wan = {("dc-a", "dc-b"): _Path(), ("dc-b", "dc-a"): _Path()}

    def mark(self, path: Any, pos: float, fn: Any, arg: Any) -> None:
        self.marks.append((fn, arg, pos))

    def dark(self, a: str, b: str) -> bool:
        return (a, b) in self.dark_pairs


def test_reach_holds_what_waits_for_a_paused_instance_or_a_dark_link() -> None:
    loop = EventLoop()
    net = _Net()
    reach = Reach(loop, cast(Net, net), {"a0": "dc-a", "b0": "dc-b"}, "dc-a", 4.0)
    assert reach.http_delay("a0") == 0.0 and reach.http_delay("b0") == 0.25
    ran: list[str] = []
    reach.life["b0"] = "paused"
    assert not reach.answers("b0")
    reach.when_resumed("b0", lambda _: ran.append("resumed"))
    reach.life["b0"] = "up"
    reach.resumed("b0")
    reach.resumed("b0")  # once
    assert ran == ["resumed"]

    reach.when_resumed("a0", lambda _: ran.append("never"))
    reach.killed("a0")
    assert reach.life["a0"] == "down"
    reach.life["a0"] = "up"
    reach.resumed("a0")
    assert ran == ["resumed"]  # a killed instance's waiters are dropped

    net.dark_pairs.add(("dc-a", "dc-b"))
    assert not reach.reachable("b0") and reach.reachable("a0")
    reach.when_reachable("b0", lambda _: ran.append(f"through at {loop.now}"))
    reach.links_back(5.0)  # still dark: nothing goes
    loop.run()
    assert ran == ["resumed"]
    net.dark_pairs.clear()
    reach.links_back(5.0)
    loop.run()
    assert ran == ["resumed", f"through at {rto_instant(0.0, 5.0, 0.5, 4.0)}"]
