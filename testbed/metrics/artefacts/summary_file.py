"""`summary.json`: one run's figures (`testbed.metrics.summary` documents every key).

Schema versions (`schema_version`; `schema` is the older layout counter, kept as it was):
- 1: no `schema_version` key: written before the models. Read by the same model (its
  `schema_version` is then 1); sections that older layouts lacked (`validity`, `ttft_halves_s`, `cache`,
  `control`, `long_term`, `link_phases`, `wan_link`, the later fidelity measures) read as absent.
- 2: `schema_version` added; every other key and value as in version 1, so `testbed regress`
  compares a new run with a baseline written before.
- 3: `run.cut_short` (its process died without closing the run: `run.json` still says `running`)
  and `run.trace_requests` (requests the run was to send, when known). Every version-2 key is
  unchanged, and `run.interrupted` is also true for a run cut short.
- 4: `fidelity.warn` is no longer written: `validity` is the run's one verdict (the prefill error that
  `warn` judged is one of its bounds). Files of versions 1-3 keep their `warn` and read as before.
  `requests.failure_kinds` (failed records by their `failure_kind`; records.csv version 2) and
  `requests.failure_nodes` (by their `failure_node`); an older file reads with both empty.
- 5: `sessions` (a run of a trace with sessions: the arrival mode, sessions, early turns, figures by
  turn index; records.csv version 3); absent in older files and in runs of traces without sessions.
- 6: `fidelity.fault_late_max_s_paper` (with its bound) and `fidelity.fault_steps_failed`: a run whose fault
  steps took effect late or failed is invalid. An older file reads with neither (not judged). And the WAN
  delay line's lateness (`fidelity.wan_line_*`), reported, not judged.

Unknown keys are errors everywhere except where the keys are names (links, nodes, failure
reasons, decision actions): a dict of typed values there.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from testbed.metrics.artefacts.io import Artefact, Section

SUMMARY_VERSION = 6
LAYOUT = 2  # `schema`: 2 added `validity` and the fidelity section's decode, lag, router and CPU measures


class RunFacts(Section):
    name: str
    """The run's name (its directory's name, from `run.json`)."""
    scenario: str
    """The scenario's name, from `run.json`."""
    policy: str
    """The routing policy, from `run.json`."""
    threshold: float | None
    """Routing threshold in force at the start (tokens); `null` if none."""
    speedup: float
    """Time scale: wire time = paper time / speedup."""
    byte_scale: float
    """Byte scale: wire KV bytes = paper bytes / byte_scale."""
    shaping_method: str
    """How the WAN link was shaped (`run.json` `shaping.method`, e.g. `netem`, `fallback`, `none`, `sim`)."""
    offered_rate_rps: float | None
    """Offered arrival rate, paper req/s."""
    slo_ttft_s: float | None
    """TTFT SLO, paper seconds (`null` if `run.json` has none)."""
    slo_tpot_s: float | None
    """TPOT SLO, paper seconds (`null` if `run.json` has none)."""
    duration_s_paper: float | None
    """Run length (`t_end - t0`, else the latest record time), paper seconds."""
    interrupted: bool = False
    """`run.json` says the run was stopped early: its figures cover what finished."""
    cut_short: bool = False
    """The run's process died without closing it (`run.json` still says `running`, e.g. after `kill -9`);
    `interrupted` is then true as well."""
    trace_requests: int | None = None
    """Requests the run was to send (`run.json` `trace.requests`); `null` for a hold."""


class Requests(Section):
    total: int
    """Records in `records.csv`."""
    completed: int
    """Records with outcome `completed`."""
    failed: int
    """Records with outcome `failed`."""
    pending: int = 0
    """Records with any other outcome (the run stopped before they finished)."""
    failure_reasons: dict[str, int] = Field(default_factory=dict)  # keyed by reason
    """`{reason: count}` over failed records (`unknown` when a record gives none)."""
    failure_kinds: dict[str, int] = Field(default_factory=dict)  # keyed by failure kind
    """`{kind: count}` over failed records, by their `failure_kind` (`unknown` when a record gives none:
    written before records.csv had the column)."""
    failure_nodes: dict[str, int] = Field(default_factory=dict)  # keyed by instance
    """`{instance: count}` over failed records that name the instance they failed at (`failure_node`)."""


