"""The delay line's per-direction model: delay, truncated jitter, FIFO order, Gilbert loss."""

from __future__ import annotations

import math
import statistics

import pytest

from testbed.net.delayline_model import JITTER_SD_FACTOR, DelayLineModel

pytestmark = pytest.mark.pure

N_LOSS = 1_000_000


def _drops(p: float, c: float, seed: int = 7) -> list[bool]:
    m = DelayLineModel(0.0, loss=p, loss_correlation=c, seed=seed)
    admit = m.admit
    out = [admit(float(i), 1000) is None for i in range(N_LOSS)]
    assert m.packets_in == N_LOSS and m.packets_dropped == sum(out)
    assert m.bytes_in == 1000 * N_LOSS and m.bytes_dropped == 1000 * m.packets_dropped
    return out


def _runs(drops: list[bool]) -> list[int]:
    runs, n = [], 0
    for d in drops:
        if d:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    if n:
        runs.append(n)
    return runs


def test_fixed_delay_without_jitter_or_loss() -> None:
    m = DelayLineModel(0.015)
    assert [m.admit(t, 100) for t in (0.0, 1.0, 1.5)] == [0.015, 1.015, 1.515]
    assert (m.packets_in, m.bytes_in, m.packets_dropped) == (3, 300, 0)


def test_jitter_mean_sd_and_truncation() -> None:
    # Arrivals 1 s apart: FIFO never binds, so the samples are the raw jitter.
    m = DelayLineModel(0.010, jitter_s=0.002, seed=3)
    delays = [m.admit(float(i), 1500) - i for i in range(50_000)]  # type: ignore[operator]
    assert statistics.fmean(delays) == pytest.approx(0.010, abs=2e-5)
    assert statistics.pstdev(delays) == pytest.approx(0.002 * JITTER_SD_FACTOR, rel=0.02)
    assert JITTER_SD_FACTOR == pytest.approx(0.8796, abs=1e-4)
    assert min(delays) >= 0.006 - 1e-12 and max(delays) <= 0.014 + 1e-12


def test_jitter_never_makes_delay_negative() -> None:
    m = DelayLineModel(0.001, jitter_s=0.005, seed=1)
    assert all(m.admit(float(i), 1) >= i for i in range(10_000))  # type: ignore[operator]


def test_fifo_order_is_preserved_under_jitter() -> None:
    # Packets 10 us apart with 2 ms of jitter: netem would reorder most of them.
    m = DelayLineModel(0.005, jitter_s=0.002, seed=5)
    rel = [m.admit(i * 1e-5, 1500) for i in range(20_000)]
    assert all(r is not None for r in rel)
    assert all(b >= a for a, b in zip(rel, rel[1:]))  # type: ignore[operator]
    # Never earlier than the packet's own arrival plus the smallest possible delay.
    assert all(r >= i * 1e-5 + 0.001 for i, r in enumerate(rel))  # type: ignore[operator]


@pytest.mark.parametrize("c", [0.0, 0.25])
def test_gilbert_loss_mean_correlation_and_bursts(c: float) -> None:
    p = 0.01
    drops = _drops(p, c)
    assert sum(drops) / N_LOSS == pytest.approx(p, abs=5e-4)
    after_drop = [b for a, b in zip(drops, drops[1:]) if a]
    after_keep = [b for a, b in zip(drops, drops[1:]) if not a]
    lag1 = sum(after_drop) / len(after_drop) - sum(after_keep) / len(after_keep)
    assert lag1 == pytest.approx(c, abs=0.02)
    # Run lengths of drops are geometric with continuation probability c + (1 - c) p.
    runs = _runs(drops)
    assert statistics.fmean(runs) == pytest.approx(1 / (1 - (c + (1 - c) * p)), rel=0.03)


def test_loss_one_drops_everything_even_with_correlation() -> None:
    m = DelayLineModel(0.01, loss=1.0, loss_correlation=0.5)
    assert all(m.admit(float(i), 10) is None for i in range(1000))
    assert (m.packets_dropped, m.bytes_dropped) == (1000, 10_000)


def test_same_seed_same_losses() -> None:
    a = DelayLineModel(0.0, jitter_s=0.001, loss=0.1, seed=42)
    b = DelayLineModel(0.0, jitter_s=0.001, loss=0.1, seed=42)
    assert [a.admit(i, 1) for i in range(1000)] == [b.admit(i, 1) for i in range(1000)]


