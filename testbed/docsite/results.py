"""The runner behind `make docs-results`: it runs the measurements the documentation quotes
(`measurements.py`) and writes their results files.

Each measurement runs its commands into `build/results/<name>/` and writes what the docs quote
to `docs/results/data/<name>.md` (tables, stamped with the date, commit, host, its load and the
command) and `<name>.json` (the stamp as data), and copies its figures beside them. Pages include
those files (`--8<-- "results/data/<name>.md"`); a figure in the docs comes from one of them.
Adding a measurement is one `Measurement(...)` in `measurements.MEASUREMENTS`.

    python -m testbed.docsite.results [--only NAME,...] [--skip-emulation] [--list]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from testbed.docsite.markdown import table
from testbed.docsite.measurement import DATA, ROOT, WORK, Done, Measurement
from testbed.docsite.measurements import MEASUREMENTS

__all__ = ["DATA", "MEASUREMENTS", "ROOT", "WORK", "Measurement", "by_name", "main", "readme_block"]


# -- running ---------------------------------------------------------------------------------


def by_name(names: Sequence[str] | None = None) -> list[Measurement]:
    known = {m.name: m for m in MEASUREMENTS}
    if not names:
        return list(MEASUREMENTS)
    unknown = [n for n in names if n not in known]
    if unknown:
        from testbed.core.errors import UserError

        raise UserError(f"unknown measurement(s) {', '.join(unknown)} (known: {', '.join(known)})")
    return [known[n] for n in names]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def source_state() -> tuple[str, bool]:
    """The commit the code runs from, and whether the code differs from it (tracked files that
    decide what a measurement does; the docs, their results and this package, which only renders
    them, do not count)."""
    commit = _git("rev-parse", "--short=12", "HEAD") or "unknown"
    dirty = bool(
        _git(
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            "testbed",
            ":(exclude)testbed/docsite",
            "scenarios",
            "netem_profiles",
            "traces",
            "Makefile",
            "pyproject.toml",
        )
    )
    return commit, dirty


def stamp(
    m: Measurement, started: datetime, source: tuple[str, bool], wall_s: float, load: float | None = None
) -> dict[str, object]:
    """`load` is the host's one-minute load average when the measurement began: a timing taken
    beside other work says so."""
    return {
        "name": m.name,
        "title": m.title,
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "commit": source[0],
        "local_changes": source[1],
        "host": socket.gethostname(),
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "load_avg": None if load is None else round(load, 2),
        "backend": m.backend,
        "commands": m.commands(),
        "wall_s": round(wall_s, 1),
    }


def stamp_line(st: dict[str, object]) -> str:
    cmds = st["commands"]
    assert isinstance(cmds, list)
    changes = " (with local changes)" if st.get("local_changes") else ""
    load = f", load average {st['load_avg']} at the start" if st.get("load_avg") is not None else ""
    return (
        f"*Measured {st['date']} at commit `{st['commit']}`{changes} on {st['host']} ({st['cores']} cores, "
        f"Linux {st['kernel']}{load}), {st['backend']}, in {st['wall_s']} s, by* " + "; ".join(f"`{c}`" for c in cmds)
    )


def run(m: Measurement, env: dict[str, str]) -> None:
    work = WORK / m.name
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    outs: list[str] = []
    errs: list[str] = []
    started, source, load = datetime.now(UTC), source_state(), os.getloadavg()[0]
    t0 = time.monotonic()
    for cmd in m.commands():
        print(f"[{m.name}] {cmd}", file=sys.stderr, flush=True)
        expect_failure = cmd.startswith("! ")
        p = subprocess.run(
            shlex.split(cmd.removeprefix("! ")),
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        sys.stderr.write(p.stderr[-4000:])
        outs.append(p.stdout)
        errs.append(p.stderr)
        (work / f"step{len(outs)}.out").write_text(p.stdout)
        (work / f"step{len(outs)}.err").write_text(p.stderr)
        if (p.returncode == 0) == expect_failure:
            said = "succeeded, though it is expected to fail" if expect_failure else f"failed (exit {p.returncode})"
            raise SystemExit(f"[{m.name}] {said}: {cmd}")
    wall = time.monotonic() - t0
    st = stamp(m, started, source, wall, load)
    for src, dst in m.figures:
        DATA.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(work / src, DATA / dst)
    (DATA / f"{m.name}.json").write_text(json.dumps(st, indent=1) + "\n")
    write(m, st, Done(work, tuple(outs), tuple(errs), tuple(m.commands())))
    print(f"[{m.name}] -> {(DATA / f'{m.name}.md').relative_to(ROOT)} ({wall:.0f} s)", file=sys.stderr)


def write(m: Measurement, st: dict[str, object], done: Done) -> None:
    """The results file: its stamp line and what `m` renders of `done`; README.md's block of it."""
    DATA.mkdir(parents=True, exist_ok=True)
    (DATA / f"{m.name}.md").write_text(
        f"<!-- written by `make docs-results ONLY={m.name}`; edits are overwritten -->\n\n"
        f"{stamp_line(st)}\n\n{m.render(done).strip()}\n"
    )
    if update_readme(m.name):
        print(f"[{m.name}] README.md's headline table rewritten", file=sys.stderr)


