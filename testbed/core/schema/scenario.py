"""Scenario schema: a deployment (model, hardware, clusters, links, policy, scale, SLO, workload).

Pure data and validation; reading YAML files lives in `testbed.config.scenarios`.
All figures are in paper units (seconds, bytes, tokens) unless a name says `wire`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from testbed.core.schema.hardware import (
    HardwareSpec,
)
from testbed.core.schema.limits import MAX_INPUT_TOKENS, MAX_OUTPUT_TOKENS
from testbed.core.schema.routers import ROUTERS, policy_refusal
from testbed.core.sessions import ArrivalMode

MIB = 1024 * 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """KV footprint of the served model.

    KV bytes of a request = linear_state_bytes
                            + window_bytes_per_token * min(tokens, window_tokens)
                            + full_attention_bytes_per_token * tokens.
    The layer pattern repeats to `layers` and tells which layers hold which part, so that
    KV can be streamed layer by layer. Sliding-window layers are listed as 'linear': like
    linear attention they hold request-level state that stops growing (once the prompt fills
    the window), which is how the paper's hybrid cache pool treats both.
    """

    name: str
    layers: int = Field(gt=0, le=4096)
    layer_pattern: list[Literal["linear", "full"]] = Field(min_length=1)
    linear_state_bytes: int = Field(ge=0)
    full_attention_bytes_per_token: float = Field(ge=0)
    block_tokens: int = Field(default=512, gt=0)
    # Prompt plus output, in tokens: longer requests are refused (400), as a real server does.
    max_context_tokens: int = Field(default=MAX_INPUT_TOKENS + MAX_OUTPUT_TOKENS, ge=1)
    window_tokens: int = Field(default=0, ge=0)
    window_bytes_per_token: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _kinds_present(self) -> ModelSpec:
        kinds = self.layer_kinds()
        if self.linear_state_bytes > 0 and "linear" not in kinds:
            raise ValueError("linear_state_bytes > 0 but layer_pattern has no 'linear' layer")
        if (self.window_tokens > 0) != (self.window_bytes_per_token > 0):
            raise ValueError("window_tokens and window_bytes_per_token must both be set (> 0) or both 0")
        if self.window_tokens > 0 and "linear" not in kinds:
            raise ValueError("a sliding window needs 'linear' layers in layer_pattern to hold it")
        if self.full_attention_bytes_per_token > 0 and "full" not in kinds:
            raise ValueError("full_attention_bytes_per_token > 0 but layer_pattern has no 'full' layer")
        return self

    def layer_kinds(self) -> list[str]:
        pat = self.layer_pattern
        return [pat[i % len(pat)] for i in range(self.layers)]


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)i?b?\s*$", re.I)


def size_bytes(v: object) -> object:
    """'4TiB', '512GiB', 1e12 -> bytes (k/M/G/T are powers of 1024); anything else unchanged,
    for pydantic to reject with its own message."""
    if isinstance(v, str) and (m := _SIZE_RE.match(v)):
        return int(float(m.group(1)) * 1024 ** "_kmgt".index(m.group(2).lower() or "_"))
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


class ClusterSpec(_Strict):
    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,15}$")
    datacenter: str = Field(pattern=r"^[a-z][a-z0-9-]{0,15}$")
    kind: Literal["prfaas", "pd"]
    hardware: str
    # Instance counts: the emulated backends run a few dozen; the simulator runs thousands.
    prefill: int = Field(ge=0, le=4096)
    decode: int = Field(ge=0, le=4096)
    # The cluster's hybrid prefix cache pool (host DRAM/SSD), paper bytes; 0 = no prefix cache.
    cache_bytes: int = Field(default=0, ge=0)
    # Who reads the prefix cache: `cluster`, one pool every prefill instance reads (the paper's);
    # `instance`, a pool per prefill instance that only its own prefills fill and read (as an
    # engine's own block cache), each of `instance_cache_bytes`, by default `cache_bytes` split
    # evenly over the cluster's prefill instances.
    cache_scope: Literal["cluster", "instance"] = "cluster"
    instance_cache_bytes: int | None = Field(default=None, ge=0)  # a prefill instance's own pool (cache_scope instance)

    @field_validator("cache_bytes", "instance_cache_bytes", mode="before")
    @classmethod
    def _size(cls, v: object) -> object:
        return size_bytes(v)

    @model_validator(mode="after")
    def _scope(self) -> ClusterSpec:
        if self.instance_cache_bytes is not None and self.cache_scope != "instance":
            raise ValueError("instance_cache_bytes needs cache_scope: instance")
        return self

    def instance_pool_bytes(self) -> int:
        """Each prefill instance's pool with `cache_scope: instance`."""
        if self.instance_cache_bytes is not None:
            return self.instance_cache_bytes
        return self.cache_bytes // max(self.prefill, 1)


