"""What a measurement of the documentation is, and the renderers that turn what its commands left
into the Markdown the docs include. The registry of measurements is `measurements.py`; the runner
behind `make docs-results` is `results.py`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from testbed.docsite.markdown import code, demote, table
from testbed.metrics.artefacts import Summary, read_artefact

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "results" / "data"
WORK = ROOT / "build" / "results"


@dataclass(frozen=True)
class Done:
    """What a measurement's commands left: its work directory and each step's stdout (and its
    stderr, for the steps that expect to fail or time themselves)."""

    work: Path
    stdout: tuple[str, ...]
    stderr: tuple[str, ...] = ()
    commands: tuple[str, ...] = ()


Render = Callable[[Done], str]


@dataclass(frozen=True)
class Measurement:
    name: str  # file stem under docs/results/data/
    title: str
    what: str  # one sentence: what it measures and how
    backend: str  # what does the measuring: model, sim, netns, compose, uml
    steps: tuple[str, ...]  # commands run in order from the repository root; {work} is its work directory
    render: Render
    figures: tuple[tuple[str, str], ...] = ()  # (file under {work}, name under docs/results/data/)
    needs_root: bool = False
    reads: tuple[str, ...] = ()  # measurements whose work directory a step reads
    extra: str = ""  # an optional extra it needs: "name:module" (pip extra, import)

    @property
    def emulated(self) -> bool:
        return self.backend not in ("model", "sim", "profile")

    def commands(self) -> list[str]:
        """The steps as run; a step written `! CMD` is expected to fail (its exit status is not 0)."""
        work = WORK.relative_to(ROOT) / self.name
        return [s.replace("{work}", str(work)).replace("{results}", str(WORK.relative_to(ROOT))) for s in self.steps]


# -- renderers -------------------------------------------------------------------------------

MAKE_NOISE = re.compile(r"^make\[\d+\]: (Entering|Leaving) directory .*\n?", re.M)


def stdout_of(step: int = -1) -> Render:
    """A step's standard output, verbatim (less make's directory lines)."""

    def render(d: Done) -> str:
        return code(MAKE_NOISE.sub("", d.stdout[step]), "text")

    return render


def transcript(*steps: int) -> Render:
    """Steps as a terminal shows them: `$ command`, then what it printed (standard error too, for
    a step expected to fail)."""

    def render(d: Done) -> str:
        parts = []
        for i in steps:
            cmd = d.commands[i].removeprefix("! ") if i < len(d.commands) else ""
            err = d.stderr[i] if i < len(d.stderr) and d.commands[i].startswith("! ") else ""
            parts.append(f"$ {cmd}\n{MAKE_NOISE.sub('', d.stdout[i])}{err}".rstrip())
        return code("\n".join(parts), "text")

    return render


def include(rel: str, drop: Sequence[str] = (), only: Sequence[str] = ()) -> Render:
    """A Markdown file the command wrote, its title dropped, its headings one level deeper, image
    links and the sections named in `drop` left out (with `only`, only the sections named, their
    subsections included)."""

    def render(d: Done) -> str:
        text = (d.work / rel).read_text()
        lines = text.splitlines()
        if lines and lines[0].startswith("# "):
            lines = lines[1:]
        out: list[str] = []
        skipping, kept_level = bool(only), 0
        for line in lines:
            m = re.match(r"^(#+)\s+(.*)", line)
            if m:
                title = m.group(2).strip()
                if only:
                    level = len(m.group(1))
                    if any(title.startswith(x) for x in only):
                        skipping, kept_level = False, level
                    elif not skipping and level <= kept_level:
                        skipping = True
                else:
                    skipping = any(title.startswith(x) for x in drop)
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
