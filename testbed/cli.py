"""`testbed`: one entry point, one subcommand per job. Only wiring: each layer registers its
own subcommands; user errors (`testbed.core.errors.UserError`) print without a traceback."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from testbed.core.errors import UserError


# Each module registers its subcommands. Imported by name, and for `testbed serve` (what every
# backend starts, a dozen at a time) only that one: the others pull in matplotlib, pyroute2 and
# the studies, 0.6 s of imports per service process.
COMMAND_MODULES = (
    "testbed.studies.replay_command", "testbed.deploy.serve", "testbed.studies.bench", "testbed.model.command",
    "testbed.traces.command", "testbed.metrics.command", "testbed.deploy.command", "testbed.net.command",
    "testbed.studies.linkcheck", "testbed.studies.capacity_command", "testbed.metrics.regress",
    "testbed.studies.sweep", "testbed.studies.calibrate", "testbed.studies.plan", "testbed.studies.crosscheck",
    "testbed.studies.feasibility_command",
)
SERVE_MODULE = "testbed.deploy.serve"


def _command_of(argv: Sequence[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="testbed", description="Cross-datacenter PD-disaggregation testbed (PrfaaS)")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)
    names = (SERVE_MODULE,) if argv is not None and _command_of(argv) == "serve" else COMMAND_MODULES
    for name in names:
        importlib.import_module(name).register(sub)
    return p


_terminated = False
_main_pid = os.getpid()


def _sigterm_as_ctrl_c(signum: int, frame: FrameType | None) -> None:
    """`timeout`, CI runners, systemd and `docker stop` send SIGTERM: take the Ctrl-C path (which
    under asyncio cancels the main task), so a run tears down what it started and keeps its records."""
    global _terminated
    if os.getpid() != _main_pid:
        # A forked helper (pyroute2 runs namespace work in one) inherited this handler: there,
        # SIGTERM means what it always means.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if _terminated:
        # Already tearing down: a second SIGTERM is a duplicate (`timeout` forwards its own to a
        # process group that was signalled too); taken as a second Ctrl-C it would abort the
        # teardown and leave namespaces behind. SIGKILL remains the way to force an exit.
        return
    _terminated = True
    os.kill(os.getpid(), signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        # A flag's type may refuse a value with a UserError (e.g. --out /): the same one line.
        args = build_parser(argv).parse_args(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if args.func.__module__ != SERVE_MODULE:     # a service handles SIGTERM itself
        global _main_pid
        _main_pid = os.getpid()
        signal.signal(signal.SIGTERM, _sigterm_as_ctrl_c)
        if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
            # Inherited (a shell starts background jobs with SIGINT ignored): Ctrl-C, and the
            # SIGTERM that becomes one, would then be no-ops and the run could only be killed,
            # leaving its deployment behind. A run is always stoppable with its teardown.
            signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        rc: int = args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        rc = 130
    return 128 + signal.SIGTERM if _terminated and rc == 130 else rc
