"""What the instances need of the router that drives them (`testbed.sim.router.SimRouter`, so
they need not import it): the clock, the network, and where a request goes on from them; and
what the router calls on the instances."""

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


# The other way: what the router calls on its instances (`PrefillSim`, `DecodeSim`). Typed by what
# is called rather than by class, so that a fake instance stands in wherever the router is
# compiled (`testbed.compiled`), which checks a value's class where it is typed by one.
class PrefillPort(Protocol):
    def submit(self, req: SimRequest, t: float) -> None:
        """The router's call: the request's prefill, from `t`."""

    def move_arrived(self, req: SimRequest, t: float) -> None:
        """The request's moved cached prefix has arrived."""

    def abort(self, req: SimRequest, t: float) -> None:
        """The request's attempt is given up here."""


class DecodePort(Protocol):
    def kv_arrived(self, req: SimRequest, t: float) -> None:
        """The request's KV is all here."""

    def leave(self, req: SimRequest, t: float) -> None:
        """The request's sequence leaves (its attempt failed or was given up)."""