class LinksSpec(_Strict):
    intra_dc: str = "lan"
    inter_dc: str = "cross-region-100g"


class LongTermSpec(_Strict):
    """The router's long-term loop (paper seconds; `testbed.core.control.longterm`): every `sample_s` it
    reads each stage's load (prefill work routed per instance-second and the work still queued;
    decode slot occupancy and sequences waiting for admission), every `interval_s` it judges
    them: it re-optimises the threshold on the last `window` requests' lengths and, when one PD
    role stays the bottleneck for `confirm` judgements while the other has room, drains one
    instance of the other role and brings it back in the bottleneck's role. Instances of the PD
    cluster are slots that hold either role (`testbed.core.control.roles`)."""

    enabled: bool = False
    sample_s: float = Field(default=2.0, gt=0)
    interval_s: float = Field(default=30.0, gt=0)
    window: int = Field(default=1000, ge=10, le=100000)  # recent requests the re-optimiser samples
    min_requests: int = Field(default=100, ge=1)  # recent requests needed before judging
    hot_utilisation: float = Field(default=0.9, gt=0)  # stage load that makes it the bottleneck
    hot_queue_s: float = Field(default=5.0, gt=0)  # prefill work queued per instance (not shrinking)
    hot_waiting: float = Field(default=1.0, gt=0)  # decode sequences waiting for a slot per instance
    donor_utilisation: float = Field(default=0.7, gt=0)  # the giving role's load after a conversion, at most
    confirm: int = Field(default=2, ge=1)  # judgements in a row that see the same bottleneck
    min_interval_s: float = Field(default=60.0, ge=0)  # after a conversion (or retune), before the next
    retune: bool = True  # re-optimise t (policy prfaas)
    min_change: float = Field(default=0.1, ge=0)  # relative threshold change worth making
    min_gain: float = Field(default=0.1, ge=0, lt=1)  # relative drop of the higher prefill load worth a retune
    min_prefill: int = Field(default=1, ge=1)
    min_decode: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _hysteresis(self) -> LongTermSpec:
        if self.donor_utilisation >= self.hot_utilisation:
            raise ValueError(
                "donor_utilisation must be below hot_utilisation, or a conversion can make the "
                "giving role the next bottleneck and the loop flaps"
            )
        return self


class ControlSpec(_Strict):
    """The router's short-term loop (paper seconds): every `interval_s` it reads the PrfaaS
    senders' delivered and undelivered KV bytes, TCP retransmissions and the prefill backlogs,
    estimates the bandwidth the WAN gives, judges it scarce or abundant (the cache-aware rules)
    and, with `bandwidth_aware`, moves the threshold to where the predicted load of the link and
    of both prefill stages is lowest (see `testbed.core.control.bandwidth`)."""

    interval_s: float = Field(default=2.0, gt=0)
    window: int = Field(default=200, ge=10, le=100000)  # recent requests the planner samples
    target_utilisation: float = Field(default=0.85, gt=0, le=1)  # prefill stages
    # The link's is lower: busy PrfaaS instances each stream KV at Phi_kv while they compute, so the
    # link sees N x Phi_kv whenever the cluster is fully busy, well above the mean it is planned on.
    link_target_utilisation: float = Field(default=0.7, gt=0, le=1)
    tail_limit_s: float = Field(default=0.5, gt=0)  # mean KV transfer tail that counts as saturation
    abundant_utilisation: float = Field(default=0.5, gt=0, le=1)
    horizon_s: float = Field(default=20.0, gt=0)  # drain existing backlogs within this
    saturated_s: float = Field(default=0.3, gt=0)  # undelivered KV worth this much link time = saturated
    retrans_limit: float = Field(default=0.01, ge=0, le=1)  # retransmitted share that counts as congestion
    probe_growth: float = Field(default=1.25, ge=1)  # bandwidth estimate growth per unsaturated interval
    hold_s: float = Field(default=6.0, ge=0)  # no growth this long after the link last saturated
    min_change: float = Field(default=0.05, ge=0)  # relative threshold change worth making
    min_gain: float = Field(default=0.1, ge=0, lt=1)  # relative drop of the peak load worth a change
    recovery_step: float = Field(default=1.1, gt=1)  # most t moves back toward the base per update
    min_requests: int = Field(default=20, ge=1)  # recent requests needed before planning
    rate_window: int = Field(default=3, ge=1, le=100)  # intervals whose best delivered rate bounds the link
    min_threshold: int | None = Field(default=None, ge=0)  # default: base threshold / 4
    max_threshold: int | None = Field(default=None, ge=1)  # default: the workload's longest input
    long_term: LongTermSpec = LongTermSpec()


