"""The run-directory reference: its files, `records.csv`'s columns (from
`testbed.metrics.records.COLUMNS` and the record's fields), every key of `summary.json` and of
`run.json` (from the typed artefacts, `testbed.metrics.artefacts`), and their schema versions."""

from __future__ import annotations

import inspect
from types import ModuleType

from pydantic import BaseModel

from testbed.core.record import TIME_NAMES, RequestRecord, StageTimes
from testbed.docsite.fielddoc import FieldRow, field_doc, model_rows
from testbed.docsite.markdown import table
from testbed.metrics import records
from testbed.metrics.artefacts import RunInfo, Summary, run_file, summary_file

# The files a run directory may hold. The code has no list of them (each writer names its own),
# so this one is the reference's own.
FILES: tuple[tuple[str, str], ...] = (
    (
        "run.json",
        "What the run was: scenario, policy, threshold, scale, shaping method, SLOs, offered rate, "
        "versions, t0, and its state (keys below).",
    ),
    ("scenario.yaml", "The resolved scenario, as run."),
    ("deployment.json", "Every service's address."),
    (
        "records.csv",
        "One row per request (columns below), written as requests finish (a simulated `replay` of more than "
        "20,000 requests writes it beside records.parquet and removes it when it ends; `testbed export RUN` "
        "writes it from the Parquet file where it is missing).",
    ),
    (
        "records.parquet",
        "A simulated `replay` of more than 20,000 requests: one row per request, every field of the record "
        "(columns below), a row group per 8,192 requests as they finish. Read where there is no records.csv.",
    ),
    (
        "decisions.parquet",
        "A simulated `replay` of more than 20,000 requests: decisions.jsonl's lines as the columns `ts`, "
        "`source`, `metric`, `value`, `labels` (a map). Read where there is no decisions.jsonl.",
    ),
    (
        "decisions.jsonl",
        "Every routing decision (cached prefix, bandwidth state, threshold in force, reason), every "
        "threshold change the control loops made, every long-term decision (`role_decision`: "
        "drain, activate, retune, hold) and every health change, each with its reason (a simulated `replay` "
        "of more than 20,000 requests keeps decisions.parquet alone).",
    ),
    (
        "timeseries/*.jsonl",
        "Samples per service at 10 Hz of wire time: queue depth, running batch, KV memory, KV "
        "bytes sent and received, per-connection TCP_INFO (rtt, retransmits, delivery rate, "
        "cwnd), threshold, prefix-cache pool use; the control loop's samples.",
    ),
    ("summary.json", "The figures (keys below)."),
    ("report.md", "The report: summary tables, TTFT breakdown, fidelity and validity, plots."),
    ("ttft_cdf.png, queues.png, links.png", "The report's plots."),
    ("wan.png", "WAN link usage against the configured rate (backends with shaped links)."),
    (
        "control.png",
        "With the short-term loop: threshold over time, delivered WAN rate against the loop's "
        "estimate, predicted loads.",
    ),
    (
        "roles.png",
        "With the long-term loop: PD instances per role over time, its decisions, the stage loads it "
        "judged, the threshold.",
    ),
    ("logs/*.log", "Each service's log (`rst-N.log`: a reset injector's)."),
    (
        "faults.jsonl",
        "With `faults:`, every fault step executed: `t` (paper s after t0), `fault`, `kind`, "
        "`phase`, `target`, `detail`, `outcome`.",
    ),
    ("topology.json, delayline.json", "netns backend: namespaces, addresses, the delay line's configuration."),
    (
        "timeseries/wan.jsonl, timeseries/delayline.jsonl",
        "Backends with shaped links: WAN interface counters and the configured rate in force; delay-line counters.",
    ),
    ("compose.yaml, stack.yaml", "compose and swarm backends: the generated file, with the command to rerun it."),
    ("prometheus/", "With `--prometheus`: the generated scrape configuration and Prometheus's data."),
    ("speedup-probes/", "With `--speedup auto`: the probe runs."),
    (
        ".testbed.lock",
        "The command that wrote the directory (pid, start, command line): locked while it runs, so "
        "another command is refused; afterwards it marks a previous output, replaced only with "
        "`--overwrite`.",
    ),
)


def record_columns() -> list[tuple[str, str, str]]:
    """(column, type, what it holds) for every column of records.csv, in file order."""
    out = []
    for c in records.COLUMNS:
        cls: type = StageTimes if c in TIME_NAMES else RequestRecord
        kind = "float (wire s since t0)" if c in TIME_NAMES else records._KINDS[c]
        out.append((c, kind, field_doc(cls, c)))
    return out