def render_again(m: Measurement) -> None:
    """Rewrite a results file from its last run's work directory and stamp, without measuring
    again (after a change to how it is rendered)."""
    work = WORK / m.name
    steps = sorted(work.glob("step*.out"), key=lambda p: int(p.stem.removeprefix("step")))
    stamp_file = DATA / f"{m.name}.json"
    if not steps or not stamp_file.exists():
        from testbed.core.errors import UserError

        raise UserError(f"{m.name}: no earlier run to render again ({work} or {stamp_file} is missing)")
    errs = tuple(p.with_suffix(".err").read_text() if p.with_suffix(".err").exists() else "" for p in steps)
    write(
        m,
        json.loads(stamp_file.read_text()),
        Done(work, tuple(p.read_text() for p in steps), errs, tuple(m.commands())),
    )


README = ROOT / "README.md"
README_BLOCK = re.compile(r"(<!-- results:([\w-]+) -->)\n(.*?)\n?(<!-- /results -->)", re.S)


def readme_block(data: str) -> str:
    """What README.md shows of a results file: its stamp line and tables, without the comment."""
    return "\n".join(line for line in data.splitlines() if not line.startswith("<!--")).strip()


def update_readme(name: str) -> bool:
    """Rewrite README.md's `<!-- results:NAME -->` block from the results file; False if it has none."""
    text = README.read_text()
    data = (DATA / f"{name}.md").read_text()
    new = README_BLOCK.sub(
        lambda m: f"{m.group(1)}\n{readme_block(data)}\n{m.group(4)}" if m.group(2) == name else m.group(0), text
    )
    if new != text:
        README.write_text(new)
    return any(m.group(2) == name for m in README_BLOCK.finditer(text))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.docsite.results", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated measurement names (default: all)")
    ap.add_argument("--skip-emulation", action="store_true", help="run only the model and simulation ones")
    ap.add_argument("--list", action="store_true", help="list the measurements and exit")
    ap.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite the results files from the last run's outputs (build/results/NAME) and stamp, measuring nothing",
    )
    args = ap.parse_args(argv)
    chosen = by_name([n for n in args.only.split(",") if n])
    if args.list:
        print(
            table(
                ("name", "backend", "root", "commands"),
                [(m.name, m.backend, "yes" if m.needs_root else "", "; ".join(m.commands())) for m in chosen],
            )
        )
        return 0
    if args.skip_emulation:
        chosen = [m for m in chosen if not m.emulated]
    if args.render_only:
        for m in chosen:
            if (DATA / f"{m.name}.json").exists():
                render_again(m)
        return 0
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", "COLUMNS": "160"}
    for m in chosen:
        if m.needs_root and os.geteuid() != 0:
            print(f"[{m.name}] skipped: needs root", file=sys.stderr)
            continue
        if m.extra and importlib.util.find_spec(m.extra.split(":")[1]) is None:
            extra = m.extra.split(":")[0]
            print(f"[{m.name}] skipped: needs the `{extra}` extra (pip install -e '.[{extra}]')", file=sys.stderr)
            continue
        run(m, env)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