class LoadAwareSpec(_Strict):
    """Load-aware cache routing (`cache_routing: load-aware`, see `testbed.core.routing.load_aware`): the
    threshold rule's pick (the paper's rules) is kept unless another candidate is predicted faster
    by more than `min_gain_s` paper seconds. Offloading a short request ships its whole linear
    state however short it is: the margin keeps offload to where it saves enough to pay for that.
    0 takes the least predicted TTFT always (the rule only breaks ties)."""

    min_gain_s: float = Field(default=1.0, ge=0)


PolicyName = Literal["homogeneous", "naive", "prfaas"]


class PolicySpec(_Strict):
    name: PolicyName
    threshold: int | Literal["auto"] | None = None
    bandwidth_aware: bool = False
    cache_aware: bool = False
    # How the cache-aware prfaas router picks the prefill cluster and any cache move: the paper's
    # rules (docs/paper.md section 3.4, the baseline) or by predicted TTFT (load-aware).
    cache_routing: Literal["paper", "load-aware"] = "paper"
    load_aware: LoadAwareSpec = LoadAwareSpec()
    # For the cache-aware rules: judged from the measured link (auto), or fixed.
    bandwidth_state: Literal["auto", "scarce", "abundant"] = "auto"
    # Which prefill instance of the chosen cluster takes a prompt: `least_loaded` (least modelled
    # work queued, then fewest assigned, then name) or `kv_overlap`, Dynamo's KV router's cost
    # (`testbed.core.routing.placement`): kv_overlap_weight x (uncached prompt tokens plus those
    # of the prompts in flight there, in blocks) + blocks held by the prompts in flight there and
    # this one's blocks none of them holds (a shared block counted once); least cost wins, ties by
    # the least-loaded order.
    placement: Literal["least_loaded", "kv_overlap"] = "least_loaded"
    kv_overlap_weight: float = Field(default=1.0, ge=0)  # kv_overlap: weight of the uncached blocks against the load
    control: ControlSpec = ControlSpec()

    @model_validator(mode="after")
    def _threshold(self) -> PolicySpec:
        if self.name == "prfaas" and self.threshold is None:
            raise ValueError("policy 'prfaas' needs a threshold (tokens or 'auto')")
        if isinstance(self.threshold, int) and self.threshold < 0:
            raise ValueError("threshold must be >= 0")
        if self.bandwidth_aware and self.name != "prfaas":
            raise ValueError(f"bandwidth_aware needs policy 'prfaas' (a threshold to move), not {self.name!r}")
        if self.cache_routing == "load-aware" and (self.name != "prfaas" or not self.cache_aware):
            raise ValueError("cache_routing 'load-aware' needs policy 'prfaas' with cache_aware: true")
        c = self.control
        if c.min_threshold is not None and c.max_threshold is not None and c.min_threshold > c.max_threshold:
            raise ValueError("control.min_threshold must be <= control.max_threshold")
        if c.long_term.enabled and self.name == "naive":
            raise ValueError(
                "control.long_term needs policy 'prfaas' or 'homogeneous' (under 'naive' the PD "
                "cluster prefills nothing, so no role is worth converting)"
            )
        return self


class ScaleSpec(_Strict):
    """Wire time = paper time / speedup; wire bytes = paper bytes / byte_scale."""

    speedup: float = Field(default=1.0, gt=0, le=1000)
    byte_scale: float = Field(default=1.0, ge=1, le=1e9)


class SLOSpec(_Strict):
    ttft_s: float = Field(default=10.0, gt=0)
    tpot_s: float = Field(default=0.025, gt=0)


