"""Whose loss a probe stream measured (pure): the link's, or the host's own.

A numbered UDP probe stream cannot tell a probe the emulated link dropped from one the machine
running the emulation dropped: a full socket buffer, a full per-CPU backlog between two veths,
a queue that overflowed while a slow CPU stalled. The kernel counts each of these where it
happens, so the loss measurement reads every counter on the path before and after the stream
and accounts for each lost probe:

- `before`: dropped before the loss model saw the probe (the sender's own failures, the
  sending host and switch, the WAN router's ingress, a full TUN ring). The model never decided
  on these: they leave the count of probes it saw.
- `model`: the loss model's own drops (netem's qdisc, the delay line's Gilbert chain).
- `after`: dropped after the model let the probe through (the bottleneck queue of the delay
  line, the WAN router's egress, the receiving switch and host, the receiving socket).

The link's loss is then `model / (sent - before)`. The figure is INVALID, with its reasons,
when it cannot be told from the host's drops: probes lost where no counter saw them (or
counters that saw more drops than probes lost), netem's drops when its own queue may have
overflowed (netem counts its loss and its overflow as one figure), or too few probes reaching
the model for the figure to stand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

Stage = Literal["before", "model", "after"]
STAGES: tuple[Stage, ...] = ("before", "model", "after")

# More than this share of the probes dropped before the model: the figure rests on fewer
# probes than its bar was sized for.
MAX_BEFORE_SHARE = 0.10


@dataclass(frozen=True)
class Counter:
    """One cumulative drop counter on the probes' path."""

    stage: Stage
    place: str  # e.g. "dc-b host eth0 rx_dropped", "netem 1:10 on dc1"
    value: int


Snapshot = Mapping[str, Counter]  # place -> counter


@dataclass(frozen=True)
class QueueBound:
    """netem counts its queue overflow and its loss as one `drops`: its drops are the profile's
    loss only while its queue could not have been full. `peak_in_flight` bounds what netem held
    at any moment: probes sent and not yet received (it holds no more than the path does)."""

    limit_packets: int
    peak_in_flight: int


@dataclass(frozen=True)
class LossAccount:
    sent: int
    received: int
    measured: float | None  # what the probes alone say: (sent - received) / sent
    link: float | None  # the loss model's drops over the probes it saw
    valid: bool
    reasons: list[str]
    drops: dict[str, int]  # place -> drops during the stream (non-zero ones)
    by_stage: dict[str, int]  # stage -> drops
    unexplained: int | None  # lost probes no counter accounts for (negative: counters saw more)
    send_retries: int = 0  # sends the kernel refused at first (full buffer) and took on retry
    socket_overflow: int | None = None  # the receiving socket's own count (SO_RXQ_OVFL)
    extra: dict[str, int | float | str] = field(default_factory=dict)

    @property
    def host_drops(self) -> int:
        return self.by_stage.get("before", 0) + self.by_stage.get("after", 0)


def deltas(before: Snapshot, after: Snapshot) -> tuple[dict[str, Counter], list[str]]:
    """Per place, what the counter rose by; places read only once, or that went backwards
    (a counter reset), are reasons the account cannot be trusted."""
    out: dict[str, Counter] = {}
    problems: list[str] = []
    for place in sorted(set(before) | set(after)):
        a, b = before.get(place), after.get(place)
        if a is None or b is None:
            problems.append(f"counter {place} read only {'after' if a is None else 'before'} the stream")
            continue
        if b.value < a.value:
            problems.append(f"counter {place} went back from {a.value} to {b.value}")
            continue
        out[place] = Counter(b.stage, place, b.value - a.value)
    return out, problems


def account_loss(
    sent: int,
    received: int,
    before: Snapshot | None,
    after: Snapshot | None,
    *,
    queue: QueueBound | None = None,
    send_retries: int = 0,
    socket_overflow: int | None = None,
    read_error: str | None = None,
) -> LossAccount:
    """The account of one probe stream. `before`/`after`: the path's counters around it (None:
    they could not be read, `read_error` says why). `queue`: where the model is netem, its
    limit and the bound on what it held."""
    lost = sent - received
    measured = lost / sent if sent else None
    reasons: list[str] = []
    if sent <= 0:
        reasons.append("no probe was sent")
    if before is None or after is None:
        reasons.append(
            "the host's drop counters could not be read"
            + (f" ({read_error})" if read_error else "")
            + ": its drops cannot be told from the link's"
        )
        return LossAccount(sent, received, measured, None, False, reasons, {}, {}, None, send_retries, socket_overflow)
    d, problems = deltas(before, after)
    reasons += problems
    by_stage: dict[str, int] = {s: sum(c.value for c in d.values() if c.stage == s) for s in STAGES}
    if socket_overflow is not None and socket_overflow > 0:
        # The socket's own count is a subset of the namespace's UDP receive errors; when that
        # namespace count was not read (or read less), the socket's stands in for it.
        udp = sum(c.value for c in d.values() if c.stage == "after" and "Udp" in c.place)
        by_stage["after"] += max(socket_overflow - udp, 0)
    up, model, down = by_stage["before"], by_stage["model"], by_stage["after"]
    unexplained = lost - up - model - down
    if unexplained > 0:
        reasons.append(f"{unexplained} of {lost} lost probes vanished where no counter saw them")
    elif unexplained < 0:
        reasons.append(f"the counters saw {-unexplained} more drops than probes were lost: not all were probes")
    seen = sent - up
    if sent > 0 and up > MAX_BEFORE_SHARE * sent:
        reasons.append(
            f"the host dropped {up} of {sent} probes before the link "
            f"(more than {MAX_BEFORE_SHARE:.0%}): too few reached it"
        )
    extra: dict[str, int | float | str] = {}
    if queue is not None:
        extra = {"netem_limit_packets": queue.limit_packets, "peak_in_flight": queue.peak_in_flight}
        # Probes dropped after netem left it at an unknown moment: each may have been in it.
        held = queue.peak_in_flight + down
        if model > 0 and held >= queue.limit_packets:
            reasons.append(
                f"netem's queue may have overflowed (up to {held} probes held against its limit "
                f"of {queue.limit_packets}): its {model} drops cannot be told from the profile's loss"
            )
    link = model / seen if seen > 0 else None
    valid = not reasons and link is not None
    return LossAccount(
        sent,
        received,
        measured,
        link if valid else None,
        valid,
        reasons,
        {p: c.value for p, c in d.items() if c.value},
        by_stage,
        unexplained,
        send_retries,
        socket_overflow,
        extra,
    )


def peak_in_flight(intervals: Sequence[tuple[float, float]]) -> int:
    """Most (sent, received) intervals open at one moment: an upper bound on the probes any
    queue on the path held at once (a probe a queue holds has been sent and not yet received)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(r, -1) for _, r in intervals], key=lambda e: (e[0], e[1]))
    peak = cur = 0
    for _, step in events:
        cur += step
        peak = max(peak, cur)
    return peak