class Throughput(Section):
    completed_rps_paper: float | None
    """Completed requests / run duration, paper req/s."""
    completed_rps_wire: float | None
    output_tokens_per_s_paper: float | None
    """Tokens received by completed requests / run duration, paper tokens/s."""
    output_tokens_per_s_wire: float | None
    goodput_rps_paper: float | None
    """Completed requests meeting both SLOs / run duration, paper req/s. A request with fewer than 2 tokens has
    no TPOT and meets the TPOT SLO. SLO checks allow 1% for the testbed's own timing error."""
    goodput_rps_wire: float | None
    slo_met: int | None
    """Requests meeting both SLOs (`null`, like goodput, when `run.json` has no SLO)."""
    slo_attainment: float | None
    """`slo_met / requests.total` (failed and pending requests miss)."""


class Stats(Section):
    n: int
    """Number of values."""
    mean: float | None
    """Mean, seconds (paper seconds; wire seconds under `wire`)."""
    p50: float | None
    """Median, linear-interpolated (numpy)."""
    p90: float | None
    """90th percentile, linear-interpolated."""
    p99: float | None
    """99th percentile, linear-interpolated."""


class Halves(Section):
    split_s: float | None
    """Paper seconds from the first arrival to the middle of the arrival span."""
    first: Stats
    """TTFT of the completed requests that arrived in the first half of the arrival span."""
    last: Stats
    """TTFT of those that arrived in the last half: whether a run, or a control loop, settled."""


class Breakdown(Section):
    """Mean TTFT per stage (`testbed.metrics.summary.BREAKDOWN_STAGES`, in that order)."""

    routing: float | None
    """Mean `routed - arrival`."""
    prefill_queue: float | None
    """Mean `prefill_start - prefill_queued`."""
    prefill_compute: float | None
    """Mean `prefill_end - prefill_start`."""
    transfer_tail: float | None
    """Mean `transfer_end - prefill_end`: the KV transfer TTFT pays after layer-wise pipelining."""
    decode_queue: float | None
    """Mean `decode_admitted - transfer_end`."""
    first_step: float | None
    """Mean `first_token - decode_admitted`."""
    other: float | None
    """Mean of the rest of each TTFT (HTTP hops, e.g. `prefill_queued - routed`, token streaming back). A stage
    a request did not record counts 0 and its time lands here, so the parts sum to the mean TTFT."""

    def stage(self, name: str) -> float | None:
        v: float | None = getattr(self, name)
        return v


class Offload(Section):
    ratio: float | None
    """Share of completed requests whose KV crossed the WAN."""
    requests: int
    """Number of those requests."""


class Bytes(Section):
    kv_total_paper: float
    """KV bytes of completed requests: the recorded `kv_bytes_paper` (wire x byte_scale where not recorded)."""
    kv_total_wire: float
    kv_per_request_paper: float | None
    """`kv_total / requests.completed`."""
    kv_per_request_wire: float | None
    wan_total_paper: float
    """KV bytes of completed requests that crossed the WAN."""
    wan_total_wire: float
    wan_per_offloaded_request_paper: float | None
    """`wan_total / offload.requests`."""
    wan_per_offloaded_request_wire: float | None
    cache_move_paper: float = 0.0
    """Cached-prefix KV that cross-cluster cache moves of completed requests carried over the WAN."""
    cache_move_wire: float = 0.0
    wan_per_request_paper: float | None = None
    """`(wan_total + cache_move) / requests.completed`: every byte a request put on the WAN."""
    wan_per_request_wire: float | None = None


class Cache(Section):
    requests_with_hit: int
    """Requests that reused a cached prefix."""
    cached_token_share: float | None
    """Share of prompt tokens the prefill did not compute (served from a prefix cache)."""
    decode_cached_token_share: float | None = None
    """Share of prompt KV the decode side already held (it did not ship)."""
    moves: int
    """Cross-cluster cache moves."""
    move_tokens: int
    """Tokens those moves carried."""
    move_bytes_paper: float
    """Paper bytes those moves carried."""
    move_wait_s: float | None
    """Mean wait of a prefill for its moved prefix, paper seconds."""


class TurnFigures(Section):
    turn: int
    """Turn index (1 = a session's first turn); the last row also holds every later turn."""
    requests: int
    """Requests at this turn index."""
    completed: int
    """Of them, completed."""
    ttft_mean_s: float | None
    """Paper seconds, over completed requests."""
    ttft_p90_s: float | None
    """Paper seconds, over completed requests."""
    cached_token_share: float | None
    """Share of the prompt tokens of completed requests served from a prefix cache."""


