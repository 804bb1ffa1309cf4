"""`trace validate` / `trace info` memory on big Mooncake files, measured as the peak RSS of the
command run as a subprocess; and the distinct-hash counting that keeps it small."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from testbed.traces.distinct import DistinctCounter
from testbed.traces.synthetic import synth_with_prefixes
from testbed.traces.trace_command import ESTIMATE_NOTE, _Summary, prefix_reuse_share
from testbed.traces.types import TraceRequest

ROOT = Path(__file__).resolve().parent.parent


def write_mooncake_file(path: Path, n: int, seed: int = 0) -> int:
    """A Mooncake JSONL file of `n` requests shaped like the published traces: 1-63 blocks a
    request (mean 32), half of the requests repeating the prefix of one of the 50 before, ids
    dense from 0. Returns the total number of blocks."""
    rng = np.random.default_rng(seed)
    ts = np.cumsum(rng.integers(0, 7, size=n))
    blocks = rng.integers(1, 64, size=n)
    reuse = rng.random(n) < 0.5
    back = rng.integers(1, 50, size=n)
    out = rng.integers(1, 1000, size=n)
    starts = np.zeros(n, dtype=np.int64)
    nxt = total = 0
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            k = int(blocks[i])
            if reuse[i] and i >= back[i]:
                s = int(starts[i - back[i]])
            else:
                s, nxt = nxt, nxt + k
            starts[i] = s
            total += k
            f.write(
                f'{{"timestamp": {ts[i]}, "input_length": {k * 512 - 100}, "output_length": {out[i]}, '
                f'"hash_ids": [{", ".join(map(str, range(s, s + k)))}]}}\n'
            )
    return total


def peak_rss_mb(argv: list[str], tmp_path: Path) -> tuple[float, str]:
    """(peak RSS in MB, stdout) of `python -m testbed ARGV`, from that child's own rusage
    (wait4), so no other subprocess of the test run counts."""
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    pid = os.posix_spawn(
        sys.executable,
        [sys.executable, "-m", "testbed", *argv],
        dict(os.environ, PYTHONPATH=str(ROOT)),
        file_actions=[
            (os.POSIX_SPAWN_OPEN, 1, str(out), flags, 0o644),
            (os.POSIX_SPAWN_OPEN, 2, str(err), flags, 0o644),
        ],
    )
    _, status, usage = os.wait4(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, err.read_text()
    return usage.ru_maxrss / 1024, out.read_text()  # ru_maxrss is in KB on Linux


def _reference_share(batches: list[list[int]]) -> tuple[float, int]:
    seen: set[int] = set()
    reused = blocks = 0
    for ids in batches:
        for h in ids:
            reused += h in seen
            seen.add(h)
        blocks += len(ids)
    return (reused / blocks if blocks else 0.0), blocks


@pytest.mark.pure
def test_reuse_share_is_exact_for_dense_and_sparse_ids() -> None:
    t = synth_with_prefixes(400, 2.0, seed=3)
    assert prefix_reuse_share(t) == _reference_share([list(r.hash_ids) for r in t])
    rng = np.random.default_rng(1)
    sparse = [list(map(int, rng.integers(0, 1 << 62, size=5))) for _ in range(300)]
    sparse += sparse[:100]  # whole requests again, and a repeat inside one request
    sparse.append([7, 7, 1 << 62])
    reqs = [TraceRequest(f"r{i}", float(i), 1, 1, tuple(ids)) for i, ids in enumerate(sparse)]
    acc = _Summary()
    acc.add(reqs)
    assert acc.reuse() == _reference_share(sparse)
    assert ESTIMATE_NOTE not in acc.result("x", 512, [])["notes"]


@pytest.mark.pure
def test_distinct_counter_tiers() -> None:
    rng = np.random.default_rng(2)
    dense = rng.integers(0, 5000, size=20_000)
    c = DistinctCounter(dense_ids=1 << 16, exact_ids=8000, hll_bits=12)
    for chunk in np.array_split(dense, 7):
        c.add(chunk)
    assert c.exact and c.count == np.unique(dense).size
    # An id past the dense range: the ~4,900 seen so far are held sorted, still exact.
    c.add(np.array([1 << 40, 3, 1 << 40], dtype=np.int64))
    assert c.exact and c.count == np.unique(dense).size + 1
    # Past exact_ids: a sketch, within a few standard errors (1.04 / sqrt(4096) = 1.6%).
    more = rng.integers(1 << 41, 1 << 62, size=50_000)
    for chunk in np.array_split(np.concatenate([more, more[:10_000]]), 5):
        c.add(chunk)
    want = np.unique(dense).size + 1 + np.unique(more).size
    assert not c.exact and abs(c.count - want) / want < 0.06
    # Straight from dense to the sketch when the dense ids alone are too many to hold sorted.
    d = DistinctCounter(dense_ids=1 << 20, exact_ids=1000, hll_bits=12)
    d.add(np.arange(300_000, dtype=np.int64))
    d.add(np.array([1 << 30], dtype=np.int64))
    assert not d.exact and abs(d.count - 300_001) / 300_001 < 0.06
    # Small counts stay right in the sketch (linear counting), and negative ids are not dense.
    e = DistinctCounter(dense_ids=16, exact_ids=1, hll_bits=12)
    e.add(np.array([-5, -5, 100, 200], dtype=np.int64))
    assert not e.exact and e.count == 3


def _rss_pair(path: Path, tmp_path: Path) -> tuple[float, float, str, str]:
    v_rss, v_out = peak_rss_mb(["trace", "validate", str(path)], tmp_path)
    i_rss, i_out = peak_rss_mb(["trace", "info", str(path), "--json"], tmp_path)
    return v_rss, i_rss, v_out, i_out


@pytest.mark.app
def test_validate_and_info_memory_grows_little_with_the_file(tmp_path: Path) -> None:
    # The old summary held a set of every hash: ~80 bytes a distinct hash, 130 MB over the
    # baseline for these 100K requests (1.6M distinct of 3.2M blocks); now ~8 bytes a request.
    tiny, big = tmp_path / "tiny.jsonl", tmp_path / "big.jsonl"
    write_mooncake_file(tiny, 10)
    blocks = write_mooncake_file(big, 100_000)
    base_v, base_i, _, _ = _rss_pair(tiny, tmp_path)
    v, i, v_out, i_out = _rss_pair(big, tmp_path)
    assert "ok, 100,000 requests" in v_out
    info = json.loads(i_out)
    assert info["blocks"] == blocks and 0.3 < info["prefix_reuse_share"] < 0.7
    print(
        f"peak RSS, 100K-line Mooncake file: validate {v:.0f} MB, info {i:.0f} MB "
        f"(10 lines: {base_v:.0f} MB, {base_i:.0f} MB)"
    )
    assert v - base_v < 40 and i - base_i < 40


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_validate_and_info_on_a_million_lines_stay_under_500_mb(tmp_path: Path) -> None:
    path = tmp_path / "million.jsonl"
    blocks = write_mooncake_file(path, 1_000_000)
    v, i, v_out, i_out = _rss_pair(path, tmp_path)
    print(
        f"peak RSS, 1M-line Mooncake file ({blocks:,} blocks, {path.stat().st_size / 1e6:.0f} MB): "
        f"validate {v:.0f} MB, info {i:.0f} MB"
    )
    assert "ok, 1,000,000 requests" in v_out
    info = json.loads(i_out)
    assert info["requests"] == 1_000_000 and info["blocks"] == blocks
    assert ESTIMATE_NOTE not in info["notes"]  # dense ids: counted exactly
    assert v < 500 and i < 500
