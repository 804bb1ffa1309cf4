"""`testbed crosscheck --peer dynamo`: the testbed's simulator and Dynamo's mocker on one workload.

Both replay the same trace on the scenario's one PD cluster with the same worker counts and the
same timing tables: the testbed into `DIR/sim/` (a normal run directory), the mocker into
`DIR/dynamo/` (its report turned into the same form, beside its own files); then
`peer-crosscheck.md` and `.json` set them side by side (`peer_compare`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from testbed.config.resolved import ResolvedScenario
from testbed.metrics.summary import load_records
from testbed.studies.crosscheck import peer_dynamo
from testbed.studies.crosscheck.crosscheck_explain import Side
from testbed.studies.crosscheck.peer_compare import COLUMNS, PeerCheck, _cells, compare, markdown
from testbed.traces.types import Trace

PEERS: tuple[str, ...] = ("dynamo",)


def check_peer(peer: str, rs: ResolvedScenario) -> None:
    """Before anything runs: the peer is installed and can model the scenario (PeerError)."""
    why = peer_dynamo.missing()
    if why is not None:
        raise peer_dynamo.PeerError(f"crosscheck --peer {peer}: {why}")
    peer_dynamo.peer_cluster(rs)


def run_peer_check(
    rs: ResolvedScenario, trace: Trace, out: Path, scheduler: str, router: str = "kv", deployment: str = "scenario"
) -> PeerCheck:
    from testbed.run.runner import run_sim

    name = "Dynamo's mocker"
    rs, deployed = peer_dynamo.deploy_like_peer(rs, scheduler, router, deployment)
    own_caches = any(c.cache_scope == "instance" for c in rs.spec.clusters)
    own = own_caches or rs.spec.policy.placement != "least_loaded"
    print(f"simulating {len(trace)} requests of {trace.source} on {rs.name} -> {out / 'sim'}", file=sys.stderr)
    t = time.perf_counter()
    res = run_sim(rs, trace, out / "sim", report=False)
    tb_s = time.perf_counter() - t
    peer_dir = out / "dynamo"
    s = peer_dynamo.setup(rs, trace, peer_dir, scheduler, router)
    path = peer_dynamo.write_trace(peer_dir / "trace.jsonl", trace)
    print(
        f"replaying the same in {name} {peer_dynamo.version()} (scheduler {scheduler}, router {router}) -> {peer_dir}",
        file=sys.stderr,
    )
    pr = peer_dynamo.run(s, path)
    peer_dynamo.write_run(peer_dir, rs, trace, s, pr)
    from testbed.metrics.summary import read_summary

    tb = Side("testbed", str(out / "sim"), res.summary, load_records(out / "sim"))
    peer = Side("dynamo", str(peer_dir), read_summary(peer_dir), load_records(peer_dir))
    hw = rs.spec.hardware[s.cluster.hardware]
    notes = [
        f"trace: {len(trace)} requests of {trace.source} ({peer_dir / 'trace.jsonl'} as the mocker read it), "
        f"{s.cluster.prefill} prefill and {s.cluster.decode} decode instances of {s.cluster.hardware}",
        *s.notes,
        deployed,
        (
            f"routing: the testbed's {rs.spec.policy.name} policy with {rs.spec.policy.placement} placement over "
            "the instances' own caches; the mocker's KV router (kv_router"
            if own
            else f"routing: the testbed's {rs.spec.policy.name} policy sends a prompt to the prefill instance with "
            "the least modelled work queued (with one cluster pool its new tokens are the same on every instance); "
            "the mocker's KV router (kv_router"
        )
        + (", its defaults)" if router == "kv" else ", no credit for cached overlap)")
        + " to the worker with the fewest prompt blocks not cached there plus prefill blocks active there, so "
        "a prompt may wait behind a busy worker that holds its prefix while another is idle",
    ]
    linear = "linear" in rs.spec.model.layer_kinds()
    c = compare(rs.name, name, tb, peer, hw, notes, own_caches, rs.spec.policy.placement, linear)
    c.speed = {"testbed simulation + run directory": tb_s, "mocker replay call": pr.wall_s}
    write(c, out)
    return c


def write(c: PeerCheck, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "peer-crosscheck.md"
    path.write_text("\n".join(markdown(c)).rstrip() + "\n")
    (out / "peer-crosscheck.json").write_text(json.dumps(c.to_dict(), indent=1, default=str) + "\n")
    return path


def print_table(c: PeerCheck) -> None:
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 120))
    table = Table(title=Text(f"{c.scenario}: the testbed's simulator and {c.peer} (paper units)"))
    for i, col in enumerate(COLUMNS):
        table.add_column(col, justify="left" if i in (0, len(COLUMNS) - 1) else "right", no_wrap=i == 0)
    for cells in _cells(c):
        table.add_row(*(Text(x) for x in cells[:-1]), Text(cells[-1], style="green" if "within" in cells[-1] else ""))
    console.print(table)
    for r in c.rows:
        if r.explanation:
            console.print(Text(f"{r.label} ({r.cells['diff']}): {r.explanation}"))
