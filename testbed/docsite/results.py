"""The measurements the documentation quotes, one registry entry each, and the runner behind
`make docs-results`.

Each measurement runs its commands into `build/results/<name>/` and writes what the docs quote
to `docs/results/data/<name>.md` (tables, stamped with the date, commit, host and command) and
`<name>.json` (the stamp as data), and copies its figures beside them. Pages include those files
(`--8<-- "results/data/<name>.md"`); a figure in the docs comes from one of them. Adding a
measurement is one `Measurement(...)` in `MEASUREMENTS`.

    python -m testbed.docsite.results [--only NAME,...] [--skip-emulation] [--list]
"""

from __future__ import annotations

import argparse
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from testbed.docsite.markdown import code, demote, table
from testbed.metrics.artefacts import Summary, read_artefact

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "results" / "data"
WORK = ROOT / "build" / "results"


@dataclass(frozen=True)
class Done:
    """What a measurement's commands left: its work directory and each step's stdout."""

    work: Path
    stdout: tuple[str, ...]


Render = Callable[[Done], str]


@dataclass(frozen=True)
class Measurement:
    name: str                 # file stem under docs/results/data/
    title: str
    what: str                 # one sentence: what it measures and how
    backend: str              # what does the measuring: model, sim, netns, compose, uml
    steps: tuple[str, ...]    # commands run in order from the repository root; {work} is its work directory
    render: Render
    figures: tuple[tuple[str, str], ...] = ()     # (file under {work}, name under docs/results/data/)
    needs_root: bool = False
    reads: tuple[str, ...] = ()                   # measurements whose work directory a step reads

    @property
    def emulated(self) -> bool:
        return self.backend not in ("model", "sim")

    def commands(self) -> list[str]:
        work = WORK.relative_to(ROOT) / self.name
        return [s.replace("{work}", str(work)).replace("{results}", str(WORK.relative_to(ROOT))) for s in self.steps]


# -- renderers -------------------------------------------------------------------------------

MAKE_NOISE = re.compile(r"^make\[\d+\]: (Entering|Leaving) directory .*\n?", re.M)


def stdout_of(step: int = -1) -> Render:
    """A step's standard output, verbatim (less make's directory lines)."""
    def render(d: Done) -> str:
        return code(MAKE_NOISE.sub("", d.stdout[step]), "text")
    return render


def include(rel: str, drop: Sequence[str] = ()) -> Render:
    """A Markdown file the command wrote, its title dropped, its headings one level deeper, image
    links and the sections named in `drop` left out."""
    def render(d: Done) -> str:
        text = (d.work / rel).read_text()
        lines = text.splitlines()
        if lines and lines[0].startswith("# "):
            lines = lines[1:]
        out: list[str] = []
        skipping = False
        for line in lines:
            m = re.match(r"^(#+)\s+(.*)", line)
            if m:
                skipping = any(m.group(2).strip().startswith(x) for x in drop)
            if skipping or re.match(r"^\s*!\[[^\]]*\]\([^)]*\)\s*$", line):
                continue
            out.append(line)
        return demote("\n".join(out).strip(), 1)
    return render


SummaryCell = Callable[[Summary], str]


def runs_table(runs: Sequence[tuple[str, str]], rows: Sequence[tuple[str, SummaryCell]]) -> Render:
    """A table with a column per run (label, run directory under {work}) and a row per figure,
    read from each run's `summary.json`."""
    def render(d: Done) -> str:
        sums = [read_artefact(d.work / rel / "summary.json", Summary) for _, rel in runs]
        return table(("", *[label for label, _ in runs]), [(label, *[f(s) for s in sums]) for label, f in rows])
    return render


def both(*parts: Render) -> Render:
    def render(d: Done) -> str:
        return "\n\n".join(p(d) for p in parts)
    return render


