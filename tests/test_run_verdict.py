"""A run's verdict as its exit status and closing block, progress that suits its output, the
summaries of several runs as CSV, and the plots of a run on their own."""

from __future__ import annotations

import csv
import io
import time
from pathlib import Path

import pytest
from summaries import summary_figures

from testbed.cli import main
from testbed.live.replay_stats import ReplayStats
from testbed.metrics.artefacts import Summary
from testbed.metrics.verdict import EXIT_INVALID, EXIT_OK, RunOutcome, closing_block, exit_code, verdict_line
from testbed.run.run_progress import PlainProgress, eta_s, fmt_duration, is_terminal, progress_line

pytestmark = pytest.mark.pure

LATE = "decode steps 41.0% late against the model (bound 3%)"


def _summary(valid: bool) -> Summary:
    v = {"valid": True, "reasons": []} if valid else {"valid": False, "reasons": [LATE]}
    return Summary.model_validate(summary_figures(validity=v))


def test_an_invalid_run_exits_3_with_the_reason_and_the_fix_on_its_last_line(tmp_path: Path) -> None:
    ok, bad = (
        RunOutcome("homo", tmp_path / "homo", _summary(True)),
        RunOutcome("prfaas", tmp_path / "p", _summary(False)),
    )
    assert exit_code([ok]) == EXIT_OK and exit_code([ok, bad]) == EXIT_INVALID == 3
    assert exit_code([ok, bad], accept_invalid=True) == EXIT_OK
    last = closing_block([ok, bad], None)[-1]
    assert last.startswith("verdict: INVALID: 1 of 2 runs could not keep the scenario's time (prfaas: " + LATE)
    assert "--speedup auto" in last and "exit 3" in last
    assert "exit 0 (--accept-invalid)" in verdict_line([bad], accept_invalid=True)
    assert verdict_line([ok]) == "verdict: VALID: the run kept the scenario's time (exit 0)"


def test_the_closing_block_says_where_each_runs_files_are(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    (d / "report.md").write_text("x")
    (d / "ttft_cdf.png").write_bytes(b"x")
    block = closing_block([RunOutcome("run", d, _summary(False))], tmp_path / "comparison.md", ["run: +3% mean TTFT"])
    text = "\n".join(block)
    assert f"run  INVALID  {d}" in text and f"records {d / 'records.csv'}, summary {d / 'summary.json'}" in text
    assert (
        f"report {d / 'report.md'}, plots ttft_cdf.png" in text and f"comparison: {tmp_path / 'comparison.md'}" in text
    )
    assert "  run: +3% mean TTFT" in block
    # A long simulated run keeps records.parquet alone: the block names the file that is there.
    (d / "records.parquet").write_bytes(b"x")
    text = "\n".join(closing_block([RunOutcome("run", d, _summary(False))], None))
    assert f"records {d / 'records.parquet'}, summary" in text
    (d / "records.csv").write_text("x")
    assert f"records {d / 'records.csv'}," in "\n".join(closing_block([RunOutcome("run", d, _summary(False))], None))


@pytest.mark.parametrize("accept, rc", [(False, EXIT_INVALID), (True, EXIT_OK)])
def test_replay_says_invalid_first_and_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], accept: bool, rc: int
) -> None:
    from testbed.run.replay_command import _finish
    from testbed.run.runner import RunResult

    res = RunResult(tmp_path / "run", ReplayStats(), False, _summary(False))
    assert _finish(False, accept, [res], tmp_path / "run", report=False) == rc
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("INVALID RUN run: ") and LATE in lines[0]
    assert lines[-1].startswith("verdict: INVALID") and LATE in lines[-1]
    assert sum("INVALID RUN" in ln for ln in lines) == 1  # said first, then last in the verdict


def test_plain_progress_prints_lines_and_never_redraws() -> None:
    out = io.StringIO()
    with PlainProgress("run", 10, expected_s=2.0, stream=out, every_s=0.05) as prog:
        time.sleep(0.12)
        prog.update(ReplayStats(sent=4, completed=3, failed=1, total=10))
        time.sleep(0.12)
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert lines[0].startswith("run: starting the deployment (")
    assert any(ln.startswith("run: 4/10 done (40%), sent 4, failed 1, ") and "ETA " in ln for ln in lines), lines


def test_progress_line_and_eta() -> None:
    st = ReplayStats(sent=60, completed=50, failed=0, total=100)
    assert (
        progress_line("x", st, 10.0, 30.0)
        == "x: 50/100 done (50%), sent 60, failed 0, 5.00 req/s, elapsed 10 s, ETA 20 s"
    )
    done = ReplayStats(sent=100, completed=99, failed=1, total=100)
    assert progress_line("x", done, 20.0, 30.0, 12.0) == (
        "x: 100/100 done (100%), sent 100, failed 1, 5.00 req/s in 20 s; stopping services and writing the summary "
        "and report (12 s)"
    )
    assert eta_s(50, 100, 10.0, None) == 10.0 and eta_s(0, 100, 0.0, None) is None
    assert eta_s(99, 100, 10.0, 60.0) == 50.0  # an open loop cannot end before its last arrival
    assert eta_s(0, 40, 1.4, 0.3) is None  # all sent, none done yet: no rate to go by
    assert [fmt_duration(x) for x in (0.42, 42, 185, 3720, None)] == ["0.4 s", "42 s", "3 min 05 s", "1 h 02 min", "?"]


def test_a_log_or_a_console_without_term_is_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert not is_terminal(io.StringIO())
    monkeypatch.delenv("TERM", raising=False)
    assert not is_terminal(Tty())  # a guest's console: a TTY that only a log reads
    monkeypatch.setenv("TERM", "dumb")
    assert not is_terminal(Tty())
    monkeypatch.setenv("TERM", "xterm-256color")
    assert is_terminal(Tty())


def test_sim_replays_compare_to_csv_by_directory_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = [tmp_path / "a" / "x", tmp_path / "b" / "x"]
    for d in runs:
        assert (
            main(["replay", "--backend", "sim", "--scenario", "paper-prfaas", "--requests", "20", "--out", str(d)]) == 0
        )
        assert capsys.readouterr().out.strip().splitlines()[-1].startswith("verdict: VALID")
    assert not (runs[0] / "queues.png").exists()
    assert main(["plot", str(runs[0])]) == 0
    assert (runs[0] / "ttft_cdf.png").stat().st_size > 0 and (runs[0] / "queues.png").stat().st_size > 0
    capsys.readouterr()
    table = tmp_path / "all.csv"
    assert main(["compare", *map(str, runs), "--csv", str(table)]) == 0
    out = capsys.readouterr().out
    assert "a/x" in out and "b/x" in out and "#1" not in out  # runs named by their directories
    assert out.strip().splitlines()[-1] == "verdict: VALID: all 2 runs kept the scenario's time (exit 0)"
    rows = list(csv.DictReader(table.open()))
    assert [r["label"] for r in rows] == ["a/x", "b/x"] and {r["valid"] for r in rows} == {"True"}
    assert rows[0]["ttft_s.p90"] == rows[1]["ttft_s.p90"] != "" and "requests.completed" in rows[0]


def test_plots_name_their_run_and_say_invalid() -> None:
    from testbed.metrics.plot_style import line_styles, run_title

    assert run_title("r1", True, "queues") == "r1: queues"
    assert run_title("r1", False, "queues") == "INVALID RUN r1 (timing not faithful): queues"
    styles = line_styles(45)
    assert len(set(styles)) == 45
