"""What the instances need of the router that drives them (`testbed.sim.router.SimRouter`, so
they need not import it): the clock, the network, and where a request goes on from them."""

from __future__ import annotations

from typing import Protocol

from testbed.core.failures import Failure
from testbed.sim.events import Loop
from testbed.sim.net_view import Net, PathHandle
from testbed.sim.request import SimRequest


class Host(Protocol):
    @property
    def loop(self) -> Loop: ...
    @property
    def net(self) -> Net: ...

    def transfer_handed(self, req: SimRequest, path: PathHandle, pos: float) -> None:
        """A prefill's compute ended with its KV up to byte `pos` of `path`."""

    def kv_held(self, req: SimRequest, path: PathHandle, t: float) -> None:
        """A prefill's compute ended with its KV held for the decode node to pull (`path`: where it
        will go)."""

    def finished(self, req: SimRequest, t: float) -> None:
        """The request's last token is out."""

    def attempt_failed(self, req: SimRequest, f: Failure, t: float) -> None:
        """The request's attempt cannot go on there (the router may retry it elsewhere)."""
