"""The shape of what `testbed linkcheck` measures: its JSON output (`--json`,
compare-methods.json) as typed dicts. Dicts, not dataclasses: a result is filled step by step as
the link is measured, and results written by earlier versions (without the later keys) are read
back by the same functions, so most keys are optional."""

from __future__ import annotations

from typing import TypedDict


class ScaleFigures(TypedDict):
    speedup: float
    byte_scale: float


class Configured(TypedDict):
    """The profile as shaped: wire figures, with the paper's beside them."""

    rate_bps_wire: float
    rate_bps_paper: float
    rtt_s_wire: float
    rtt_s_paper: float
    loss: float
    loss_correlation: float
    queue_bytes: int | None
    jitter_s_wire: float


class RttFigures(TypedDict, total=False):
    median_s: float
    p10_s: float
    p90_s: float
    sd_s: float
    replies: int
    probes: int
    base_median_s: float  # the same path unshaped
    base_sd_s: float
    host_median_s: float | None
    valid: bool  # False: the host was too busy to time the link (`reasons` say why)
    reasons: list[str]
    line_late_per_trip_s: float
    line_late_packets: int
    line_cpu_wait_per_trip_s: float
    attempts: list[RttFigures]  # every run when the first was invalid


class LossFigures(TypedDict, total=False):
    """`LossAccount` of the probe stream (its `extra` keys beside these)."""

    sent: int
    received: int
    measured: float | None  # probes lost / sent
    link: float | None  # the link's share, the host's drops taken out
    valid: bool
    reasons: list[str]
    host_drops: dict[str, int]
    by_stage: dict[str, int]
    unexplained: int | None
    send_retries: int
    socket_overflow: int | None
    pps: float
    sender_stalls: int
    sender_stalled_s: float
    netem_limit_packets: int
    peak_in_flight: int
    attempts: list[LossFigures]


class ProbeFigures(TypedDict):
    """`ProbeStats` of the probe stream."""

    sent: int
    received: int
    loss: float | None
    loss_correlation: float | None
    reordered: float | None
    delay_median_s: float | None
    delay_sd_s: float | None


class Goodput(TypedDict, total=False):
    """One transfer over the project's KV transport."""

    connections: int
    bytes: int
    seconds: float
    ok: bool
    reason: str
    bps: float | None  # over the whole transfer
    steady_bps: float | None  # past TCP's ramp
    congestion: str | None
    received: list[tuple[float, int]]  # (seconds since the start, bytes received so far)
    peer_window_bytes: int | None
    rcvbuf: int  # the receiver's SO_RCVBUF when it was made small (window-limited)
    predicted_bps: float | None  # min(rate, window / RTT) on one connection
    # window-limited transfer only: the delay line's lateness per round trip, and whether the
    # host let the figure measure the link (`reasons` say why not)
    line_late_per_trip_s: float
    valid: bool
    reasons: list[str]


class Iperf3(TypedDict, total=False):
    connections: int
    bps: float
    error: str


class RateChange(TypedDict):
    old_bps: float
    new_bps: float
    follow_s: float | None  # until throughput was within 10% of the new rate (None: never)
    measured_before_bps: float | None


class LinkCheckResult(TypedDict, total=False):
    """One profile on one shaping method."""

    profile: str
    method: str
    mtu: int
    scale: ScaleFigures
    configured: Configured
    took_s: dict[str, float]  # wall seconds by step
    rtt: RttFigures
    loss: LossFigures
    probes: ProbeFigures  # --compare-methods
    goodput: list[Goodput]  # N connections first, then 1, then window-limited
    window_sysctls: dict[str, int]
    iperf3: Iperf3 | None
    rate_change: RateChange
    verdicts: dict[str, bool | None]  # None: the figure was invalid, neither pass nor fail


class MethodComparison(TypedDict):
    """`--compare-methods`: one profile, one result per shaping method."""

    profile: str
    methods: dict[str, LinkCheckResult]