class LengthDist(_Strict):
    distribution: Literal["lognormal"] = "lognormal"
    mu: float = 9.90
    sigma: float = Field(default=1.00, gt=0)
    min: int = Field(default=128, ge=1)
    max: int = Field(default=131072, ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> LengthDist:
        if self.max < self.min:
            raise ValueError("max must be >= min")
        return self


class WorkloadSpec(_Strict):
    """The paper's synthetic workload: Poisson arrivals, log-normal input, fixed output."""

    kind: Literal["synthetic"] = "synthetic"
    input: LengthDist = LengthDist()
    output_tokens: int = Field(default=1024, gt=0)
    rate: float = Field(default=1.0, gt=0)
    requests: int = Field(default=200, gt=0)
    seed: int = 1
    # How a run sends its trace (this workload's or --trace's): open loop, each request at its
    # timestamp, or closed loop, each turn of a session after its parent's answer
    # (`testbed.core.sessions`); a trace without sessions runs the same either way.
    arrivals: ArrivalMode = "open"
    # The trace (and window) a `testbed plan` file was sized for, as `--trace FILE [--window W]`:
    # a run of the file without --trace warns that it replays this synthetic workload instead.
    planned_for: str | None = None


class TransferSpec(_Strict):
    connections: int = Field(default=4, ge=1, le=64)
    chunk_bytes: int = Field(default=256 * 1024, ge=1024, le=16 * MIB)
    sndbuf_bytes: int | None = Field(default=None, ge=4096)
    rcvbuf_bytes: int | None = Field(default=None, ge=4096)
    congestion: str | None = None
    checksum: bool = False
    # Wire seconds a transfer may go without progress after a connection loss (resuming on
    # other or new connections) before it fails: set above the outages a link profile schedules.
    resume_timeout_s: float = Field(default=30.0, gt=0, le=3600)


class ServingSpec(_Strict):
    """How the mock nodes talk to clients, and the limits the router enforces."""

    stream_interval: int = Field(default=1, ge=1, le=1024)
    max_output_tokens: int = Field(default=MAX_OUTPUT_TOKENS, ge=1, le=MAX_OUTPUT_TOKENS)
    max_body_bytes: int = Field(default=8 * MIB, ge=64 * 1024, le=1 << 30)
    # Per-request deadline (paper seconds): fixed, or `deadline_factor` x (TTFT SLO + TPOT SLO x
    # the request's max_tokens). A request past it fails with that reason instead of holding on.
    deadline_s: float | None = Field(default=None, gt=0)
    deadline_factor: float = Field(default=10.0, gt=1)
    # ...but never under this much wire time: the deadline stops requests that would hang, it is
    # no SLO check, and a busy host stretches wire time at high speedups.
    deadline_floor_wire_s: float = Field(default=30.0, gt=0)
    # Every HTTP service closes a client connection idle this many wire seconds: one that sent no
    # request, has not finished a request's headers, or waits between requests. nginx's 75 s:
    # above every client pool's own keep-alive (aiohttp 15 s, httpx 5 s), so a pooled connection
    # is dropped by its client first, never under a request being sent on it.
    idle_timeout_s: float = Field(default=75.0, gt=0, le=3600)


# vLLM's NixlConnector frees a prefill's KV that no decode pulled after this long
# (VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s).
VLLM_KV_HOLD_TIMEOUT_S = 480.0


class NodesSpec(_Strict):
    """Which PD protocol the mock nodes speak (`testbed.live.engine_protocol`): `testbed` (the
    router opens the decode stream, then asks the prefill, which pushes the KV layer by layer),
    `vllm` (two stages; the decode pulls the KV after the prefill has ended, from where the
    prefill's `kv_transfer_params` say) or `sglang` (one stage to both; a bootstrap room; the
    prefill pushes)."""

    # None: the protocol of `router.kind` (testbed for the testbed's router).
    protocol: Literal["testbed", "vllm", "sglang"] | None = None
    # vllm: wire seconds a finished prefill holds KV that no decode pulled before freeing it.
    kv_hold_timeout_s: float = Field(default=VLLM_KV_HOLD_TIMEOUT_S, gt=0, le=86400)


class RouterSpec(_Strict):
    """What stands in the router's place: the testbed's own router, or a real PD router
    installed from PyPI (the `routers` extra), started with its policy and options
    (`testbed.core.schema.routers`). A foreign router drives the nodes in its engine's protocol."""

    kind: Literal["testbed", "vllm-router", "sglang-router"] = "testbed"  # what stands in the router's place
    policy: str | None = None  # None: the router's default (cache_aware for both)
    prefill_policy: str | None = None  # the prefill side's own policy (--prefill-policy)
    decode_policy: str | None = None  # the decode side's own policy (--decode-policy)
    options: list[str] = []  # extra command-line arguments, passed as given

    @model_validator(mode="after")
    def _known_policies(self) -> RouterSpec:
        if self.kind == "testbed":
            if self.policy or self.prefill_policy or self.decode_policy or self.options:
                raise ValueError(
                    "router.policy/prefill_policy/decode_policy/options are for a foreign router "
                    "(router.kind vllm-router | sglang-router); the testbed's router takes policy.kind"
                )
            return self
        for side in ("policy", "prefill_policy", "decode_policy"):
            v = getattr(self, side)
            if v is not None and (why := policy_refusal(self.kind, side, v)) is not None:
                raise ValueError(f"router.{side}: {why}")
        return self


class LivePathSpec(_Strict):
    """What the live path costs a request, wire seconds (`testbed.core.schema.live_path`)."""

    routing_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)  # client sent -> router decided
    dispatch_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)  # router decided -> prefill queued
    relay_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)  # decode produced the first token -> client has it
    relay_last_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)  # the same for the last token
    stall_rate_per_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)  # decode loop stalls per decoding second
    stall_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)  # mean time one stall loses
    restart_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)  # a restarted service answers its health check


