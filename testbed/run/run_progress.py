"""A run's progress, in the form its output suits: a live bar with an ETA on a terminal, plain
lines every few seconds elsewhere (a CI log, `make replay > log 2>&1`, a guest's console), where
a redrawn bar would leave hundreds of carriage-return frames.

A terminal is a TTY whose TERM is set and not `dumb`: a virtual machine's console is a TTY too,
but one that only a log reads (no TERM there)."""

from __future__ import annotations

import os
import sys
import threading
import time
from types import TracebackType
from typing import IO, Any

from testbed.live.replay_stats import ReplayStats

LINE_EVERY_S = 5.0  # plain lines: one every this many seconds, whether or not anything changed


def is_terminal(stream: IO[str] | None = None) -> bool:
    """`stream` (stderr) is an interactive terminal that redraws in place."""
    stream = stream if stream is not None else sys.stderr
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        return False
    return tty and os.environ.get("TERM", "") not in ("", "dumb")


def fmt_duration(s: float | None) -> str:
    """`42 s`, `3 min 05 s`, `1 h 02 min`; `?` when unknown."""
    if s is None or s != s or s < 0:
        return "?"
    if s < 9.95:
        return f"{s:.1f} s"
    s = round(s)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def eta_s(done: int, total: int, elapsed: float, expected_s: float | None) -> float | None:
    """Seconds left: the remaining requests at the rate so far, and never less than what the
    schedule still holds (an open-loop replay cannot finish before its last arrival)."""
    left_by_rate = (total - done) * elapsed / done if done > 0 and elapsed > 0 else None
    # Past its last planned arrival the schedule tells nothing more: the rate alone then.
    left_by_plan = None if expected_s is None or elapsed >= expected_s else expected_s - elapsed
    known = [x for x in (left_by_rate, left_by_plan) if x is not None]
    return max(known) if known else None


def progress_line(
    label: str, st: ReplayStats, elapsed: float, expected_s: float | None, finishing_s: float | None = None
) -> str:
    """One plain progress line: done/total, sent, failed, rate, elapsed, ETA; once every request
    is done (`finishing_s` since then), the replay's own figures and how long the finish has taken."""
    done = st.completed + st.failed
    if st.sent == 0 and done == 0:
        return f"{label}: starting the deployment ({fmt_duration(elapsed)})"
    pct = f" ({done / st.total:.0%})" if st.total else ""
    rate = done / elapsed if elapsed > 0 else 0.0
    head = f"{label}: {done}/{st.total} done{pct}, sent {st.sent}, failed {st.failed}, {rate:.2f} req/s"
    if finishing_s is not None:
        return (
            f"{head} in {fmt_duration(elapsed)}; stopping services and writing the summary and report "
            f"({fmt_duration(finishing_s)})"
        )
    return f"{head}, elapsed {fmt_duration(elapsed)}, ETA {fmt_duration(eta_s(done, st.total, elapsed, expected_s))}"


class PlainProgress:
    """A line on `stream` every LINE_EVERY_S seconds from a daemon thread (the replay's own loop
    may be busy or waiting on a slow start; the lines come regardless), and never a redraw.
    Elapsed time counts from the first request sent: the deployment's start-up is its own phase."""

    def __init__(
        self,
        label: str,
        total: int,
        expected_s: float | None,
        stream: IO[str] | None = None,
        every_s: float = LINE_EVERY_S,
    ) -> None:
        self.label, self.expected_s, self.every_s = label, expected_s, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.stats = ReplayStats(total=total)
        self._start = time.monotonic()
        self._t0: float | None = None
        self._done_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="progress", daemon=True)

    def update(self, st: ReplayStats) -> None:
        if self._t0 is None and st.sent:
            self._t0 = time.monotonic()
        self.stats = ReplayStats(st.sent, st.completed, st.failed, st.total or self.stats.total)
        if self._done_at is None and self.stats.total and st.completed + st.failed >= self.stats.total:
            self._done_at = time.monotonic()

    def line(self) -> str:
        now = time.monotonic()
        if self._t0 is None:
            return progress_line(self.label, ReplayStats(total=self.stats.total), now - self._start, None)
        if self._done_at is not None:
            return progress_line(self.label, self.stats, self._done_at - self._t0, self.expected_s, now - self._done_at)
        return progress_line(self.label, self.stats, now - self._t0, self.expected_s)

    def _loop(self) -> None:
        # On a fixed schedule, not `every_s` after the last line: a busy host delays a wake-up,
        # and the delays must not add up.
        due = time.monotonic() + self.every_s
        while not self._stop.wait(max(due - time.monotonic(), 0.0)):
            print(self.line(), file=self.stream, flush=True)
            due = max(due + self.every_s, time.monotonic() + self.every_s / 2)

    def __enter__(self) -> PlainProgress:
        self._thread.start()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()


class BarProgress:
    """rich's live bar on a terminal: done/total, sent, failed, elapsed and ETA."""

    def __init__(self, label: str, total: int, expected_s: float | None) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._prog = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("sent {task.fields[sent]}  failed {task.fields[failed]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            transient=False,
        )
        self._task = self._prog.add_task(label, total=total, sent=0, failed=0)

    def update(self, st: ReplayStats) -> None:
        self._prog.update(self._task, completed=st.completed + st.failed, sent=st.sent, failed=st.failed)

    def __enter__(self) -> BarProgress:
        self._prog.__enter__()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._prog.__exit__(et, e, tb)


class NoProgress:
    def update(self, st: ReplayStats) -> None:
        pass

    def __enter__(self) -> NoProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def run_progress(
    label: str, total: int, expected_s: float | None, enabled: bool = True
) -> BarProgress | PlainProgress | NoProgress:
    """The progress display that suits stderr: a bar on a terminal, plain lines elsewhere, none
    when `enabled` is false (--json: the output is for a program)."""
    if not enabled:
        return NoProgress()
    if is_terminal():
        return BarProgress(label, total, expected_s)
    return PlainProgress(label, total, expected_s)


class StepTicker:
    """A long step that reports nothing of its own (a plan over an hour of trace, a capacity
    probe): `what` once at the start, then `what: still running (N s)` every `every_s` seconds
    until it ends, so a log never goes quiet for longer."""

    def __init__(self, what: str, every_s: float = 10.0, stream: IO[str] | None = None) -> None:
        self.what, self.every_s = what, every_s
        self.stream = stream if stream is not None else sys.stderr
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="step-ticker", daemon=True)

    def _loop(self) -> None:
        due = time.monotonic() + self.every_s
        while not self._stop.wait(max(due - time.monotonic(), 0.0)):
            print(
                f"{self.what}: still running ({fmt_duration(time.monotonic() - self._start)})",
                file=self.stream,
                flush=True,
            )
            due = max(due + self.every_s, time.monotonic() + self.every_s / 2)

    def __enter__(self) -> StepTicker:
        print(f"{self.what} ...", file=self.stream, flush=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