def _f(x: float | None, spec: str = ".2f", scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


# Cells of `runs_table`, paper units.


def completed(s: Summary) -> str:
    return f"{s.requests.completed} / {s.requests.total}"


def ttft_mean_p90(s: Summary) -> str:
    return f"{_f(s.ttft_s.mean)} / {_f(s.ttft_s.p90)}"


def ttft_p99(s: Summary) -> str:
    return _f(s.ttft_s.p99)


def queue_compute(s: Summary) -> str:
    b = s.ttft_breakdown_s
    return f"{_f(b.prefill_queue, '.3f')} / {_f(b.prefill_compute)}"


def tail_ms(s: Summary) -> str:
    return _f(s.ttft_breakdown_s.transfer_tail, ".1f", 1e3)


def tail_s(s: Summary) -> str:
    return _f(s.ttft_breakdown_s.transfer_tail, ".3f")


def tpot_ms(s: Summary) -> str:
    return _f(s.tpot_s.mean, ".2f", 1e3)


def offload(s: Summary) -> str:
    return _pct(s.offload.ratio)


def wan_link(s: Summary) -> str:
    w = s.wan_link
    if w.mean_bps_paper is None:
        return "-"
    return f"{w.mean_bps_paper / 1e9:.2f} / {_f(w.peak_bps_paper, '.1f', 1e-9)} Gbit/s"


def wan_bytes_per_request(s: Summary) -> str:
    v = s.bytes.wan_per_request_paper
    return "-" if v is None else f"{v / 1e6:,.1f} MB"


def cached_share(s: Summary) -> str:
    return _pct(s.cache.cached_token_share if s.cache else None)


def halves(s: Summary) -> str:
    h = s.ttft_halves_s
    return "-" if h is None else f"{_f(h.first.mean)} / {_f(h.last.mean)}"


def thresholds(s: Summary) -> str:
    c = s.control
    if c is None or c.threshold_mean is None:
        return "-"
    return f"{c.threshold_changes}; {c.threshold_mean:,.0f}"


def roles(s: Summary) -> str:
    lt = s.long_term
    if lt is None:
        return "-"
    return f"{lt.conversions}: {lt.split_start} -> {lt.split_end}"


def validity(s: Summary) -> str:
    return "valid" if s.valid else "INVALID: " + "; ".join(s.validity.reasons if s.validity else [])


def throughput(s: Summary) -> str:
    return _f(s.throughput.completed_rps_paper, ".3f")


PAPER3 = ("paper-homogeneous", "paper-prfaas", "paper-naive")
LABELS3 = ("homogeneous PD", "PrfaaS-PD", "naive heterogeneous")
COMPARE_ROWS: tuple[tuple[str, SummaryCell], ...] = (
    ("completed / total", completed), ("TTFT mean / P90 (s)", ttft_mean_p90), ("TTFT P99 (s)", ttft_p99),
    ("prefill queue / compute, mean (s)", queue_compute), ("KV transfer tail, mean (ms)", tail_ms),
    ("TPOT mean (ms)", tpot_ms), ("offload ratio", offload), ("WAN link mean / peak (counters)", wan_link),
    ("timing", validity),
)


def _three(sub: str) -> tuple[tuple[str, str], ...]:
    return tuple((label, f"{sub}/{sc}") for label, sc in zip(LABELS3, PAPER3))


PAPER_TABLE = "--probes 6 --requests 300 --ttft-slo 30 --wait-growth 2.5 --set workload.seed=45"
CACHE_SET = "--trace traces/samples/mooncake-agent-sample.jsonl --set links.inter_dc=cross-region-15g-measured"
BW_SET = "--set links.inter_dc=cross-region-100g-fluctuating --rate 2.2 --requests 400 --set workload.seed=45"

MEASUREMENTS: tuple[Measurement, ...] = (
    Measurement(
        "replay", "make replay: the three paper deployments, emulated",
        "The paper's three deployments (Table 6) on one seeded workload (240 requests of the paper's "
        "synthetic workload at 1.6 req/s, seed 7) over the 100 Gbit/s cross-region link, speedup 4, "
        "byte_scale 256; paper units.",
        "netns", ("make replay RUNS={work}",),
        runs_table(_three("paper-compare"), COMPARE_ROWS),
        figures=(("paper-compare/ttft_cdf.png", "replay-ttft-cdf.png"),), needs_root=True),
    Measurement(
        "replay-sim", "make replay-sim: the same comparison, simulated",
        "make replay's workload and deployments on the discrete-event simulator.",
        "sim", ("make replay-sim RUNS={work}",),
        runs_table(_three("paper-compare-sim"), COMPARE_ROWS)),
    Measurement(
        "crosscheck", "Model, simulation and emulation side by side",
        "`testbed crosscheck` on make replay's recorded emulation: the simulator's figures against the "
        "emulated ones, each difference against its tolerance, and the model's figure where it has one.",
        "sim", ("testbed crosscheck --scenario paper-homogeneous --scenario paper-prfaas --scenario paper-naive "
                "--emulated {results}/replay/paper-compare --out {work}",),
        include("crosscheck.md"), reads=("replay",)),
    Measurement(
        "model", "The analytical model (Table 6)",
        "The paper's analytical model and optimiser on its three deployments.",
        "model", ("testbed model --scenario paper-prfaas --scenario paper-homogeneous --scenario paper-naive "
                  "--optimise",),
        stdout_of()),
    Measurement(
        "model-bandwidth", "KV bandwidth of the paper's six models (Table 3, section 2.3)",
        "Phi_kv per instance and cluster egress from the model profiles, against the paper's figures.",
        "model", ("testbed model --bandwidth",), stdout_of()),
    Measurement(
        "table6-sim", "Table 6 by simulation: Lambda_max of the three deployments",
        "The capacity search of make replay-paper (6 probes of 300 requests, seed 45, TTFT SLO 30 s, wait "
        "growth at most 2.5 s) with every probe simulated.",
        "sim", ("make replay-paper-sim RUNS={work}",), include("paper-table-sim/table6.md")),
    Measurement(
        "table6", "Table 6 by emulation: Lambda_max of the three deployments",
        "make replay-paper: the capacity search on the netns backend over the 100 Gbit/s cross-region link.",
        "netns", ("make replay-paper RUNS={work}",), include("paper-table/table6.md"), needs_root=True),
    Measurement(
        "threshold-sweep-sim", "Lambda_max over the threshold, simulated",
        "A capacity search at each threshold t (4 probes of 300 requests, seed 45) against the model's "
        "Lambda_max(t): the shape of the paper's Fig. 5b.",
        "sim", ("testbed sweep --scenario paper-prfaas --param policy.threshold=10000,15000,19400,25000,32000 "
                "--capacity-probes 4 --requests 300 --set workload.seed=45 --backend sim --out {work}",),
        include("sweep.md")),
    Measurement(
        "cache-aware-sim", "Cache-aware against length-only routing, simulated",
        "The agent sample (Mooncake format, 400 long-context agent requests with prefix reuse) on "
        "paper-prfaas and paper-prfaas-cache over the measured 14.7 Gbit/s cross-cloud profile.",
        "sim", (f"testbed replay --compare paper-prfaas paper-prfaas-cache {CACHE_SET} --backend sim --report --out {{work}}",),
        runs_table((("length-only", "paper-prfaas"), ("cache-aware", "paper-prfaas-cache")),
                   (("TTFT mean / P90 (s)", ttft_mean_p90), ("TTFT P99 (s)", ttft_p99),
                    ("prefill queue / compute, mean (s)", queue_compute), ("KV transfer tail, mean (s)", tail_s),
                    ("offloaded to PrfaaS", offload), ("WAN bytes per request (KV + cache moves)",
                                                       wan_bytes_per_request),
                    ("prompt tokens served from cache", cached_share)))),
    Measurement(
        "load-aware-sim", "Load-aware cache routing, simulated",
        "make replay-load-aware: the first 10 minutes of a one-hour Mooncake-format surrogate of a "
        "conversation trace on length-only, the paper's cache rules and load-aware routing.",
        "sim", ("make replay-load-aware RUNS={work}",),
        runs_table((("length-only", "load-aware/paper-prfaas"), ("paper cache rules", "load-aware/paper-prfaas-cache"),
                    ("load-aware", "load-aware/paper-prfaas-load-aware")),
                   (("completed / total", completed), ("TTFT mean / P90 (s)", ttft_mean_p90),
                    ("offloaded to PrfaaS", offload), ("WAN bytes per request", wan_bytes_per_request),
                    ("prompt tokens served from cache", cached_share)))),
    Measurement(
        "bandwidth-aware-sim", "Bandwidth-aware against fixed-threshold routing, simulated",
        "The paper workload at 2.2 req/s (400 requests, seed 45) on paper-prfaas and paper-prfaas-bw while "
        "the WAN drops to 10% for a minute, then to half, then recovers (cross-region-100g-fluctuating).",
        "sim", (f"testbed replay --compare paper-prfaas paper-prfaas-bw {BW_SET} --backend sim --report --out {{work}}",),
        both(runs_table((("fixed threshold", "paper-prfaas"), ("bandwidth-aware", "paper-prfaas-bw")),
                        (("TTFT mean / P90 (s)", ttft_mean_p90), ("TTFT P99 (s)", ttft_p99),
                         ("KV transfer tail, mean (s)", tail_s), ("offloaded", offload),
                         ("threshold changes; time-weighted mean t", thresholds))),
             include("comparison.md", drop=("Verdict", "Side by side", "TTFT CDF", "Runs")))),
    Measurement(
        "longterm-sim", "The long-term loop, simulated",
        "make replay-longterm: the first 10 minutes of a one-hour conversation trace at its own rate on the "
        "paper's static configuration, on the same with both loops on, and on what `testbed plan` makes of "
        "the trace.",
        "sim", ("make replay-longterm RUNS={work}",),
        both(runs_table((("static (paper-prfaas)", "longterm/compare/paper-prfaas"),
                         ("both loops (paper-prfaas-adaptive)", "longterm/compare/paper-prfaas-adaptive"),
                         ("planned", "longterm/compare/plan-prfaas-1")),
                        (("TTFT mean, first / last half of arrivals (s)", halves),
                         ("TTFT mean / P90 (s)", ttft_mean_p90), ("TTFT P99 (s)", ttft_p99),
                         ("offloaded", offload), ("threshold changes; time-weighted mean t", thresholds),
                         ("role conversions: PD split", roles))),
             include("longterm/plan/plan.md", drop=("The base scenarios", "Ranking", "How the figures")))),
    Measurement(
        "bench-sim", "The simulator's speed and scale",
        "make bench-sim: a one-hour Mooncake-format trace on paper-prfaas, and a 10,000-GPU deployment under "
        "15 minutes of the paper's workload at 80% of its model Lambda_max.",
        "sim", ("make bench-sim RUNS={work}",), stdout_of()),
    Measurement(
        "fidelity", "Timing fidelity of the emulator",
        "make bench: 40 requests at 0.3 req/s (no queueing), measured against modelled timings.",
        "netns", ("testbed bench fidelity --scenario paper-prfaas --out {work}",), stdout_of(), needs_root=True),
    Measurement(
        "linkcheck", "What shaped links deliver against their profiles",
        "make linkcheck: one shaped link per profile between two namespaces, scaled to 1 Gbit/s on the wire "
        "(speedup 1): RTT, goodput on several connections and on one, a window-limited connection, loss, and how "
        "fast throughput follows a rate change.",
        "netns", ("make linkcheck",), stdout_of(), needs_root=True),
    Measurement(
        "feasibility", "Which model can cross which link (the feasibility map)",
        "make models: PrfaaS-PD against homogeneous PD for every model profile x link rate x RTT, by the model "
        "and by simulation.",
        "sim", ("testbed feasibility --out {work}",), include("report.md"),
        figures=(("map.png", "feasibility-map.png"),)),
)


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
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", "testbed", ":(exclude)testbed/docsite",
                      "scenarios", "netem_profiles", "traces", "Makefile", "pyproject.toml"))
    return commit, dirty