class SimSpec(_Strict):
    """The simulator's own settings (`--backend sim`; the emulating backends ignore them).

    `live_path`: what the emulator's live path costs beyond the modelled stages, for the
    simulator to add: `none` (nothing: the model's times alone), `host` (this host's figures,
    measured by `testbed bench live-path`), the path of such a figures file, or the figures."""

    live_path: LivePathSpec | str = "none"


def node_id(cluster: str, role: str, index: int) -> str:
    """The id of a node instance: `{cluster}-p{i}` (prefill) or `{cluster}-d{i}` (decode)."""
    return f"{cluster}-{'p' if role == 'prefill' else 'd'}{index}"


class _FaultBase(_Strict):
    # YAML reads .inf and .nan as floats: `duration_s: .inf` passed gt=0 and made a fault without end.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    at_s: float = Field(ge=0)  # paper seconds after the replay's t0
    note: str = ""


class _NodeFault(_FaultBase):
    """A fault of one node instance, named by its id (`{cluster}-p{i}` / `{cluster}-d{i}`, see
    `testbed.core.schema.topology`) or by `cluster`, `role` and `index`."""

    node: str | None = None
    cluster: str | None = None
    role: Literal["prefill", "decode"] | None = None
    index: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _one_target(self) -> _NodeFault:
        parts = (self.cluster, self.role, self.index)
        if self.node is not None and any(p is not None for p in parts):
            raise ValueError("name the instance by 'node' or by 'cluster', 'role' and 'index', not both")
        if self.node is None and any(p is None for p in parts):
            raise ValueError("name the instance by 'node' (e.g. pd-d0) or by all of 'cluster', 'role' and 'index'")
        return self

    def node_id(self) -> str:
        if self.node is not None:
            return self.node
        assert self.cluster is not None and self.role is not None and self.index is not None
        return node_id(self.cluster, self.role, self.index)


class KillFault(_NodeFault):
    """SIGKILL: the instance is gone for the rest of the run."""

    kind: Literal["kill"]


class PauseFault(_NodeFault):
    """SIGSTOP, then SIGCONT after `duration_s`: the instance freezes with its connections open."""

    kind: Literal["pause"]
    duration_s: float = Field(gt=0)


class RestartFault(_NodeFault):
    """SIGKILL, then the instance starts again (empty state) after `down_s`."""

    kind: Literal["restart"]
    down_s: float = Field(default=0.0, ge=0)


class SlowFault(_NodeFault):
    """Every modelled service time of the instance (prefill compute, decode step) x `factor`."""

    kind: Literal["slow"]
    factor: float = Field(gt=1, le=1000)
    duration_s: float = Field(gt=0)


class _LinkFault(_FaultBase):
    duration_s: float = Field(gt=0)
    # Two datacenters: both directions between them; default every inter-DC link.
    between: tuple[str, str] | None = None