class Sessions(Section):
    arrivals: str | None
    """open | closed (`testbed.core.sessions`); None: run.json predates it."""
    sessions: int
    """Sessions with a request in the run (a first turn alone is a session of one)."""
    follow_ups: int
    """Requests that follow another (turn 2 and later)."""
    early_turns: int
    """Follow-ups sent before their parent had finished (0 in closed loop; open loop's shortfall)."""
    turns_per_session_mean: float
    """Requests per session."""
    session_duration_s_mean: float | None
    """Paper seconds from a session's first send to its last answer (sessions whose turns all completed)."""
    by_turn: list[TurnFigures]
    """TTFT and the cached prompt share by turn index."""


class ThresholdChange(Section):
    t_s: float
    """When, paper seconds after t0."""
    old: float | None  # None: the decision did not say (NaN is not JSON)
    """Threshold before (tokens); `null` when the decision did not say."""
    new: float
    """Threshold after (tokens)."""
    reason: str
    """The control loop's reason."""


class Control(Section):
    threshold_changes: int
    """Threshold changes the control loops made."""
    changes: list[ThresholdChange]
    """The first 50 of them."""
    threshold_min: float | None
    """Lowest sampled threshold (tokens)."""
    threshold_max: float | None
    """Highest sampled threshold (tokens)."""
    threshold_mean: float | None
    """Time-weighted mean of the sampled threshold (tokens)."""
    bandwidth_estimate_min_bps: float | None
    """The short-term loop's lowest WAN bandwidth estimate, paper bit/s."""
    abundant_share: float | None
    """Share of the loop's samples that judged bandwidth abundant."""


class RoleDecision(Section):
    t_s: float
    """When, paper seconds after t0."""
    action: str
    """drain, activate, retune or hold."""
    node: str
    """The PD slot it acted on (empty for a retune or a hold)."""
    role: str
    """The role the slot leaves or takes."""
    prefill: int
    """PD prefill instances after the decision."""
    decode: int
    """PD decode instances after the decision."""
    threshold: float | None
    """Threshold in force after it (tokens)."""
    reason: str
    """The loop's reason: the loads and queues it judged."""


class LongTerm(Section):
    decisions: dict[str, int]  # keyed by action (drain, activate, retune, hold)
    """Decisions by action (`drain`, `activate`, `retune`, `hold`): count."""
    conversions: int
    """Role conversions completed."""
    changes: list[RoleDecision]
    """The first 50 decisions."""
    split_start: str | None
    """PD prefill / decode instances at the first sample, e.g. `3P/5D`."""
    split_end: str | None
    """The same at the last sample."""
    prefill_mean: float | None
    """Time-weighted mean of the PD instances serving as prefill."""


class LinkPhase(Section):
    start_s: float
    """Start of a stretch of constant configured link rate, paper seconds after t0."""
    end_s: float | None
    """Its end (`null`: the end of the run)."""
    rate_bps_paper: float
    """The configured rate in force, paper bit/s."""
    requests: int
    """Requests that arrived in it."""
    ttft_mean_s: float | None
    """Their mean TTFT, paper seconds."""
    ttft_p90_s: float | None
    """Their P90 TTFT, paper seconds."""
    tail_mean_s: float | None
    """Mean KV transfer tail of the offloaded ones, paper seconds."""
    offload_ratio: float | None
    """Their offload share."""


class Egress(Section):
    bytes_paper: float
    """Growth of the byte counters (`bytes_sent`, `kv_bytes_sent` series) of the sources that sent KV across
    the WAN (prefill nodes of offloaded requests)."""
    bytes_wire: float
    mean_Bps_paper: float | None
    """That growth / the span of those series, bytes/s (paper rate = wire rate x byte_scale / speedup). Divide
    by the link's rate for utilisation."""
    peak_Bps_paper: float | None
    """Highest rate of their summed counters, held on a common grid at the median sampling interval, bytes/s."""
    mean_Bps_wire: float | None
    peak_Bps_wire: float | None


class LinkCounter(Section):
    """One byte-counter series (`links.<source{label=value}>`)."""

    metric: str
    """The counter's metric (`bytes_sent`, `kv_bytes_sent`, ...)."""
    wan: bool
    """Whether the source sent KV across the WAN."""
    bytes_paper: float
    """Growth of the counter over the run."""
    bytes_wire: float
    mean_Bps_paper: float | None
    """Growth / the series' span, bytes/s."""
    peak_Bps_paper: float | None
    """Highest rate, bytes/s."""
    mean_Bps_wire: float | None
    peak_Bps_wire: float | None


