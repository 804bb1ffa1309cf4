"""NVIDIA Dynamo's mocker as a peer simulator: the same trace, worker counts and timing tables.

The mocker (`ai-dynamo-runtime`, the optional `peer` extra) replays a Mooncake trace offline
through a router, prefill workers and decode workers, each a vLLM-like scheduler stepping
forward pass by forward pass over per-worker KV block caches. Here it gets:

- the trace the testbed replays, written as Mooncake JSONL (a request without prefix hashes
  gets block ids of its own: no reuse, as in the testbed);
- the scenario's one PD cluster: its prefill and decode counts, its hardware profile as the
  mocker's timing tables (`peer_timing`), its decode BS_max and KV memory as the decode
  workers' sequence limit and block count, its prefix cache pool split over the prefill workers;
- a scheduler: `matched` (default) makes each prefill worker what a testbed prefill instance
  is -- one prompt at a time, whole, FCFS; `native` keeps the mocker's own vLLM defaults
  (chunked prefill at 8,192 tokens a pass, up to 256 sequences a batch, its block pool sizes),
  the same timing tables.

Its per-request report becomes a run directory of the testbed's own form (`records.csv`,
`run.json`, `summary.json`; paper seconds, speedup 1), so both sides are summarised and
compared by the same code. Stage stamps: arrival; routed when the router released the
request to a prefill worker; prefill start and end when the worker admitted it and when its
KV was held for the decode side, which is also when the decode side has it (no bandwidth is
set, so the mocker transfers instantly; its destination is reserved and activated at the decode
worker's next step, which the records count as decode admission wait); decode admission; first
and last token.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict, cast

from testbed.config.resolved import ResolvedScenario
from testbed.core.errors import UserError
from testbed.core.record import NAN, RequestRecord, StageTimes
from testbed.core.schema.scenario import ClusterSpec
from testbed.studies.crosscheck.peer_timing import MockerTiming, mocker_timing
from testbed.traces.types import Trace

if TYPE_CHECKING:  # the optional `peer` extra; without it, untyped
    from dynamo._core import KvRouterConfig

PACKAGE = "ai-dynamo-runtime"
PIN = "1.6.1"  # the release whose API and report fields this module reads
INSTALL = f"pip install 'prfaas-testbed[peer]' (or {PACKAGE}=={PIN})"
Scheduler = Literal["matched", "native"]
SCHEDULERS: tuple[str, ...] = ("matched", "native")
ROUTERS: tuple[str, ...] = ("kv", "load")
NATIVE_CHUNK = 8192  # the mocker's default max_num_batched_tokens (vLLM's)


class PeerError(UserError, ValueError):
    """The peer cannot run this comparison: the message says why in one line."""


def missing() -> str | None:
    """Why Dynamo's mocker cannot be imported here (None: it can)."""
    quiet_logs()
    try:
        from dynamo import _core  # type: ignore[attr-defined,unused-ignore]  # a compiled module, no stub
    except ImportError as e:
        return f"Dynamo's mocker is not installed ({e}): {INSTALL}"
    if not hasattr(_core, "run_mocker_trace_replay"):
        return f"this {PACKAGE} has no offline trace replay (run_mocker_trace_replay): {INSTALL}"
    return None


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return "unknown"


def quiet_logs() -> None:
    """The mocker logs every routing decision at INFO to stdout unless told otherwise (before import)."""
    os.environ.setdefault("DYN_LOG", "warn")


class EngineArgs(TypedDict, total=False):
    """One pool's engine arguments as the mocker reads them (its vLLM-like names)."""

    worker_type: str
    timing_model: dict[str, object]
    max_num_seqs: int
    enable_chunked_prefill: bool
    block_size: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool
    num_gpu_blocks: int


class PoolArgs(TypedDict):
    engine: EngineArgs


class MockerArgs(TypedDict, total=False):
    """`run_mocker_trace_replay`'s keyword arguments."""

    trace_files: list[str]
    prefill_engine_args: PoolArgs
    decode_engine_args: PoolArgs
    num_prefill_workers: int
    num_decode_workers: int
    replay_mode: Literal["offline"]
    router_mode: Literal["kv_router"]
    trace_block_size: int
    trace_format: Literal["mooncake"]
    capture_per_request: bool
    router_config: KvRouterConfig


class RoutingHop(TypedDict, total=False):
    pool: str
    released_at_ms: float


