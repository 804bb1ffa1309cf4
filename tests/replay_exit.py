"""What a test that runs a replay takes as "the run ran": exit 0, or EXIT_INVALID (3), the testbed
marking the run invalid because its timing slipped on a loaded host (its figures are recorded and
its verdict says so). Only that code is tolerated: a failure (1), a usage error (2) or a signal
still fails the test. Replays are rerun on it first (`until_valid`), as capacity probes are."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from quiet_host import wait_for_quiet_host

from testbed.cli import main
from testbed.metrics.verdict import EXIT_INVALID, EXIT_OK

RAN = (EXIT_OK, EXIT_INVALID)
R = TypeVar("R")


def until_valid(run: Callable[[list[str]], R], exit_code: Callable[[R], int], argv: Sequence[str], tries: int = 3) -> R:
    """`run(ARGV)` (a replay, in this process or another), run again while the testbed marks it
    invalid, at most `tries` times in all, each rerun once the host has eased (five quiet seconds,
    up to two minutes: an immediate rerun meets the load that spoiled the first); the last result
    (assert its exit code `in RAN`). A rerun replaces the invalid run's output (--overwrite):
    without it the run directory it left would refuse the rerun."""
    result = run(list(argv))
    again = [*argv, "--overwrite"] if "--overwrite" not in argv else list(argv)
    for _ in range(tries - 1):
        if exit_code(result) != EXIT_INVALID:
            break
        wait_for_quiet_host(120.0, windows=5)
        result = run(again)
    return result


def replay_until_valid(argv: Sequence[str], tries: int = 3) -> int:
    """`until_valid` of `testbed ARGV` in this process; the last exit code."""
    return until_valid(main, lambda rc: rc, argv, tries)
