"""`testbed`: one entry point, one subcommand per job. Only wiring: each layer registers its
own subcommands; user errors (`testbed.core.errors.UserError`) print without a traceback."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from types import FrameType

from testbed.core.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    from testbed.deploy import serve as serve_cmd
    from testbed.metrics import command as metrics_cmd
    from testbed.metrics import regress as regress_cmd
    from testbed.model import command as model_cmd
    from testbed.deploy import command as deploy_cmd
    from testbed.net import command as net_cmd
    from testbed.studies import bench as bench_cmd
    from testbed.studies import calibrate as calibrate_cmd
    from testbed.studies import capacity_command as capacity_cmd
    from testbed.studies import crosscheck as crosscheck_cmd
    from testbed.studies import feasibility_command as feasibility_cmd
    from testbed.studies import linkcheck as linkcheck_cmd
    from testbed.studies import plan as plan_cmd
    from testbed.studies import replay_command as replay_cmd
    from testbed.studies import sweep as sweep_cmd
    from testbed.traces import command as trace_cmd

    p = argparse.ArgumentParser(prog="testbed", description="Cross-datacenter PD-disaggregation testbed (PrfaaS)")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)
    for mod in (replay_cmd, serve_cmd, bench_cmd, model_cmd, trace_cmd, metrics_cmd, deploy_cmd, net_cmd,
                linkcheck_cmd, capacity_cmd, regress_cmd, sweep_cmd, calibrate_cmd, plan_cmd,
                crosscheck_cmd, feasibility_cmd):
        mod.register(sub)
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
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if args.func.__module__ != "testbed.deploy.serve":     # a service handles SIGTERM itself
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