class WanLinkUsage(Section):
    """One shaped direction's interface counters; peak and utilisation only where its series
    had two samples and a configured rate."""

    bytes_wire: float
    bytes_paper: float
    """Bytes through the direction's interface counters."""
    run_mean_bps_wire: float | None
    run_mean_bps_paper: float | None
    """Bits/s over the whole run."""
    mean_bps_wire: float | None
    mean_bps_paper: float | None
    """Bits/s over the arrival window (first to last request sent)."""
    peak_bps_wire: float | None = None
    peak_bps_paper: float | None = None
    """Highest rate over 100 ms (wire) windows."""
    configured_bps_wire: float | None = None
    configured_bps_paper: float | None = None
    """The configured rate at the start."""
    mean_utilisation: float | None = None
    """Measured rate / configured rate in force, mean over the arrival window."""
    run_mean_utilisation: float | None = None
    """The same over the whole run."""
    peak_utilisation: float | None = None
    """The highest 100 ms window's."""


class WanLink(Section):
    """The headline (KV) direction; only `links` (empty) without shaped links."""

    link: str | None = None
    """The shaped WAN direction that carried the most bytes (the KV direction), e.g. `dc-remote->dc-local`;
    absent without shaped links."""
    records_bps_paper: float | None = None
    """The same traffic from the records: offloaded requests per second x mean KV bytes per offloaded request,
    over the arrival window; compare with `mean_bps_paper`."""
    mean_bps_paper: float | None = None
    """Bits/s through that link from its interface counters, over the arrival window (first to last request
    sent)."""
    peak_bps_paper: float | None = None
    """Highest rate over 100 ms (wire) windows."""
    mean_bps_wire: float | None = None
    """`mean_bps_paper` in wire units."""
    run_mean_bps_paper: float | None = None
    """The same as `mean_bps_paper` over the whole run, including ramp-up and the drain after the last arrival."""
    window_s_paper: float | None = None
    """Length of the arrival window, paper seconds."""
    configured_bps_paper: float | None = None
    """The link's configured rate at the start (a schedule may change it; utilisation uses the rate in force)."""
    mean_utilisation: float | None = None
    """Measured rate / configured rate in force, mean over the arrival window."""
    peak_utilisation: float | None = None
    """The same for the highest 100 ms window."""
    bytes_per_offloaded_request_paper: float | None = None
    """Interface-counter bytes / offloaded requests."""
    records_kv_bytes_wire: float | None = None
    """KV wire bytes the records say crossed the WAN."""
    counters_over_records: float | None = None
    """Interface-counter bytes / KV bytes the records say crossed: a check of both (headers make it slightly
    above 1)."""
    links: dict[str, WanLinkUsage] = Field(default_factory=dict)  # keyed by `src->dst`
    """The same figures for every shaped direction, keyed `src->dst`."""


class FidelityBounds(Section):
    prefill_rel_err_median: float | None = None
    """Bound on `fidelity.prefill_rel_err_median`."""
    decode_step_late_share: float | None = None
    """Bound on `fidelity.decode_step_late_share`."""
    token_lag_p90_s_paper: float | None = None
    """Bound on `fidelity.token_lag_p90_s_paper`."""
    router_overhead_p90_s_paper: float | None = None
    """Bound on `fidelity.router_overhead_p90_s_paper`."""
    fault_late_max_s_paper: float | None = None
    """Bound on `fidelity.fault_late_max_s_paper` (summaries before version 6: none)."""


class Fidelity(Section):
    n: int
    """Records with measured and modelled prefill durations (any outcome)."""
    prefill_abs_err_median_s: float | None
    """Median abs(measured prefill - `prefill_modelled`), wire seconds: the testbed's own timing error."""
    prefill_rel_err_median: float | None
    """Median of that error / the modelled duration."""
    decode_step_late_share: float | None = None
    """Time decode steps fell behind their modelled schedule for good (what stretches TPOT), summed over decode
    nodes / modelled step time."""
    token_lag_p90_s_paper: float | None = None
    """P90 of (client received the last token - decode node emitted it), paper seconds."""
    router_overhead_p90_s_paper: float | None = None
    """P90 of (routed - router received the request), paper seconds."""
    cpu_busy_mean: float | None = None
    """Host CPU busy share over the run."""
    cpu_saturated_share: float | None = None
    """Share of host CPU samples at >= 95%."""
    fault_late_max_s_paper: float | None = None
    """The latest a fault step took effect after its schedule (`faults.jsonl`: its time less `at_s`, plus a link
    change's `took_s_wire`; a restart's end, the instance answering again, is not judged), paper seconds; None
    without faults. Since version 6."""
    fault_steps_failed: list[str] = Field(default_factory=list)
    """One line per fault step whose outcome was `failed: ...`: the run did not carry out its scenario. Since
    version 6."""
    wan_line_late_mean_s_wire: float | None = None
    """How late the WAN delay line (fallback shaping) wrote a packet on average, against its schedule, wire
    seconds; None without a delay line. Reported, not judged. Since version 6."""
    wan_line_late_share_of_delay: float | None = None
    """That mean over the least one-way delay configured on a WAN direction (`run.json` shaping.links). Since
    version 6."""
    wan_line_late_packets: float | None = None
    """Share of the delay line's packets written more than `testbed.net.delayline.LATE_S` late. Since version 6."""
    warn: bool | None = None
    """Versions 1-3 only: `prefill_rel_err_median` above 3%. Version 4 leaves it out: `validity` is the verdict."""
    bounds: FidelityBounds = Field(default_factory=FidelityBounds)
    """The bound each timing measure is held to (`testbed.metrics.fidelity`)."""


