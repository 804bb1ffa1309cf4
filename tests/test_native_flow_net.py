"""The compiled flow network (`testbed_native.FlowNet`, built by `new_network`) against the
Python one it twins (`testbed.sim.network.Network`): generated transfers -- streams that start,
change and stop, bursts, last layers, byte positions waited for, withdrawals -- over NICs and a
WAN link scarce enough to be shared, on either event loop; the same callbacks at the same times,
the same counters and backlogs, the same number of rebalances.

Skipped where the extension is not built, unless TESTBED_REQUIRE_NATIVE=1 (as CI sets)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from itertools import permutations
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_ext import required

from testbed.config.scenarios import load_scenario
from testbed.core.schema.linkprofile import LinkProfile
from testbed.sim.events import ARRIVAL, SAMPLE, EventLoop, new_loop
from testbed.sim.net_view import new_network
from testbed.sim.network import Network

required()

NODES = {"a0": "east", "a1": "east", "b0": "west", "b1": "west"}
TRANSFER = load_scenario("paper-prfaas").transfer
# Slow links (paper bytes per second in the millions) so that a few transfers contend.
INTRA = LinkProfile(name="intra", rate=80e6, delay=0.001)
INTER = LinkProfile(name="inter", rate=20e6, delay=0.015, loss=0.001)

OPS = st.lists(
    st.tuples(
        st.floats(0.0, 3.0, allow_nan=False),  # when
        st.sampled_from(["stream", "stop", "push", "end", "mark", "withdraw"]),
        st.sampled_from(list(NODES)),
        st.sampled_from(list(NODES)),
        st.floats(0.0, 4e6, allow_nan=False),  # a rate, a size, an offset
    ),
    max_size=45,
)


def _run(net: Any, loop: Any, ops: list[tuple[float, str, str, str, float]]) -> list[Any]:
    log: list[Any] = []

    def fired(tag: Any, t: float) -> None:
        log.append(("mark", tag, t.hex()))

    def do(arg: tuple[int, tuple[float, str, str, str, float]]) -> None:
        i, (_, op, src, dst, x) = arg
        if src == dst:
            return
        t = loop.now
        p = net.path(src, dst)
        if op == "stream":
            net.stream(p, t, x)
        elif op == "stop":
            net.stream(p, t, 0.0)
        elif op == "push":
            net.push(p, t, x)
        elif op == "end":
            net.end_stream(p, t, x / 4)
        elif op == "mark":
            net.mark(p, net.position(p) + x / 2 - 1e6, fired, i)
        else:
            pos = net.position(p)
            net.withdraw(p, pos - x, pos)
        log.append((i, net.position(p).hex(), p.delay.hex()))

    def sample(_: Any) -> None:
        t = loop.now
        log.append(
            (
                "sample",
                t.hex(),
                [(net.sent_at(n, t).hex(), net.received_at(n, t).hex(), net.backlog(n, t).hex()) for n in NODES],
                [lk.counter.at(t).hex() for lk in net.wan.values()],
            )
        )

    def stop_all(_: Any) -> None:
        # A stream nobody stops never ends: over a shared NIC its queue swings across a chunk
        # boundary forever (k 1 -> 2 -> 1), and the loop would never run dry. Every run's streams end.
        for src, dst in permutations(NODES, 2):
            p = net.path(src, dst)
            net.end_stream(p, loop.now, 0.0)
            log.append(("stop", src, dst, net.position(p).hex()))

    for i, op in enumerate(ops):
        loop.at(op[0], ARRIVAL, do, (i, op))
    loop.at(3.5, ARRIVAL, stop_all)
    for k in range(8):
        loop.at(0.5 * k, SAMPLE, sample)
    loop.run()
    log.append(("end", loop.now.hex(), net.rebalances))
    return log


def _pair(loop_kind: str) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    def loop() -> Any:
        return EventLoop() if loop_kind == "python" else new_loop()

    ploop, nloop = loop(), loop()
    py = Network(ploop, dict(NODES), INTRA, INTER, TRANSFER, 1.0)
    nat = new_network(nloop, dict(NODES), INTRA, INTER, TRANSFER, 1.0, 1.0, faults=False)
    assert not isinstance(nat, Network)
    return (py, ploop), (nat, nloop)


@pytest.mark.pure
@settings(max_examples=250, deadline=None)
@given(ops=OPS, loop_kind=st.sampled_from(["native", "python"]))
def test_both_networks_carry_the_same_bytes_at_the_same_times(ops: list[Any], loop_kind: str) -> None:
    (py, ploop), (nat, nloop) = _pair(loop_kind)
    assert _run(nat, nloop, ops) == _run(py, ploop, ops)


@pytest.mark.pure
def test_the_python_network_serves_runs_whose_links_change() -> None:
    loop = new_loop()
    assert isinstance(new_network(loop, dict(NODES), INTRA, INTER, TRANSFER, 1.0, 1.0, faults=True), Network)
    dark = LinkProfile(name="dark", rate=20e6, delay=0.015, loss=1.0)
    assert isinstance(new_network(loop, dict(NODES), INTRA, dark, TRANSFER, 1.0, 1.0, faults=False), Network)


@pytest.mark.pure
def test_a_forgotten_path_lives_on_for_its_holders() -> None:
    """A path forgotten when idle and made again is a new path; a handle to the old one still
    reaches the old one (as a Python `Path` object does), and its slot serves a new path only
    once nobody holds that handle."""
    got = []
    for loop, net in ((EventLoop(), None), (new_loop(), None)):
        net = (
            Network(loop, dict(NODES), INTRA, INTER, TRANSFER, 1.0)
            if isinstance(loop, EventLoop)
            else new_network(loop, dict(NODES), INTRA, INTER, TRANSFER, 1.0, 1.0, faults=False)
        )
        old = net.path("a0", "b0")
        net.end_stream(old, 0.0, 0.5)  # nothing queued: idle, and forgotten
        new = net.path("a0", "b0")
        net.push(new, 0.0, 3e6)
        got.append((new is not old, net.position(old), net.position(new)))
    assert got[0] == got[1] == (True, 0.5, 3e6)


# Two streams nobody stops out of one NIC (b0's): the flow network's own events (compiled, no
# bytecode run between them) go on forever. A signal must still reach the loop: Ctrl-C, SIGTERM, a
# test's timeout.
ENDLESS = (("b0", "a1", 2043789.0), ("b0", "a0", 697118.5))
_INTERRUPTED = textwrap.dedent(f"""
    import signal, sys
    sys.path.insert(0, {str(Path(__file__).parent)!r})
    from test_native_flow_net import ARRIVAL, ENDLESS, _pair
    _, (net, loop) = _pair("native")
    assert type(loop).__module__ == "testbed_native"
    loop.at(0.0, ARRIVAL, lambda _: [net.stream(net.path(a, b), 0.0, r) for a, b, r in ENDLESS])
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    signal.signal(signal.SIGALRM, lambda *_: sys.exit(f"interrupted after {{loop.now:.0f}} s of virtual time"))
    loop.run()
""")


@pytest.mark.app
def test_a_stretch_of_compiled_events_still_hears_a_signal() -> None:
    try:
        out = subprocess.run([sys.executable, "-c", _INTERRUPTED], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the compiled loop ran on for 120 s past a signal sent after 0.5 s")
    assert out.returncode == 1 and out.stderr.startswith("interrupted after"), out.stderr