class MockerRequest(TypedDict, total=False):
    """One request of the mocker's per-request report (ms since the replay's start); the fields
    this module reads, each possibly missing or None."""

    arrival_time_ms: float | None
    input_length: int | None
    output_length: int | None
    terminal_status: str | None
    routing_history: list[RoutingHop] | None
    source_held_ms: float | None
    prefill_admit_ms: float | None
    decode_admit_ms: float | None
    first_token_ms: float | None
    last_token_ms: float | None
    reused_input_tokens: int | None
    decode_reused_input_tokens: int | None
    prefill_worker_idx: int | None
    decode_worker_idx: int | None


@dataclass(frozen=True)
class PeerSetup:
    """What the mocker is given, and the facts the comparison states about it."""

    cluster: ClusterSpec
    scheduler: str
    timing: MockerTiming
    timing_path: Path
    block_tokens: int
    prefill_engine: PoolArgs
    decode_engine: PoolArgs
    notes: list[str] = field(default_factory=list)
    router: str = "kv"  # kv: the KV router's defaults; load: the same with no credit for cached overlap

    def kwargs(self, trace_path: Path, capture: bool = True) -> MockerArgs:
        """`run_mocker_trace_replay`'s arguments."""
        return {
            "trace_files": [str(trace_path)],
            "prefill_engine_args": self.prefill_engine,
            "decode_engine_args": self.decode_engine,
            "num_prefill_workers": self.cluster.prefill,
            "num_decode_workers": self.cluster.decode,
            "replay_mode": "offline",
            "router_mode": "kv_router",
            "trace_block_size": self.block_tokens,
            "trace_format": "mooncake",
            "capture_per_request": capture,
        }


def peer_cluster(rs: ResolvedScenario) -> ClusterSpec:
    """The one PD cluster the mocker can stand for, or PeerError naming what it cannot model."""
    sc = rs.spec
    live = [c for c in sc.clusters if c.prefill or c.decode]
    if len(live) != 1 or live[0].kind != "pd" or not live[0].prefill or not live[0].decode:
        shape = ", ".join(f"{c.name} ({c.kind}, {c.prefill}P/{c.decode}D)" for c in live)
        raise PeerError(
            f"scenario {sc.name}: --peer dynamo compares one PD cluster with prefill and decode "
            f"instances (the mocker has one prefill pool, one decode pool and no WAN); this one has {shape}"
        )
    if sc.faults:
        raise PeerError(f"scenario {sc.name}: --peer dynamo replays no faults; the scenario has {len(sc.faults)}")
    if sc.policy.control.long_term.enabled:
        raise PeerError(
            f"scenario {sc.name}: --peer dynamo keeps the P/D split fixed; the scenario's long-term loop converts roles"
        )
    return live[0]