def test_update_applies_to_later_packets_only() -> None:
    m = DelayLineModel(0.010)
    assert m.admit(0.0, 1) == pytest.approx(0.010)
    m.update(delay_s=0.030)
    assert m.admit(1.0, 1) == pytest.approx(1.030)
    # A cut in delay cannot overtake what is queued: FIFO holds the next packet back.
    m.update(delay_s=0.001)
    assert m.admit(1.005, 1) == pytest.approx(1.030)
    assert m.admit(2.0, 1) == pytest.approx(2.001)
    m.update(loss=1.0)
    assert m.admit(3.0, 1) is None
    m.update(loss=0.0)
    assert m.admit(4.0, 1) == pytest.approx(4.001)
    assert (m.delay_s, m.jitter_s, m.loss, m.loss_correlation) == (0.001, 0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    "kw",
    [
        {"delay_s": -0.001},
        {"jitter_s": -1.0},
        {"loss": 1.5},
        {"loss_correlation": 1.0},
        {"delay_s": math.inf},
        {"loss": math.nan},
    ],
)
def test_invalid_parameters_are_rejected_without_partial_update(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        DelayLineModel(**{"delay_s": 0.01, **kw})
    m = DelayLineModel(0.01, loss=0.1)
    with pytest.raises(ValueError):
        m.update(**kw, jitter_s=0.5) if "jitter_s" not in kw else m.update(**kw, loss=0.5)
    assert (m.delay_s, m.jitter_s, m.loss, m.loss_correlation) == (0.01, 0.0, 0.1, 0.0)


# -- the delay line's config and packet helpers (no I/O) -------------------------------------


def test_config_round_trip_and_link_params() -> None:
    from testbed.core.schema.linkprofile import LinkParams
    from testbed.net.delayline import DirectionSpec, parse_config

    link = LinkParams(
        rate_bps=1e9, delay_s=0.015, jitter_s=0.001, loss=0.01, loss_correlation=0.25, queue_bytes=1 << 22, mtu=65000
    )
    spec = DirectionSpec.from_link("dc0->dc1", "10.231.1.0/24", link, seed=3)
    assert spec == DirectionSpec("dc0->dc1", "10.231.1.0/24", 0.015, 0.001, 0.01, 0.25, 3)
    assert parse_config({"directions": [spec.to_json()]}) == [spec]
    minimal = parse_config({"directions": [{"name": "x", "dst_subnet": "10.0.0.0/8"}]})
    assert minimal[0].delay_s == 0.0 and minimal[0].seed == 0


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({}, "directions"),
        ({"directions": [{"name": "x"}]}, r"directions\[0\]\.dst_subnet"),
        ({"directions": [{"name": "x", "dst_subnet": "10.0.0.0/33"}]}, "'x'"),
        ({"directions": [{"name": "x", "dst_subnet": "10.0.0.0/8", "delay": 0.01}]}, "unknown field"),
        ({"directions": [{"name": "x", "dst_subnet": "10.0.0.0/8", "loss": "1%"}]}, "loss"),
        ({"directions": [{"name": "x", "dst_subnet": "10.0.0.0/8", "loss": 2}]}, "loss"),
        (
            {"directions": [{"name": "x", "dst_subnet": "10.0.0.0/8"}, {"name": "x", "dst_subnet": "10.1.0.0/16"}]},
            "unique",
        ),
        ({"directions": [{"name": "unmatched", "dst_subnet": "10.0.0.0/8"}]}, "unique"),
    ],
)
def test_config_errors_name_the_field(cfg: object, match: str) -> None:
    from testbed.net.delayline import ConfigError, parse_config

    with pytest.raises(ConfigError, match=match):
        parse_config(cfg)


def test_ipv4_address_helpers() -> None:
    from testbed.net.tun import ipv4_dst, ipv4_src

    hdr = bytes([0x45, 0, 0, 20]) + bytes(8) + bytes([10, 231, 0, 2]) + bytes([10, 231, 1, 2])
    assert ipv4_src(hdr) == b"\x0a\xe7\x00\x02" and ipv4_dst(hdr) == b"\x0a\xe7\x01\x02"
    assert ipv4_dst(hdr + b"payload") == b"\x0a\xe7\x01\x02"
    ipv6 = bytes([0x60]) + bytes(39)
    assert ipv4_dst(ipv6) == b"" and ipv4_src(ipv6) == b""
    assert ipv4_dst(hdr[:19]) == b"" and ipv4_dst(b"") == b""
