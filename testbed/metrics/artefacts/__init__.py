"""Typed run-directory files: `summary.json` (`Summary`), `run.json` (`RunInfo`), each with a
`schema_version`, read and written through `read_artefact` / `write_artefact`."""

from testbed.metrics.artefacts.io import (
    LEGACY_VERSION,
    Artefact,
    RunDirError,
    parse_artefact,
    read_artefact,
    write_artefact,
)
from testbed.metrics.artefacts.run_file import RUN_VERSION, RunInfo, run_info
from testbed.metrics.artefacts.summary_file import LAYOUT, SUMMARY_VERSION, Summary

__all__ = [
    "LAYOUT",
    "LEGACY_VERSION",
    "RUN_VERSION",
    "SUMMARY_VERSION",
    "Artefact",
    "RunDirError",
    "RunInfo",
    "Summary",
    "parse_artefact",
    "read_artefact",
    "run_info",
    "write_artefact",
]
