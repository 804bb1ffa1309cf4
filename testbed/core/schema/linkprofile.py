"""WAN link profiles (`netem_profiles/*.yaml`) and their wire-unit form.

A profile is in paper units: rate in bit/s, one-way delay and jitter in seconds, loss as a
fraction with a correlation in [0, 1), a queue limit, an optional MTU, TCP settings and a
schedule of changes over (paper) time. `LinkParams` is the same link after time and byte
scaling: what the kernel shaper and the delay line are configured with.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from testbed.core.schema.scaling import Scale

_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([kmgt]?)(bit|bps)?(?:/s)?\s*$", re.I)
_TIME_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*(us|ms|s)?\s*$", re.I)
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmg]?)(i?)b?\s*$", re.I)


def parse_rate(v: object) -> float:
    """'100gbit', '25 Gbit/s', '1.5e9', 1e9 -> bit/s."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str) and (m := _RATE_RE.match(v)):
        return float(m.group(1)) * _UNITS[m.group(2).lower()]
    raise ValueError(f"not a rate: {v!r} (use e.g. '100gbit' or bits per second)")


def parse_time(v: object) -> float:
    """'15ms', '0.5 s', '200us', 0.015 -> seconds."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str) and (m := _TIME_RE.match(v)):
        unit = (m.group(2) or "s").lower()
        return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[unit]
    raise ValueError(f"not a duration: {v!r} (use e.g. '15ms')")


def parse_size(v: object) -> int:
    """'4MiB', '64k', 65536 -> bytes (k/M/G are powers of 1024 with or without the i)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, str) and (m := _SIZE_RE.match(v)):
        mult = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[m.group(2).lower()]
        return int(float(m.group(1)) * mult)
    raise ValueError(f"not a size: {v!r} (use e.g. '4MiB')")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TcpSettings(_Strict):
    congestion: str | None = None  # e.g. cubic, bbr, reno
    rmem_max: int | None = None  # bytes: top of net.ipv4.tcp_rmem in the link's namespaces
    wmem_max: int | None = None  # bytes: top of net.ipv4.tcp_wmem

    @field_validator("rmem_max", "wmem_max", mode="before")
    @classmethod
    def _size(cls, v: object) -> int | None:
        return None if v is None else parse_size(v)


class LinkChange(_Strict):
    """A change at `at` (paper seconds since the run started); unset fields keep their value."""

    at: float = Field(ge=0)
    rate: float | None = Field(default=None, gt=0)
    delay: float | None = Field(default=None, ge=0)
    jitter: float | None = Field(default=None, ge=0)
    loss: float | None = Field(default=None, ge=0, le=1)
    note: str = ""

    @field_validator("at", "delay", "jitter", mode="before")
    @classmethod
    def _time(cls, v: object) -> float | None:
        return None if v is None else parse_time(v)

    @field_validator("rate", mode="before")
    @classmethod
    def _rate(cls, v: object) -> float | None:
        return None if v is None else parse_rate(v)


class LinkProfile(_Strict):
    name: str
    description: str = ""
    rate: float = Field(gt=0)  # bit/s, paper units
    delay: float = Field(default=0.0, ge=0)  # one-way, seconds
    jitter: float = Field(default=0.0, ge=0)
    loss: float = Field(default=0.0, ge=0, le=1)
    loss_correlation: float = Field(default=0.0, ge=0, lt=1)
    queue_limit: int | None = Field(default=None, ge=1500)  # bytes at the bottleneck; default: BDP
    mtu: int | None = Field(default=None, ge=576, le=65535)
    tcp: TcpSettings = TcpSettings()
    schedule: list[LinkChange] = []

    @field_validator("rate", mode="before")
    @classmethod
    def _rate(cls, v: object) -> float:
        return parse_rate(v)

    @field_validator("delay", "jitter", mode="before")
    @classmethod
    def _time(cls, v: object) -> float:
        return parse_time(v)

    @field_validator("queue_limit", mode="before")
    @classmethod
    def _size(cls, v: object) -> int | None:
        return None if v is None else parse_size(v)

    @model_validator(mode="after")
    def _sorted(self) -> LinkProfile:
        ats = [c.at for c in self.schedule]
        if ats != sorted(ats):
            raise ValueError("schedule entries must be in time order")
        return self

    def wire(self, scale: Scale, min_queue: int = 2 * 65536) -> LinkParams:
        return LinkParams.from_profile(self, scale, min_queue)


@dataclass(frozen=True)
class LinkParams:
    """One direction of a link in wire units: what shapers are configured with."""

    rate_bps: float
    delay_s: float
    jitter_s: float
    loss: float
    loss_correlation: float
    queue_bytes: int
    mtu: int | None

    @classmethod
    def from_profile(cls, p: LinkProfile, scale: Scale, min_queue: int = 2 * 65536) -> LinkParams:
        rate = scale.wire_rate_bps(p.rate)
        delay = scale.wire_seconds(p.delay)
        jitter = scale.wire_seconds(p.jitter)
        return cls(
            rate,
            delay,
            jitter,
            p.loss,
            p.loss_correlation,
            queue_bytes(rate, delay, p.queue_limit, scale, min_queue),
            p.mtu,
        )

    def with_change(self, c: LinkChange, p: LinkProfile, scale: Scale) -> LinkParams:
        out = self
        if c.rate is not None:
            out = replace(out, rate_bps=scale.wire_rate_bps(c.rate))
        if c.delay is not None:
            out = replace(out, delay_s=scale.wire_seconds(c.delay))
        if c.jitter is not None:
            out = replace(out, jitter_s=scale.wire_seconds(c.jitter))
        if c.loss is not None:
            out = replace(out, loss=c.loss)
        return out

    @property
    def bdp_bytes(self) -> int:
        """Bandwidth-delay product of the round trip (2 x one-way delay)."""
        return int(self.rate_bps / 8 * 2 * self.delay_s)


def queue_bytes(rate_bps: float, delay_s: float, limit: int | None, scale: Scale, min_queue: int) -> int:
    """Bottleneck queue: the profile's limit (paper bytes, scaled) or one round-trip BDP, so
    TCP never sees drops the profile did not ask for; never below `min_queue` (a few MTUs)."""
    if limit is not None:
        return max(int(limit / scale.byte_scale), min_queue)
    return max(int(rate_bps / 8 * 2 * delay_s), min_queue)


def schedule_wire(p: LinkProfile, scale: Scale) -> list[tuple[float, LinkParams]]:
    """(wire seconds since start, parameters in force from then on) for each scheduled change."""
    cur = p.wire(scale)
    out: list[tuple[float, LinkParams]] = []
    for c in p.schedule:
        cur = cur.with_change(c, p, scale)
        out.append((scale.wire_seconds(c.at), cur))
    return out