def stamp(m: Measurement, started: datetime, source: tuple[str, bool], wall_s: float) -> dict[str, object]:
    return {"name": m.name, "title": m.title, "date": started.strftime("%Y-%m-%d %H:%M UTC"),
            "commit": source[0], "local_changes": source[1], "host": socket.gethostname(), "cores": os.cpu_count(),
            "kernel": platform.release(), "backend": m.backend, "commands": m.commands(), "wall_s": round(wall_s, 1)}


def stamp_line(st: dict[str, object]) -> str:
    cmds = st["commands"]
    assert isinstance(cmds, list)
    changes = " (with local changes)" if st.get("local_changes") else ""
    return (f"*Measured {st['date']} at commit `{st['commit']}`{changes} on {st['host']} ({st['cores']} cores, "
            f"Linux {st['kernel']}), {st['backend']}, in {st['wall_s']} s, by* "
            + "; ".join(f"`{c}`" for c in cmds))


def run(m: Measurement, env: dict[str, str]) -> None:
    work = WORK / m.name
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    outs: list[str] = []
    started, source = datetime.now(timezone.utc), source_state()
    t0 = time.monotonic()
    for cmd in m.commands():
        print(f"[{m.name}] {cmd}", file=sys.stderr, flush=True)
        p = subprocess.run(shlex.split(cmd), cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        outs.append(p.stdout)
        (work / f"step{len(outs)}.out").write_text(p.stdout)
        if p.returncode != 0:
            raise SystemExit(f"[{m.name}] failed (exit {p.returncode}): {cmd}")
    wall = time.monotonic() - t0
    st = stamp(m, started, source, wall)
    for src, dst in m.figures:
        DATA.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(work / src, DATA / dst)
    (DATA / f"{m.name}.json").write_text(json.dumps(st, indent=1) + "\n")
    write(m, st, Done(work, tuple(outs)))
    print(f"[{m.name}] -> {(DATA / f'{m.name}.md').relative_to(ROOT)} ({wall:.0f} s)", file=sys.stderr)


def write(m: Measurement, st: dict[str, object], done: Done) -> None:
    """The results file: its stamp line and what `m` renders of `done`; README.md's block of it."""
    DATA.mkdir(parents=True, exist_ok=True)
    (DATA / f"{m.name}.md").write_text(
        f"<!-- written by `make docs-results ONLY={m.name}`; edits are overwritten -->\n\n"
        f"{stamp_line(st)}\n\n{m.render(done).strip()}\n")
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
    write(m, json.loads(stamp_file.read_text()), Done(work, tuple(p.read_text() for p in steps)))


README = ROOT / "README.md"
README_BLOCK = re.compile(r"(<!-- results:([\w-]+) -->)\n(.*?)\n?(<!-- /results -->)", re.S)


def readme_block(data: str) -> str:
    """What README.md shows of a results file: its stamp line and tables, without the comment."""
    return "\n".join(line for line in data.splitlines() if not line.startswith("<!--")).strip()


def update_readme(name: str) -> bool:
    """Rewrite README.md's `<!-- results:NAME -->` block from the results file; False if it has none."""
    text = README.read_text()
    data = (DATA / f"{name}.md").read_text()
    new = README_BLOCK.sub(lambda m: f"{m.group(1)}\n{readme_block(data)}\n{m.group(4)}" if m.group(2) == name
                           else m.group(0), text)
    if new != text:
        README.write_text(new)
    return any(m.group(2) == name for m in README_BLOCK.finditer(text))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.docsite.results", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated measurement names (default: all)")
    ap.add_argument("--skip-emulation", action="store_true", help="run only the model and simulation ones")
    ap.add_argument("--list", action="store_true", help="list the measurements and exit")
    ap.add_argument("--render-only", action="store_true",
                    help="rewrite the results files from the last run's outputs (build/results/NAME) and stamp, "
                         "measuring nothing")
    args = ap.parse_args(argv)
    chosen = by_name([n for n in args.only.split(",") if n])
    if args.list:
        print(table(("name", "backend", "root", "commands"),
                    [(m.name, m.backend, "yes" if m.needs_root else "", "; ".join(m.commands())) for m in chosen]))
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
        run(m, env)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