class Validity(Section):
    valid: bool
    """False when a timing measure exceeds its bound: the figures are not faithful to the scenario, `report.md`
    says so at the top and `testbed regress` fails the run."""
    reasons: list[str]
    """Each bound exceeded, in words."""


class Wire(Section):
    duration_s: float | None
    """Run length in wire seconds."""
    ttft_s: Stats
    """`ttft_s` in wire seconds."""
    ttft_breakdown_s: Breakdown
    """`ttft_breakdown_s` in wire seconds."""
    tpot_s: Stats
    """`tpot_s` in wire seconds."""


class SeriesInfo(Section):
    samples: int
    """Number of time-series samples."""
    metrics: list[str]
    """The metric names present."""


class Summary(Artefact):
    """`summary.json`. Sections older layouts lacked default to absent (None, empty)."""

    VERSION: ClassVar[int] = SUMMARY_VERSION

    schema_version: int = SUMMARY_VERSION
    """Version of this file's model (see the schema versions below); a file without it is version 1."""
    layout: int | None = Field(default=None, alias="schema")
    """Layout counter of the keys (2), older than `schema_version` and kept as it was."""
    run: RunFacts
    """What the run was, from `run.json`."""
    requests: Requests
    """How the recorded requests ended."""
    throughput: Throughput
    """Requests and tokens per second; paper units, `_wire` in wire units."""
    ttft_s: Stats
    """TTFT (first token - arrival) of completed requests, paper seconds."""
    ttft_halves_s: Halves | None = None
    """TTFT of the first and the last half of the arrivals."""
    ttft_breakdown_s: Breakdown
    """Mean TTFT per stage, paper seconds (completed requests)."""
    tpot_s: Stats
    """TPOT `(last_token - first_token) / (tokens - 1)` of completed requests with at least 2 tokens, paper
    seconds."""
    offload: Offload
    """Requests whose KV crossed the WAN."""
    bytes: Bytes
    """KV bytes moved, from the records."""
    cache: Cache | None = None
    """Prefix-cache reuse and cross-cluster cache moves (`testbed.metrics.control`)."""
    sessions: Sessions | None = None
    """A run of a trace with sessions: its arrival mode, early turns and figures by turn index."""
    control: Control | None = None
    """The short-term control loop's threshold changes and bandwidth estimates (`null` without it)."""
    long_term: LongTerm | None = None
    """The long-term loop's role conversions, retunes and PD split over time (`testbed.metrics.roles`); `null`
    when it did not run."""
    link_phases: list[LinkPhase] = Field(default_factory=list)
    """With a link schedule: per stretch of constant configured rate, the requests that arrived in it."""
    wan_egress: Egress
    """KV egress of the senders whose KV crossed the WAN, from their byte counters."""
    wan_link: WanLink = Field(default_factory=WanLink)
    """WAN link usage from the shaped interfaces' byte counters, against the configured rate."""
    links: dict[str, LinkCounter] = Field(default_factory=dict)  # keyed by series (`source{label=value}`)
    """Per byte-counter series (`source` or `source{label=value}`): the same figures as `wan_egress`."""
    fidelity: Fidelity
    """The run's own timing against the service model."""
    validity: Validity | None = None
    """Whether the run's timing was faithful enough for its figures to stand: the run's one verdict (`testbed
    replay` exits 3 when it is false; absent only in files written before layout 2)."""
    wire: Wire
    """The timing sections in wire seconds."""
    timeseries: SeriesInfo
    """What the time series hold."""

    @property
    def valid(self) -> bool:
        """False only when the run says so (older files without `validity` count as valid)."""
        return self.validity is None or self.validity.valid