def parquet_columns() -> list[tuple[str, str, str]]:
    """(column, type, what it holds) for every column of records.parquet, in file order."""
    from testbed.metrics.columnar import RECORD_SCHEMA

    out = []
    for f in RECORD_SCHEMA:
        cls: type = StageTimes if f.name in TIME_NAMES else RequestRecord
        out.append((f.name, str(f.type), field_doc(cls, f.name)))
    return out


def _key_rows(model: type[BaseModel]) -> list[FieldRow]:
    return list(model_rows(model))


def _versions(mod: ModuleType) -> str:
    doc = inspect.getdoc(mod) or ""
    i = doc.find("Schema versions")
    if i < 0:
        return ""
    part = doc[i:].split("\n\n")[0]
    return part.split(":", 1)[1].strip() if ":" in part.splitlines()[0] else part


def page() -> str:
    out = [
        "# Run directory",
        "",
        "Every run (`testbed replay`, `up`, the probes of `capacity` and `sweep`, on every backend including "
        "the simulator) writes one directory. `summary.json` and `run.json` are typed "
        "(`testbed.metrics.artefacts`): this page lists their keys from those models, and `records.csv`'s "
        "columns from `testbed.metrics.records`, so it names every key this version writes.",
        "",
        "## Files",
        "",
        table(
            ("file", "what it holds"),
            [(f"`{f}`" if "," not in f else ", ".join(f"`{x.strip()}`" for x in f.split(",")), d) for f, d in FILES],
        ),
        "",
        "## `records.csv`",
        "",
        "One row per request of the trace (a hold: per request the router answered). Times are wire seconds "
        "since the run's t0, empty where a stage never happened; paper figures are derived in the summary "
        "(times x speedup, bytes x byte_scale). The columns are the file's external format and keep their "
        "names and order; a file written before a column was added reads as its default.",
        "",
        table(("column", "type", "what it holds"), [(f"`{c}`", t, d) for c, t, d in record_columns()]),
        "",
        "## `records.parquet`",
        "",
        "What a simulated `replay` of more than 20,000 requests writes (Parquet, zstd; a shorter one writes "
        "records.csv alone): records.csv's values, and every field and stamp "
        "of the record, in the record's order (`testbed.core.record`), so a field added there is a column "
        "here. Stamps are durations in microseconds since the run's t0 (null where a stage never happened: "
        "pandas reads them as timedeltas); texts are cut as records.csv's. `testbed export RUN` writes "
        "records.csv and decisions.jsonl from the Parquet files, the lines the run would have written; "
        "`pandas.read_parquet(RUN / 'records.parquet')` reads it whole. A file is readable once its writer "
        "closed it (a run stopped by Ctrl-C does; one killed outright leaves it unreadable).",
        "",
        table(("column", "type", "what it holds"), [(f"`{c}`", t, d) for c, t, d in parquet_columns()]),
        "",
        "## `summary.json`",
        "",
        "Paper units unless a key ends in `_wire` or sits under `wire`; figures over an empty set are `null`. "
        "`<name>` stands for a key that is a name (a series, a link direction, a reason, an action); `[]` for "
        "an item of a list.",
        "",
        table(("key", "type", "what it holds"), [(f"`{r.path}`", r.typename, r.doc) for r in _key_rows(Summary)]),
        "",
        "## `run.json`",
        "",
        "Written when the run starts (state `running`), again when the services are up (`shaping`, `t0`) and "
        "when it ends (`t_end`, state `finished`, `interrupted` or `failed`: a live run fails when its router "
        "stopped answering before the replay ended, and the command then exits non-zero naming it). Backends "
        "add facts of their own under `shaping` and `versions`. Every JSON file of a run holds finite numbers "
        "or null, never `Infinity` or `NaN`.",
        "",
        table(("key", "type", "what it holds"), [(f"`{r.path}`", r.typename, r.doc) for r in _key_rows(RunInfo)]),
        "",
        "## Schema versions",
        "",
        f"`summary.json` is at version {summary_file.SUMMARY_VERSION}, `run.json` at {run_file.RUN_VERSION}, "
        f"the records at {records.RECORDS_VERSION} (records.csv's header names its columns; records.parquet "
        "carries its version in its metadata). "
        "A file newer than the testbed knows is refused with one line naming the file and the version; a "
        "malformed one (a missing section, a wrong type, a key the model does not know) with one line naming "
        "the file and the field, e.g. `run/summary.json: ttft_s.mean: Input should be a valid number`. "
        "Unknown keys are errors everywhere except where the keys are names.",
        "",
        "### `summary.json`",
        "",
        _versions(summary_file),
        "",
        "### `run.json`",
        "",
        _versions(run_file),
        "",
        "### The records (`records.csv`, `records.parquet`)",
        "",
        _versions(records),
        "",
    ]
    return "\n".join(out) + "\n"