def setup(rs: ResolvedScenario, trace: Trace, out: Path, scheduler: str = "matched", router: str = "kv") -> PeerSetup:
    """The mocker's engine arguments for this scenario and trace; writes its timing tables to `out`."""
    if scheduler not in SCHEDULERS:
        raise PeerError(f"--peer-scheduler: {scheduler!r} is not one of {', '.join(SCHEDULERS)}")
    if router not in ROUTERS:
        raise PeerError(f"--peer-router: {router!r} is not one of {', '.join(ROUTERS)}")
    sc = rs.spec
    c = peer_cluster(rs)
    hw = sc.hardware[c.hardware]
    assert hw.decode is not None  # a pd cluster with decode instances has a decode profile (validated)
    longest_in = max((r.input_tokens for r in trace), default=1)
    longest = max((r.input_tokens + r.output_tokens for r in trace), default=2)
    timing = mocker_timing(hw, longest_in, longest)
    out.mkdir(parents=True, exist_ok=True)
    path = timing.write(out / "dynamo-timing.npz")
    block = trace.block_tokens
    model_len = _round_up(longest + 1, block)
    timing_model: dict[str, object] = {
        "type": "external",
        "provider": "dynamo_profile",
        "config": {"path": str(path.resolve())},
    }
    per_token = sc.model.full_attention_bytes_per_token
    notes = [f"timing: the {c.hardware} profile exported as the mocker's tables, {timing.describe()}"]
    prefill: EngineArgs = {"worker_type": "prefill", "timing_model": timing_model}
    decode: EngineArgs = {"worker_type": "decode", "timing_model": timing_model}
    if scheduler == "matched":
        # One prompt a pass, whole, FCFS: a testbed prefill instance.
        prefill.update(
            {
                "max_num_seqs": 1,
                "enable_chunked_prefill": False,
                "block_size": block,
                "max_num_batched_tokens": model_len,
                "max_model_len": model_len,
            }
        )
        cache_tokens = c.cache_bytes / max(per_token, 1) / c.prefill if c.cache_bytes and per_token else 0
        prefill["enable_prefix_caching"] = cache_tokens > 0
        # The blocks hold the prompt being computed and, beyond it, the cached prefixes.
        prefill["num_gpu_blocks"] = max(_blocks(cache_tokens, block), 2 * model_len // block)
        kv_tokens = hw.decode.kv_capacity_bytes / max(per_token, 1)
        decode.update(
            {
                "max_num_seqs": hw.decode.bs_max,
                "block_size": block,
                "max_model_len": model_len,
                "max_num_batched_tokens": model_len,
                "num_gpu_blocks": max(_blocks(kv_tokens, block), 2 * model_len // block),
            }
        )
        notes.append(
            f"scheduler matched: prefill workers compute one prompt at a time, whole (max_num_seqs 1, no "
            f"chunked prefill), {prefill['num_gpu_blocks']:,} blocks of {block} tokens each "
            f"(the cluster's {c.cache_bytes / 2**40:g} TiB prefix cache pool over {c.prefill} workers); "
            f"decode workers batch up to BS_max {hw.decode.bs_max} sequences in {decode['num_gpu_blocks']:,} "
            "blocks (the instance's KV memory at the model's full-attention bytes per token)"
        )
    else:
        notes.append(
            f"scheduler native: the mocker's vLLM defaults (chunked prefill of {NATIVE_CHUNK:,} tokens a "
            "forward pass, up to 256 sequences a batch, 16,384 blocks of 64 tokens a worker); a pass takes the "
            "table's time for the new tokens of all its prompts together"
        )
    if c.cache_scope == "instance":
        notes.append(
            f"prefix cache: each of the testbed's {c.prefill} prefill instances keeps its own pool "
            f"({c.instance_pool_bytes() / 2**40:g} TiB) filled by its own prefills, as each of the mocker's prefill "
            "workers keeps its own block cache"
        )
    else:
        notes.append(
            f"prefix cache: the testbed's {c.name} cluster holds one pool ({c.cache_bytes / 2**40:g} TiB) that every "
            "prefill instance reads; each of the mocker's prefill workers keeps its own block cache, so a prefix "
            "cached on another worker is computed again or waited for. The mocker's shared tiers cannot stand for "
            f"the pool in a disaggregated replay ({PACKAGE} {PIN}: g3_offload is for aggregated workers only, and a "
            "cluster_shared host tier fails the KV router's replay of its cache events)"
        )
    if router == "load":
        notes.append(
            "router load: the KV router with no credit for cached prefix blocks (overlap_score_credit 0): "
            "it places requests by load alone, as the testbed's least-loaded routing does"
        )
    return PeerSetup(c, scheduler, timing, path, block, {"engine": prefill}, {"engine": decode}, notes, router)


DEPLOYMENTS: tuple[str, ...] = ("scenario", "peer")


def router_weight() -> float:
    """The mocker's KV router overlap score weight as shipped (1.0 where its config does not say)."""
    try:
        from dynamo import _core  # type: ignore[attr-defined,unused-ignore]

        w = getattr(_core.KvRouterConfig(), "overlap_score_weight", None)
    except (ImportError, TypeError, ValueError):
        return 1.0
    return float(w) if isinstance(w, (int, float)) else 1.0


def deploy_like_peer(
    rs: ResolvedScenario, scheduler: str, router: str, deployment: str
) -> tuple[ResolvedScenario, str]:
    """The testbed side of the comparison, and a note saying how it is deployed: with `peer` the PD
    cluster's prefill instances keep a prefix
    cache each (the cluster's pool split evenly) and take prompts by Dynamo's KV router cost
    (`kv_overlap`, the mocker's weight), or by load alone with `--peer-router load`; with
    `scenario` as the scenario says."""
    if deployment not in DEPLOYMENTS:
        raise PeerError(f"--peer-deployment: {deployment!r} is not one of {', '.join(DEPLOYMENTS)}")
    c = peer_cluster(rs)
    pol = rs.spec.policy
    if deployment == "scenario":
        return rs, (
            f"testbed deployment: the scenario's ({c.name}: cache_scope {c.cache_scope}, placement {pol.placement}; "
            "--peer-deployment peer deploys it as the mocker is)"
        )
    placement = "kv_overlap" if router == "kv" else "least_loaded"
    weight = router_weight()
    sc = rs.spec
    clusters = [x.model_copy(update={"cache_scope": "instance"}) if x.name == c.name else x for x in sc.clusters]
    pol = pol.model_copy(update={"placement": placement, "kv_overlap_weight": weight})
    spec = sc.model_copy(update={"clusters": clusters, "policy": pol})
    per = clusters[[x.name for x in clusters].index(c.name)].instance_pool_bytes()
    how = f"kv_overlap (weight {weight:g}, the mocker's KV router cost)" if router == "kv" else "least_loaded"
    return rs.model_copy(update={"spec": spec}), (
        f"testbed deployment like the mocker's: each of the {c.prefill} prefill instances keeps its own prefix "
        f"cache ({per / 2**40:g} TiB, the cluster's {c.cache_bytes / 2**40:g} TiB split evenly; cache_scope "
        f"instance) and prompts are placed by {how} (--peer-deployment scenario keeps the scenario's: "
        f"cache_scope {c.cache_scope}, placement {rs.spec.policy.placement})"
    )


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _blocks(tokens: float, block: int) -> int:
    return int(min(tokens, 2**40) // block)


def write_trace(path: Path, trace: Trace) -> Path:
    """`trace` as Mooncake JSONL for the mocker, ms timestamps; a request without prefix hashes gets
    ids no other request has (its blocks are its own, as the testbed treats it)."""
    nxt = 1 + max((h for r in trace for h in r.hash_ids), default=-1)
    lines = []
    for r in trace:
        ids = list(r.hash_ids)
        if not ids:
            n = -(-r.input_tokens // trace.block_tokens)
            ids = list(range(nxt, nxt + n))
            nxt += n
        lines.append(
            json.dumps(
                {
                    "timestamp": round(r.timestamp * 1e3, 3),
                    "input_length": r.input_tokens,
                    "output_length": r.output_tokens,
                    "hash_ids": ids,
                }
            )
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class PeerRun:
    summary: dict[str, object]  # the mocker's own report, written as it is
    per_request: list[MockerRequest]
    wall_s: float  # the replay call
    sim_wall_s: float | None  # the mocker's own measure of its simulation


def run(s: PeerSetup, trace_path: Path) -> PeerRun:
    """Replay `trace_path` in the mocker (in this process)."""
    why = missing()
    if why is not None:
        raise PeerError(why)
    from dynamo import _core  # type: ignore[attr-defined,unused-ignore]

    kw = s.kwargs(trace_path)
    if s.router == "load":
        kw["router_config"] = _core.KvRouterConfig(overlap_score_credit=0.0)
    t = time.perf_counter()
    try:
        res = _core.run_mocker_trace_replay(**kw)
    except (ValueError, RuntimeError) as e:
        raise PeerError(f"Dynamo's mocker refused the replay: {e}") from None
    wall = time.perf_counter() - t
    summary = dict(res.summary)
    ms = summary.get("wall_time_ms")
    # The report's requests as this module reads them (MockerRequest: the fields it uses, each checked).
    per_request = cast(list[MockerRequest], list(res.per_request or []))
    return PeerRun(summary, per_request, wall, ms / 1e3 if isinstance(ms, (int, float)) else None)


def _ms(v: object) -> float:
    return v / 1e3 if isinstance(v, (int, float)) else NAN


def _routed(req: MockerRequest) -> float:
    """When the router released the request to a prefill worker (its arrival when it did at once)."""
    for hop in req.get("routing_history") or ():
        if hop.get("pool") == "prefill" and isinstance(at := hop.get("released_at_ms"), (int, float)):
            return float(at) / 1e3
    return _ms(req.get("arrival_time_ms"))


def records(per_request: list[MockerRequest], trace: Trace, cluster: str) -> list[RequestRecord]:
    """The mocker's per-request report as the testbed's records (paper seconds), paired with the
    trace by arrival order; PeerError when the two do not hold the same requests."""
    if len(per_request) != len(trace):
        raise PeerError(f"the mocker reported {len(per_request)} requests of the {len(trace)} replayed")
    ordered = sorted(per_request, key=lambda q: (q.get("arrival_time_ms") or 0.0, q.get("input_length") or 0))
    keyed = sorted(range(len(trace)), key=lambda i: (trace.requests[i].timestamp, trace.requests[i].input_tokens))
    out: list[RequestRecord] = []
    for i, q in zip(keyed, ordered):
        tr = trace.requests[i]
        if q.get("input_length") != tr.input_tokens:
            raise PeerError(
                f"the mocker's request at {q.get('arrival_time_ms')} ms has {q.get('input_length')} input "
                f"tokens, the trace's request {tr.request_id} {tr.input_tokens}: not the same trace"
            )
        done = q.get("terminal_status") == "completed"
        routed = _routed(q)
        held = _ms(q.get("source_held_ms"))
        times = StageTimes(
            arrival=_ms(q.get("arrival_time_ms")),
            router_arrival=_ms(q.get("arrival_time_ms")),
            routed=routed,
            prefill_queued=routed,
            prefill_start=_ms(q.get("prefill_admit_ms")),
            prefill_end=held,
            transfer_start=held,
            transfer_end=held,
            decode_admitted=_ms(q.get("decode_admit_ms")),
            first_token=_ms(q.get("first_token_ms")),
            last_token=_ms(q.get("last_token_ms")),
            decode_first_token=_ms(q.get("first_token_ms")),
            decode_last_token=_ms(q.get("last_token_ms")),
        )
        rec = RequestRecord(tr.request_id, i, tr.input_tokens, tr.output_tokens, times=times)
        rec.cached_tokens = int(q.get("reused_input_tokens") or 0)
        rec.decode_cached_tokens = int(q.get("decode_reused_input_tokens") or 0)
        rec.prefill_cluster = rec.decode_cluster = cluster
        if isinstance(w := q.get("prefill_worker_idx"), int):
            rec.prefill_node = f"{cluster}-mocker-prefill-{w}"
        if isinstance(w := q.get("decode_worker_idx"), int):
            rec.decode_node = f"{cluster}-mocker-decode-{w}"
        rec.outcome = "completed" if done else "failed"
        rec.reason = "" if done else str(q.get("terminal_status") or "unknown")
        rec.tokens_received = int(q.get("output_length") or 0) if done else 0
        rec.route_reason = "kv_router"
        out.append(rec)
    out.sort(key=lambda r: r.trace_index)
    return out


def write_run(out: Path, rs: ResolvedScenario, trace: Trace, s: PeerSetup, pr: PeerRun) -> Path:
    """The mocker's replay as a run directory (`records.csv`, `run.json`, `summary.json`), with its
    own report and engine arguments beside (`dynamo-summary.json`, `dynamo-engine.json`)."""
    from testbed.metrics.artefacts import run_info, write_artefact
    from testbed.metrics.artefacts.run_file import this_process
    from testbed.metrics.records import write_records
    from testbed.metrics.summary import write_summary

    out.mkdir(parents=True, exist_ok=True)
    recs = records(pr.per_request, trace, s.cluster.name)
    write_records(out / "records.csv", recs)
    sc = rs.spec
    ends = [r.times.last_token for r in recs if math.isfinite(r.times.last_token)]
    meta = run_info(
        name="dynamo-mocker",
        scenario=sc.name,
        policy="kv_router",
        backend="dynamo-mocker",
        t0=0.0,
        t_end=max(ends, default=0.0),
        scale={"speedup": 1.0, "byte_scale": 1.0},
        shaping={"method": "none", "detail": "Dynamo's mocker: no network model (instant KV transfer)"},
        slo={"ttft_s": sc.slo.ttft_s, "tpot_s": sc.slo.tpot_s},
        offered_rate=trace.offered_rate,
        trace={"source": trace.source, "requests": len(trace)},
        threshold=None,
        versions={PACKAGE: version()},
        interrupted=False,
        state="finished",
        **this_process(),
    )
    write_artefact(out / "run.json", meta, indent=1)
    (out / "dynamo-summary.json").write_text(json.dumps(pr.summary, indent=1, default=str) + "\n")
    (out / "dynamo-engine.json").write_text(
        json.dumps(
            {
                "prefill": s.prefill_engine,
                "decode": s.decode_engine,
                "num_prefill_workers": s.cluster.prefill,
                "num_decode_workers": s.cluster.decode,
                "router_mode": "kv_router",
                "trace_block_size": s.block_tokens,
                "scheduler": s.scheduler,
                "router": s.router,
                "notes": s.notes,
            },
            indent=1,
        )
        + "\n"
    )
    write_summary(out)
    return out
