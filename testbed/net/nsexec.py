"""Run a command inside a network namespace, like `ip netns exec`, without needing `ip`.

    python -m testbed.net.nsexec NETNS [--sysctl KEY=VALUE ...] -- CMD ARGS...

Enters NETNS, applies and verifies the (net.*) sysctls, then execs CMD, so the command's pid is
this process's pid: the deploy backend can signal and wait for it directly. Exit status 125 when
nsexec itself fails, 126/127 when CMD cannot be run (as env(1) does).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Mapping, Sequence

from testbed.net.nsthread import enter_netns, write_sysctl

EXIT_FAILED = 125
EXIT_CANNOT_RUN = 126
EXIT_NOT_FOUND = 127


def nsexec_argv(
    netns: str, argv: Sequence[str], sysctls: Iterable[tuple[str, str]] | Mapping[str, str] = ()
) -> list[str]:
    """Command line for subprocess.Popen that runs `argv` inside `netns`."""
    if not argv:
        raise ValueError("nsexec needs a command to run")
    pairs = sysctls.items() if isinstance(sysctls, Mapping) else sysctls
    out = [sys.executable, "-m", "testbed.net.nsexec", netns]
    for key, value in pairs:
        out += ["--sysctl", f"{key}={value}"]
    return [*out, "--", *argv]


def _parse_sysctl(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    return key.strip(), value.strip()


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m testbed.net.nsexec", description="run a command inside a network namespace"
    )
    parser.add_argument("netns")
    parser.add_argument(
        "--sysctl",
        action="append",
        default=[],
        type=_parse_sysctl,
        metavar="KEY=VALUE",
        help="net.* sysctl to set inside the namespace before the command starts (repeatable)",
    )
    if "--" not in args_in:
        parser.print_usage(sys.stderr)
        print("nsexec: missing '-- CMD ARGS...'", file=sys.stderr)
        return EXIT_FAILED
    cut = args_in.index("--")
    cmd = args_in[cut + 1 :]
    try:
        opts = parser.parse_args(args_in[:cut])
    except SystemExit as e:
        return EXIT_FAILED if e.code else 0
    if not cmd:
        print("nsexec: no command after '--'", file=sys.stderr)
        return EXIT_FAILED
    try:
        enter_netns(opts.netns)
        for key, value in opts.sysctl:
            write_sysctl(key, value)
    except (OSError, ValueError) as e:
        print(f"nsexec: {opts.netns}: {e}", file=sys.stderr)
        return EXIT_FAILED
    try:
        os.execvp(cmd[0], cmd)
    except FileNotFoundError:
        print(f"nsexec: {cmd[0]}: command not found", file=sys.stderr)
        return EXIT_NOT_FOUND
    except OSError as e:
        print(f"nsexec: {cmd[0]}: {e.strerror}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    return EXIT_FAILED  # execvp does not return


if __name__ == "__main__":
    sys.exit(main())