class OutageFault(_LinkFault):
    """Every packet on the link is lost (rate 0) for `duration_s`."""

    kind: Literal["outage"]


class RateDropFault(_LinkFault):
    """The link's rate x `factor` for `duration_s`."""

    kind: Literal["rate_drop"]
    factor: float = Field(gt=0, lt=1)


class PartitionFault(_FaultBase):
    """One direction cut: packets from datacenter `src` to `dst` are lost; the reverse flows."""

    kind: Literal["partition"]
    duration_s: float = Field(gt=0)
    src: str
    dst: str


class TcpResetFault(_FaultBase):
    """During the window, RSTs with valid sequence numbers injected at the WAN router into the KV
    connections crossing it: `count` of them (the first seen) or all, to both ends or one."""

    kind: Literal["tcp_reset"]
    duration_s: float = Field(gt=0)
    count: int | Literal["all"] = "all"
    ends: Literal["both", "receiver", "sender"] = "both"

    @field_validator("count")
    @classmethod
    def _count(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("count must be >= 1 or 'all'")
        return v


FaultKind = Literal["kill", "pause", "restart", "slow", "outage", "rate_drop", "partition", "tcp_reset"]
FaultSpec = Annotated[
    KillFault | PauseFault | RestartFault | SlowFault | OutageFault | RateDropFault | PartitionFault | TcpResetFault,
    Field(discriminator="kind"),
]
NODE_FAULTS = (KillFault, PauseFault, RestartFault, SlowFault)


class ModelProfile(_Strict):
    """A scenario fragment (scenarios/models/*.yaml): a model and its prefill curve on named
    hardware, merged into a scenario through `extends`."""

    model: ModelSpec
    hardware: dict[str, HardwareSpec] = Field(min_length=1)


class Scenario(_Strict):
    # The name becomes a directory name under the run directory: one path component, no '..'.
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")
    description: str = ""
    model: ModelSpec
    hardware: dict[str, HardwareSpec]
    clusters: list[ClusterSpec] = Field(min_length=1)
    links: LinksSpec = LinksSpec()
    policy: PolicySpec
    scale: ScaleSpec = ScaleSpec()
    slo: SLOSpec = SLOSpec()
    workload: WorkloadSpec = WorkloadSpec()
    transfer: TransferSpec = TransferSpec()
    serving: ServingSpec = ServingSpec()
    nodes: NodesSpec = NodesSpec()
    router: RouterSpec = RouterSpec()
    # Timed fault events (see `testbed.core.fault_timeline` for their timeline).
    faults: list[FaultSpec] = []
    sim: SimSpec = SimSpec()

    @property
    def node_protocol(self) -> str:
        """The PD protocol the nodes speak: `nodes.protocol`, else the router's."""
        if self.nodes.protocol is not None:
            return self.nodes.protocol
        return ROUTERS[self.router.kind][0] if self.router.kind != "testbed" else "testbed"

    @model_validator(mode="after")
    def _protocols(self) -> Scenario:
        # The testbed's router speaks every protocol (`testbed.live.router.engines`); a foreign
        # router only its engine's.
        proto, kind = self.node_protocol, self.router.kind
        if kind != "testbed" and proto != ROUTERS[kind][0]:
            raise ValueError(
                f"router.kind {kind!r} speaks the {ROUTERS[kind][0]!r} protocol, not nodes.protocol {proto!r}"
            )
        return self

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        names = [c.name for c in self.clusters]
        if len(set(names)) != len(names):
            raise ValueError(f"cluster names must be unique, got {names}")
        for c in self.clusters:
            if c.hardware not in self.hardware:
                raise ValueError(
                    f"cluster {c.name!r} names hardware {c.hardware!r}, not one of {sorted(self.hardware)}"
                )
            if c.decode > 0 and self.hardware[c.hardware].decode is None:
                raise ValueError(
                    f"cluster {c.name!r} has decode instances but hardware {c.hardware!r} has no decode profile"
                )
            if c.kind == "prfaas" and c.decode > 0:
                raise ValueError(f"cluster {c.name!r} is a PrfaaS cluster and cannot hold decode instances")
        if not any(c.kind == "pd" and c.decode > 0 for c in self.clusters):
            raise ValueError("at least one 'pd' cluster with decode instances is required")
        if not any(c.prefill > 0 for c in self.clusters):
            raise ValueError("at least one cluster with prefill instances is required")
        pol = self.policy.name
        has_prfaas = any(c.kind == "prfaas" and c.prefill > 0 for c in self.clusters)
        has_pdp = any(c.kind == "pd" and c.prefill > 0 for c in self.clusters)
        if pol in ("naive", "prfaas") and not has_prfaas:
            raise ValueError(f"policy {pol!r} needs a 'prfaas' cluster with prefill instances")
        if pol in ("homogeneous", "prfaas") and not has_pdp:
            raise ValueError(f"policy {pol!r} needs a 'pd' cluster with prefill instances")
        if self.policy.control.long_term.enabled:
            self._check_long_term()
        self._check_faults()
        return self

    def _check_long_term(self) -> None:
        lt = self.policy.control.long_term
        pds = [c for c in self.clusters if c.kind == "pd"]
        if len(pds) != 1:
            raise ValueError(f"control.long_term converts the roles of one PD cluster; this scenario has {len(pds)}")
        c = pds[0]
        if c.prefill < lt.min_prefill or c.decode < lt.min_decode:
            raise ValueError(
                f"control.long_term: PD cluster {c.name!r} starts with {c.prefill} prefill / "
                f"{c.decode} decode instances, below min_prefill {lt.min_prefill} / "
                f"min_decode {lt.min_decode}"
            )

    def deadline_s(self, output_tokens: int) -> float:
        """A request's deadline in paper seconds (see ServingSpec)."""
        sv = self.serving
        if sv.deadline_s is not None:
            return sv.deadline_s
        return sv.deadline_factor * (self.slo.ttft_s + self.slo.tpot_s * output_tokens)

    def _fault_field(self, f: _NodeFault) -> str:
        """The field that names a missing instance wrongly."""
        if f.node is not None:
            return "node"
        c = next((c for c in self.clusters if c.name == f.cluster), None)
        if c is None:
            return "cluster"
        return "role" if (c.prefill if f.role == "prefill" else c.decode) == 0 else "index"

    def _check_faults(self) -> None:
        """Every fault names an instance or datacenters of this scenario; errors carry the field."""
        nodes = [
            node_id(c.name, r, i)
            for c in self.clusters
            for r, n in (("prefill", c.prefill), ("decode", c.decode))
            for i in range(n)
        ]
        dcs = list(dict.fromkeys(c.datacenter for c in self.clusters))
        errors: list[InitErrorDetails] = []

        def bad(loc: tuple[str | int, ...], value: Any, msg: str) -> None:
            errors.append(
                InitErrorDetails(type=PydanticCustomError("fault_target", msg), loc=("faults", *loc), input=value)
            )

        for i, f in enumerate(self.faults):
            if isinstance(f, NODE_FAULTS):
                nid = f.node_id()
                if nid not in nodes:
                    field = self._fault_field(f)
                    bad(
                        (i, field),
                        getattr(f, field),
                        f"no instance {nid!r} in this scenario (instances: {', '.join(nodes)})",
                    )
                continue
            if len(dcs) < 2:
                bad((i, "kind"), f.kind, f"a {f.kind!r} fault needs two datacenters; this scenario has {dcs}")
                continue
            if isinstance(f, OutageFault | RateDropFault) and f.between is not None:
                for j, dc in enumerate(f.between):
                    if dc not in dcs:
                        bad((i, "between", j), dc, f"unknown datacenter {dc!r} (datacenters: {', '.join(dcs)})")
                if f.between[0] == f.between[1]:
                    bad((i, "between"), list(f.between), "a link joins two different datacenters")
            if isinstance(f, PartitionFault):
                for field in ("src", "dst"):
                    if getattr(f, field) not in dcs:
                        bad(
                            (i, field),
                            getattr(f, field),
                            f"unknown datacenter {getattr(f, field)!r} (datacenters: {', '.join(dcs)})",
                        )
                if f.src == f.dst:
                    bad((i, "dst"), f.dst, "a partition cuts the direction between two different datacenters")
        if errors:
            # Raised as a ValidationError so each message keeps its own field path.
            raise ValidationError.from_exception_data(type(self).__name__, errors)

    def cluster(self, name: str) -> ClusterSpec:
        for c in self.clusters:
            if c.name == name:
                return c
        raise KeyError(name)
