"""The RTT figure keeps the hosts' scheduling out: kernel receive stamps at both ends, the
delay line's own lateness counted, and a figure the host was too busy to time marked invalid."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from testbed.net.delayline import LATE_S, DelayLine, DirectionSpec, Lateness
from testbed.net.probes import measure_rtt, udp_echo_server
from testbed.studies.linkcheck.linkcheck import judge_rtt, rtt_tolerance
from testbed.studies.linkcheck.linkcheck_report import verdicts


def _rtt(valid: bool = True, median: float = 0.0305) -> dict[str, Any]:
    return {"median_s": median, "base_median_s": 0.0005, "valid": valid, "reasons": []}


def _result(rtt: dict[str, Any]) -> dict[str, Any]:
    return {
        "configured": {"rtt_s_wire": 0.03, "rate_bps_wire": 50e6, "loss": 0.0},
        "rtt": rtt,
        "goodput": [{"bps": 48e6}],
        "loss": {"valid": True, "link": 0.0},
    }


@pytest.mark.pure
def test_the_bar_is_one_millisecond_or_three_percent() -> None:
    assert rtt_tolerance(0.0075) == 0.001
    assert rtt_tolerance(0.1) == pytest.approx(0.003)


@pytest.mark.pure
def test_a_delay_line_late_by_half_the_bar_per_round_trip_makes_the_figure_invalid() -> None:
    tol = rtt_tolerance(0.03)
    ok = _rtt()
    judge_rtt(ok, Lateness(late_s=0.2 * tol / 2, packets=400, late_packets=0), tol)  # 1% of the bar a trip
    assert ok["valid"] and ok["reasons"] == [] and ok["line_late_per_trip_s"] == pytest.approx(0.2 * tol / 400)
    busy = _rtt()
    judge_rtt(busy, Lateness(late_s=100 * tol, packets=400, late_packets=390), tol)  # half the bar a trip
    assert not busy["valid"]
    assert busy["reasons"] == [
        "the delay line wrote the probes 0.50 ms late per round trip (390 of 400 packets "
        "over 1 ms late): the host was too busy to time the link"
    ]
    waiting = _rtt()  # written on time, but read late: the line waited for a CPU
    judge_rtt(waiting, Lateness(late_s=0.0, packets=400, late_packets=0, cpu_wait_s=100 * tol), tol)
    assert not waiting["valid"] and waiting["line_cpu_wait_per_trip_s"] == pytest.approx(tol / 2)
    assert waiting["reasons"] == [
        "the delay line waited 0.50 ms per round trip for a CPU: the host was too busy to time the link"
    ]
    quiet = _rtt()
    judge_rtt(quiet, Lateness(0.0, 0, 0), tol)  # netem: no delay line, nothing to judge
    assert quiet["valid"] and "line_late_per_trip_s" not in quiet


@pytest.mark.pure
def test_an_invalid_rtt_figure_is_neither_pass_nor_fail() -> None:
    assert verdicts(_result(_rtt(valid=False, median=0.09)))["rtt"] is None
    assert verdicts(_result(_rtt(median=0.0305)))["rtt"] is True
    assert verdicts(_result(_rtt(median=0.0335)))["rtt"] is False  # a valid figure off the bar fails


@pytest.fixture
def held_echo() -> Iterator[tuple[int, asyncio.AbstractEventLoop]]:
    """A UDP echo on loopback in a thread of its own, whose loop the test can hold."""
    loop = asyncio.new_event_loop()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    task = asyncio.run_coroutine_threadsafe(udp_echo_server("127.0.0.1", port), loop)
    time.sleep(0.1)
    try:
        yield port, loop
    finally:
        task.cancel()
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
        loop.close()


@pytest.mark.app
def test_an_echo_host_that_reads_late_does_not_lengthen_the_round_trip(
    held_echo: tuple[int, asyncio.AbstractEventLoop],
) -> None:
    port, echo_loop = held_echo
    free = asyncio.run(measure_rtt("127.0.0.1", port, count=3, gap=0.001))
    assert free.received == 3 and free.host_median_s >= 0.0
    hold = 0.3
    echo_loop.call_soon_threadsafe(time.sleep, hold)  # the echo host stops reading for 0.3 s
    held = asyncio.run(measure_rtt("127.0.0.1", port, count=1))
    assert held.received == 1
    # The reply waited in the echo's socket for most of the hold: the host's time, not the path's.
    assert held.host_median_s >= hold / 2
    assert held.median_s < hold / 10


def _ipv4(dst: str, payload: bytes = b"x" * 20) -> bytes:
    return (
        struct.pack(
            "!BBHHHBBH4s4s",
            0x45,
            0,
            20 + len(payload),
            0,
            0,
            64,
            17,
            0,
            socket.inet_aton("10.0.0.1"),
            socket.inet_aton(dst),
        )
        + payload
    )


@pytest.mark.pure
def test_the_delay_line_counts_what_it_wrote_late() -> None:
    """Packets written after their due time add their lateness; those over LATE_S are counted."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    ours.setblocking(False)  # as a TUN device is opened: the line reads until EAGAIN
    spec = DirectionSpec("dc0->dc1", "10.1.0.0/24", delay_s=0.01, jitter_s=0.0, loss=0.0, loss_correlation=0.0)
    line = DelayLine(os.dup(ours.fileno()), [spec])
    try:
        theirs.send(_ipv4("10.1.0.5"))
        theirs.send(_ipv4("10.1.0.6"))
        line._drain(100.0)  # both due at 100.01
        line._release(100.0105)  # half a millisecond late: not over LATE_S
        theirs.send(_ipv4("10.1.0.7"))
        line._drain(200.0)
        line._release(200.01 + 3 * LATE_S)  # three times LATE_S late
        c = line.stats()["directions"]["dc0->dc1"]
        assert c["packets_out"] == 3
        assert c["late_s"] == pytest.approx(2 * 0.0005 + 3 * LATE_S)
        assert c["late_packets"] == 1
    finally:
        line.close()
        ours.close()
        theirs.close()
