# Types of the compiled twins (native/src); each mirrors the pure-Python module it names.
from collections.abc import Callable, Iterable
from typing import Any

from testbed.core.engine.decode_batch import Batch
from testbed.core.routing.prefix_cache import MatchView, PrefixPool as PrefixPoolView, StatsView
from testbed.core.record import StageTimes
from testbed.metrics.records import RecordRows as RecordRowsView
from testbed.core.engine.servicetime import DecodeStepTime
from testbed.sim.events import Loop
from testbed.sim.net_view import PathHandle

ABI: int

class PoolMatch(MatchView):
    """`testbed.core.routing.prefix_cache.Match`."""

class PoolStats(StatsView):
    """`testbed.core.routing.prefix_cache.PoolStats`, as read at one moment."""

class PrefixPool(PrefixPoolView):
    """`testbed.core.routing.prefix_cache.HybridPrefixCache`, compiled (`testbed.core.routing.prefix_cache.PrefixPool`)."""
    def __init__(self, capacity_bytes: int, block_tokens: int, block_bytes: int, state_bytes: int) -> None: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def state_bytes(self) -> int: ...
    @property
    def stats(self) -> PoolStats: ...
    def match(self, hash_ids: Iterable[int], input_tokens: int) -> PoolMatch: ...
    def holds(self, key: tuple[str, int, int]) -> bool: ...
    def state_lengths(self) -> list[int]: ...
    def entries(self) -> list[tuple[str, int, int, int, int]]: ...

class DecodeBatch(Batch):
    """`testbed.core.engine.decode_batch.DecodeBatch`, compiled (`testbed.core.engine.decode_batch.Batch`)."""
    def __init__(self, step_time: DecodeStepTime, bs_max: int, kv_capacity: int, time_scale: float = 1.0) -> None: ...
    @property
    def time_scale(self) -> float: ...
    @property
    def context(self) -> int: ...

class EventLoop(Loop):
    """`testbed.sim.events.EventLoop`, compiled (`testbed.sim.events.Loop`)."""
    def __init__(self) -> None: ...

def mooncake_rows(block: bytes, max_timestamp: int, min_tokens: int, max_input: int, max_output: int,
                  max_hash: int) -> list[tuple[int | float, int, int, tuple[int, ...]] | list[Any] | bytes]:
    """Each line of `block` (whole lines) as `testbed.traces.mooncake.iter_mooncake` reads a plain
    good row (timestamp, input_length, output_length, hash_ids); with `chat_id`, a list of those
    and chat_id, parent_chat_id (-1 where absent, None for null) and think_time (a float or None);
    else the line's bytes."""

def mooncake_scan(block: bytes, max_timestamp: int, min_tokens: int, max_input: int, max_output: int,
                  max_hash: int) -> tuple[int, int | float, int | float] | None:
    """Where every line of `block` is a row `mooncake_rows` reads as a plain one (no `chat_id`) and
    the timestamps never go back: (rows, first timestamp, last timestamp); else None."""

def series_lines(batch: list[tuple[float, str | None, Iterable[tuple[str, float, dict[str, str]]]]], speedup: float,
                 own: str) -> tuple[str, int] | None:
    """`testbed.metrics.series_batch.BatchSeriesFile`'s lines of a held batch and how many, or None
    where the batch must be written the Python way."""

def record_columns(records: list[Any], fields: list[tuple[str, str]], time_names: list[str],
                   settle: bool = False, max_chars: int = 0) -> list[bytes | tuple[bytes, bytes]] | None:
    """`testbed.metrics.columnar`'s column buffers of a batch of settled records (each field in
    order, then each stamp; a text's as (data, offsets)), or None where the batch must be built
    the Python way. `settle`: of records not settled, their values as settling makes them (a text
    of more than `max_chars` characters: None)."""

def decision_columns(held: list[Any], speedup: float) -> list[Any] | None:
    """`testbed.metrics.columnar.decision_batch`'s buffers of a held batch of decision lines (ts,
    source and metric texts as (data, offsets), values, label offsets, label keys and values as
    texts), or None where the batch must be built the Python way."""

class RecordRows(RecordRowsView):
    """`testbed.metrics.records.format_line` / `written_line` for a batch, compiled."""
    def __init__(self, columns: list[tuple[str, str, bool]], time_names: list[str], times_cls: type[StageTimes],
                 max_field: int) -> None: ...

class NetPath(PathHandle):
    """A path of a `FlowNet` (`testbed.sim.net_view.PathHandle`)."""

class FlowNet:
    """`testbed.sim.network.Network` compiled, for runs whose links never change
    (`testbed.sim.net_view.new_network` builds it)."""
    def __init__(self, loop: Any, net_priority: int, nodes: list[str], node_dc: list[int],
                 links: list[tuple[float, int]], nic_out: list[int], nic_in: list[int],
                 wan: dict[tuple[int, int], int], counters: int, sent_of: list[int], received_of: list[int],
                 route: dict[tuple[int, int], tuple[float, float]], conns: int, chunk: float) -> None: ...
    @property
    def rebalances(self) -> int: ...
    def bind(self) -> None: ...
    def path(self, src: str, dst: str) -> NetPath: ...
    def stream(self, p: NetPath, t: float, rate: float) -> None: ...
    def push(self, p: NetPath, t: float, nbytes: float) -> None: ...
    def end_stream(self, p: NetPath, t: float, nbytes: float) -> None: ...
    def mark(self, p: NetPath, pos: float, fn: Callable[[Any, float], None], arg: Any) -> None: ...
    def position(self, p: NetPath) -> float: ...
    def withdraw(self, p: NetPath, lo: float, hi: float) -> None: ...
    def _due(self, arg: tuple[int, int, int]) -> None: ...
    def sent_at(self, node: str, t: float) -> float: ...
    def sent_rate(self, node: str) -> float: ...
    def received_at(self, node: str, t: float) -> float: ...
    def link_bytes(self, link: int, t: float) -> float: ...
    def backlog(self, node: str, t: float) -> float: ...
