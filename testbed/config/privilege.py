"""Whether this process has root, asked in one place: every command and backend that needs it
(network namespaces, qdiscs, a swarm's replayer) checks here, and refuses with a UserError.

`TESTBED_AS_USER=1` makes a root process answer as a user's would: the CLI's tests run as root
on CI and still check what a user without root is told."""

from __future__ import annotations

import os

from testbed.core.errors import UserError

AS_USER_ENV = "TESTBED_AS_USER"


def is_root() -> bool:
    return os.geteuid() == 0 and os.environ.get(AS_USER_ENV, "") in ("", "0")


def need_root(what: str, instead: str = "") -> None:
    """UserError "WHAT needs root: run as root[, or INSTEAD]" unless this process has root."""
    if not is_root():
        raise UserError(f"{what} needs root: run as root" + (f", or {instead}" if instead else ""))
