"""The compiled decode batch (`testbed_native.DecodeBatch`) against the Python one it twins
(`testbed.core.engine.decode_batch.DecodeBatch`): the same admissions, finishes, errors and float bits
after every step of generated sequences, and a decode loop driven on either the same way.

Skipped where the extension is not built, unless TESTBED_REQUIRE_NATIVE=1 (as CI sets)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_ext import required

from testbed.core.engine.decode_batch import AdmissionError, DecodeBatch, DecodeSeq, StepResult, new_batch
from testbed.core.engine.decode_loop import DecodeLoop
from testbed.core.engine.servicetime import DecodeStepTime

ext = required()

STEP = DecodeStepTime(0.0123, 0.00041, 3.7e-8)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(1, 40_000), st.integers(1, 300), st.integers(1, 9)),
        st.tuples(st.just("admit"), st.floats(0, 1e4, allow_nan=False)),
        st.tuples(st.sampled_from(["complete_step", "steps_to_finish", "step_duration"])),
        st.tuples(st.just("duration_of"), st.integers(-1, 500)),
        st.tuples(st.just("steps_until"), st.floats(-1.0, 50.0, allow_nan=False)),
        st.tuples(st.sampled_from(["advance", "advance_finished"]), st.integers(0, 300)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ),
    max_size=80,
)


def _view(x: Any) -> Any:
    """A return value as plain data (sequences by request id and count; floats by their bits)."""
    if isinstance(x, DecodeSeq):
        return ("seq", x.request_id, x.generated, x.admitted_at)
    if isinstance(x, StepResult):
        return ("step", _view(x.seq), x.finished)
    if isinstance(x, list | tuple):
        return [_view(v) for v in x]
    if isinstance(x, float):
        return x.hex()
    return x


def _state(b: Any) -> tuple[Any, ...]:
    return (
        _view(list(b.running)),
        _view(list(b.waiting)),
        b.kv_used,
        b.context,
        b.n_running,
        b.n_waiting,
        b.head_id,
        b.idle,
    )


def _call(b: Any, op: tuple[Any, ...], n: int) -> Any:
    name = op[0]
    try:
        if name == "submit":
            _, ctx, out, kv = op
            return b.submit(DecodeSeq(f"r{n}", ctx, out, kv * 1000))
        if name == "abort":
            return b.abort(f"r{op[1]}")
        return getattr(b, name)(*op[1:])
    except (AdmissionError, ValueError) as e:
        return (type(e).__name__, str(e))


@pytest.mark.pure
@settings(max_examples=400, deadline=None)
@given(
    ops=OPS,
    bs_max=st.integers(1, 6),
    kv_capacity=st.sampled_from([4000, 12000, 10**9]),
    scale=st.sampled_from([1.0, 4.0]),
    step=st.sampled_from([STEP, DecodeStepTime(0.02, 0.0, 0.0)]),
)
def test_every_step_leaves_both_batches_alike(
    ops: list[tuple[Any, ...]], bs_max: int, kv_capacity: int, scale: float, step: DecodeStepTime
) -> None:
    """Submits (some never fitting), admissions, steps one by one and many at once (some asking
    past a finish), aborts of running, waiting and unknown sequences: the compiled batch returns
    and holds what the Python one does, float bits and error texts included."""
    py, nat = DecodeBatch(step, bs_max, kv_capacity, scale), ext.DecodeBatch(step, bs_max, kv_capacity, scale)
    for n, op in enumerate(ops):
        assert _view(_call(nat, op, n)) == _view(_call(py, op, n)), op
        assert _state(nat) == _state(py), op


@pytest.mark.pure
@given(
    steps=st.integers(1, 5000),
    context=st.integers(0, 10**6),
    n=st.integers(1, 64),
    elapsed=st.floats(1e-6, 1e4, allow_nan=False),
)
def test_boundaries_solve_alike(steps: int, context: int, n: int, elapsed: float) -> None:
    """The arithmetic series of step times and its inverse (the boundary at or after a time)."""
    py, nat = DecodeBatch(STEP, 64, 10**12), ext.DecodeBatch(STEP, 64, 10**12)
    for i in range(n):
        for b in (py, nat):
            b.submit(DecodeSeq(f"r{i}", context // n, 10**6, 1))
            b.admit(0.0)
    assert nat.duration_of(steps).hex() == py.duration_of(steps).hex()
    assert nat.steps_until(elapsed) == py.steps_until(elapsed)
    assert math.isfinite(nat.step_duration())


@pytest.mark.pure
def test_a_decode_loop_runs_alike_on_either_batch() -> None:
    """The loop the simulator drives: begin, run many steps, finishes, at the same times."""
    got = []
    for batch in (DecodeBatch(STEP, 3, 10**9), ext.DecodeBatch(STEP, 3, 10**9)):
        loop = DecodeLoop(batch)
        for i, out in enumerate((5, 9, 2, 30, 7)):
            loop.submit(DecodeSeq(f"r{i}", 1000 * (i + 1), out, 10))
        log: list[Any] = []
        now = 0.0
        while not loop.idle:
            admitted, end = loop.begin(now)
            log.append(("begin", [s.request_id for s in admitted], end))
            m = batch.steps_to_finish()
            done = loop.run_finished(m)
            now = loop.step_start or now
            log.append(("done", [(s.request_id, s.generated) for s in done], now, loop.steps))
        got.append(log)
    assert got[0] == got[1]
    assert got[0][-1][1] == [("r3", 30)]


@pytest.mark.pure
def test_new_batch_is_the_compiled_one_where_built() -> None:
    assert type(new_batch(STEP, 4, 100)).__module__ == "testbed_native"
