"""Per-request records: one row per trace request, written as the run goes (CSV).

Times are wire seconds relative to the run's start (`t0`); NaN where a stage never happened.
Paper-unit figures are derived in the summary (times x speedup, bytes x byte_scale).
"""

from __future__ import annotations

import csv
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterable, Iterator

NAN = float("nan")


@dataclass
class RequestRecord:
    request_id: str
    trace_index: int
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    arrival: float = NAN          # replayer sent the request
    routed: float = NAN           # router decided
    prefill_cluster: str = ""
    prefill_node: str = ""
    decode_node: str = ""
    crossed_wan: bool = False     # KV crossed datacenters
    threshold: float = NAN        # routing threshold in force (tokens), NaN if none
    prefill_queued: float = NAN
    prefill_start: float = NAN
    prefill_end: float = NAN
    prefill_modelled: float = NAN  # modelled prefill duration, wire seconds
    transfer_start: float = NAN
    transfer_end: float = NAN     # decode node holds all KV bytes
    decode_admitted: float = NAN
    first_token: float = NAN      # replayer saw the first token
    last_token: float = NAN
    tokens_received: int = 0
    kv_bytes_paper: int = 0       # KV the request shipped to its decode node (what that side lacked)
    kv_bytes_wire: int = 0
    outcome: str = "pending"      # completed | failed
    reason: str = ""
    decode_cached_tokens: int = 0  # prefix the decode cluster already held (its KV did not ship)
    cache_move_tokens: int = 0     # cached prefix tokens moved between clusters before the prefill
    cache_move_start: float = NAN  # router asked the source cluster to send it
    cache_move_end: float = NAN    # the prefill node holds it
    cache_move_bytes_paper: int = 0
    cache_move_bytes_wire: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        if self.tokens_received < 2:
            return NAN
        return (self.last_token - self.first_token) / (self.tokens_received - 1)


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RequestRecord))
_TYPES: dict[str, Any] = {f.name: f.type for f in dataclasses.fields(RequestRecord)}


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6f}"
    return str(v)


def _parse(name: str, raw: str) -> Any:
    typ = _TYPES[name]
    if typ in ("float", float):
        return float(raw) if raw != "" else NAN
    if typ in ("int", int):
        return int(raw) if raw != "" else 0
    if typ in ("bool", bool):
        return raw in ("1", "true", "True")
    return raw


class RecordWriter:
    """Appends records to CSV and flushes each row, so an interrupted run keeps what it has."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: IO[str] = path.open("w", newline="")
        self._w = csv.writer(self._fh)
        self._w.writerow(FIELDS)
        self._fh.flush()
        self.count = 0

    def write(self, rec: RequestRecord) -> None:
        self._w.writerow([_fmt(getattr(rec, f)) for f in FIELDS])
        self._fh.flush()
        self.count += 1

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_records(path: Path) -> list[RequestRecord]:
    return list(iter_records(path))


def iter_records(path: Path) -> Iterator[RequestRecord]:
    with path.open(newline="") as fh:
        r = csv.DictReader(fh)
        for row in r:
            kw = {k: _parse(k, v) for k, v in row.items() if k in _TYPES}
            yield RequestRecord(**kw)


def write_records(path: Path, records: Iterable[RequestRecord]) -> None:
    with RecordWriter(path) as w:
        for rec in records:
            w.write(rec)


@dataclass
class TimeSeriesPoint:
    """One sample: wire seconds since t0, the source (node or link), metric name, value."""

    t: float
    source: str
    metric: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)
