"""What a test that runs a replay takes as "the run ran": exit 0, or EXIT_INVALID (3), the testbed
marking the run invalid because its timing slipped on a loaded host (its figures are recorded and
its verdict says so). Only that code is tolerated: a failure (1), a usage error (2) or a signal
still fails the test. In-process replays are rerun on it first, as capacity probes are."""

from __future__ import annotations

from collections.abc import Sequence

from testbed.cli import main
from testbed.metrics.verdict import EXIT_INVALID, EXIT_OK

RAN = (EXIT_OK, EXIT_INVALID)


def replay_until_valid(argv: Sequence[str], tries: int = 3) -> int:
    """`testbed ARGV` (a replay), run again while the testbed marks it invalid, at most `tries`
    times in all; the last exit code (assert it `in RAN`). A rerun replaces the invalid run's output
    (--overwrite): without it the run directory it left would refuse the rerun."""
    rc = main(list(argv))
    again = [*argv, "--overwrite"] if "--overwrite" not in argv else list(argv)
    for _ in range(tries - 1):
        if rc != EXIT_INVALID:
            break
        rc = main(again)
    return rc
