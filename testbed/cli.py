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
from typing import NoReturn

from testbed.core.errors import UserError
from testbed.core.gc_pause import paused_gc

# The module of each subcommand, which registers it. Running one imports only its module: importing
# them all costs ~1 s (pyroute2, docker, matplotlib, aiohttp), more than a simulated replay's own
# start, and `testbed serve` (what every backend starts, a dozen at a time) would pay it per service.
# `--help` or an unknown command imports them all.
SERVE_MODULE = "testbed.deploy.serve"
COMMAND_MODULE = {
    "replay": "testbed.run.replay_command",
    "up": "testbed.run.replay_command",
    "serve": SERVE_MODULE,
    "bench": "testbed.studies.bench.bench",
    "trace": "testbed.traces.trace_command",
    "report": "testbed.metrics.report_command",
    "compare": "testbed.metrics.report_command",
    "plot": "testbed.metrics.report_command",
    "export": "testbed.metrics.report_command",
    "regress": "testbed.metrics.regress",
    "crosscheck": "testbed.studies.crosscheck.crosscheck",
    "model": "testbed.model.model_command",
    "down": "testbed.deploy.down_command",
    "netcaps": "testbed.net.netcaps_command",
    "linkcheck": "testbed.studies.linkcheck.linkcheck_command",
    "capacity": "testbed.studies.capacity.capacity_command",
    "sweep": "testbed.studies.sweep.sweep",
    "calibrate": "testbed.hardware.calibrate_command",
    "profile": "testbed.hardware.profile_command",
    "plan": "testbed.studies.plan.plan_command",
    "feasibility": "testbed.studies.feasibility.feasibility_command",
    "tokenizer": "testbed.run.tokenizer_command",
}
# Every module once, in the map's order (the order `testbed --help` lists the commands in).
COMMAND_MODULES = tuple(dict.fromkeys(COMMAND_MODULE.values()))


def _command_of(argv: Sequence[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


class OneLineParser(argparse.ArgumentParser):
    """A bad flag or value is one line, as every other user error: argparse's own error first
    prints the whole usage, which buries the line that says what is wrong. Exit 2 either way.
    Subcommand parsers are of the same class (add_subparsers takes the parent's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("prfaas-testbed")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


class _VersionAction(argparse.Action):
    """argparse's `version` action with the version looked up when asked for: importlib.metadata
    and the installed distribution's metadata cost tens of milliseconds on every command."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=str(kwargs.get("help")))

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(f"{parser.prog} {_version()}")
        parser.exit()


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    p = OneLineParser(prog="testbed", description="Cross-datacenter PD-disaggregation testbed (PrfaaS)")
    p.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    p.add_argument("--version", action=_VersionAction, help="print the installed version and exit")
    sub = p.add_subparsers(dest="command", required=True)
    command = _command_of(argv) if argv is not None else None
    one = COMMAND_MODULE.get(command or "")
    if one is not None:
        names: tuple[str, ...] = (one,)
    elif command is None and argv is not None and "--version" in argv and not {"-h", "--help"} & set(argv):
        names = ()  # the version alone: no command's module is needed to print it
    else:
        names = COMMAND_MODULES
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
        # The command's modules are imported here (a tenth of a simulated replay's time): the
        # objects they make live as long as the process, so collecting meanwhile finds nothing.
        with paused_gc():
            args = build_parser(argv).parse_args(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if args.func.__module__ != SERVE_MODULE:  # a service handles SIGTERM itself
        global _main_pid
        _main_pid = os.getpid()
        signal.signal(signal.SIGTERM, _sigterm_as_ctrl_c)
        if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
            # Inherited (a shell starts background jobs with SIGINT ignored): Ctrl-C, and the
            # SIGTERM that becomes one, would then be no-ops and the run could only be killed,
            # leaving its deployment behind. A run is always stoppable with its teardown.
            signal.signal(signal.SIGINT, signal.default_int_handler)
    from testbed.config.run_lock import command_scope

    try:
        # The output directories the command takes are its own until it returns.
        with command_scope(argv):
            rc: int = args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_status
    except KeyboardInterrupt:
        rc = 130
    return 128 + signal.SIGTERM if _terminated and rc == 130 else rc


def entry() -> NoReturn:
    """The `testbed` script and `python -m testbed`: `main`, then exit with its code.

    A command stopped by Ctrl-C or SIGTERM has torn down what it started and written what it
    keeps by the time `main` returns; it then exits without freeing its heap object by object,
    which after a simulation of a long trace takes seconds (a 1M-request trace alone holds
    2.4 GB of Python objects) and would hold up a stop that the user asked for. A finished
    simulated run exits the same way (`_only_heap_left`)."""
    rc = main()
    stopped = rc in (130, 128 + signal.SIGTERM)
    if stopped or _only_heap_left():
        if stopped:
            logging.shutdown()
        else:
            import atexit

            atexit._run_exitfuncs()  # logging's flush, temporary directories' removal, ...
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


def _only_heap_left() -> bool:
    """A command that built a large heap on purpose (`testbed.core.gc_pause.keep_heap_to_exit`: a
    simulated run) has written and closed its files; with no other thread running, nothing is left
    to do at exit but free that heap, which is not worth waiting for."""
    gc_pause = sys.modules.get("testbed.core.gc_pause")
    if gc_pause is None or not gc_pause.heap_kept():
        return False
    if sys.getprofile() is not None or sys.gettrace() is not None:
        return False  # a profiler or debugger wraps the command and reports after it returns
    import threading

    return threading.active_count() == 1
