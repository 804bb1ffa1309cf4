"""The reference's own words for fields the code says nothing about, keyed by
`module.Class.field` (the class that declares the field). A field that gains a comment or a
docstring in the code takes that instead; a test fails on a note whose field is gone, so none
can go stale."""

from __future__ import annotations

_S = "testbed.core.schema.scenario."
_H = "testbed.core.schema.hardware."
_L = "testbed.core.schema.linkprofile."
_R = "testbed.metrics.artefacts.run_file."
_REC = "testbed.core.record."

NOTES: dict[str, str] = {
    # -- the scenario --------------------------------------------------------------------------
    _S + "Scenario.description": "One line on what the scenario is, shown in listings and reports.",
    _S + "Scenario.model": "The served model's KV footprint.",
    _S + "Scenario.hardware": "Named hardware profiles: each a prefill time curve and a decode step model; "
    "clusters name one.",
    _S + "Scenario.clusters": "The clusters: which datacenter, which kind (PrfaaS or PD), which hardware, "
    "how many prefill and decode instances.",
    _S + "Scenario.links": "The link profiles (`netem_profiles/NAME.yaml`) inside and between datacenters.",
    _S + "Scenario.policy": "How the router picks the prefill cluster and instance.",
    _S + "Scenario.scale": "Time and byte scaling between paper units and the wire.",
    _S + "Scenario.slo": "The SLOs goodput is judged by, paper seconds.",
    _S + "Scenario.workload": "The synthetic workload replayed when no `--trace` is given.",
    _S + "Scenario.transfer": "The KV transfer layer: connections, chunks, socket buffers.",
    _S + "Scenario.serving": "How the services talk to clients, and the limits the router enforces.",
    _S + "ModelSpec.name": "The served model's name (what `GET /v1/models` answers; clients may send any).",
    _S + "ModelSpec.layers": "Number of layers; the layer pattern repeats to this many.",
    _S + "ModelSpec.layer_pattern": "Layer kinds, repeated to `layers`: `linear` (linear attention or a sliding "
    "window: request-level state) or `full` (per-token KV).",
    _S + "ModelSpec.linear_state_bytes": "Fixed KV bytes of a request's linear-attention state, over all layers.",
    _S + "ModelSpec.full_attention_bytes_per_token": "KV bytes per token of the full-attention layers, over all "
    "layers.",
    _S + "ModelSpec.block_tokens": "Prefix-cache block size, tokens.",
    _S + "ModelSpec.window_tokens": "Sliding window length, tokens (0: no sliding-window layers).",
    _S + "ModelSpec.window_bytes_per_token": "KV bytes per token held by the sliding-window layers, up to "
    "`window_tokens`.",
    _H + "HardwareSpec.prefill": "Prefill time as a function of uncached tokens: a `table` or a `polynomial`.",
    _H + "HardwareSpec.decode": "Decode step model; `null` for hardware that only prefills.",
    _H + "TablePrefill.points": "`[tokens, seconds]` pairs with strictly increasing tokens.",
    _H + "TablePrefill.cached_token_s": "Seconds per cached prefix token (reading it back).",
    _H + "PolynomialPrefill.coefficients": "c_0, c_1, ...: seconds = sum(c_i * l^i) over uncached tokens l.",
    _H + "PolynomialPrefill.cached_token_s": "Seconds per cached prefix token (reading it back).",
    _H + "TablePrefill.overhead_s": "Fixed seconds per prefill whatever its length (scheduling, launches).",
    _H + "TablePrefill.cached_attention_s": "Seconds per cached token per uncached token: the new tokens' "
    "attention over the cached prefix.",
    _H + "PolynomialPrefill.overhead_s": "Fixed seconds per prefill whatever its length (scheduling, launches).",
    _H + "PolynomialPrefill.cached_attention_s": "Seconds per cached token per uncached token: the new tokens' "
    "attention over the cached prefix.",
    _H + "HardwareSpec.provenance": "Where the profile's figures come from (source, tool, system, parallelism).",
    _H + "DecodeSpec.base_s": "Fixed part of a decode step, seconds.",
    _H + "DecodeSpec.per_seq_s": "Seconds per sequence in the batch.",
    _H + "DecodeSpec.per_context_token_s": "Seconds per context token held by the whole batch.",
    _H + "DecodeSpec.bs_max": "Most sequences in a decode batch (BS_max).",
    _H + "DecodeSpec.kv_capacity_bytes": "KV memory of a decode instance, paper bytes: admission waits for room.",
    _S + "ClusterSpec.name": "The cluster's name; instance ids are `{name}-p{i}` and `{name}-d{i}`.",
    _S + "ClusterSpec.datacenter": "The datacenter it sits in; clusters in different datacenters talk over the "
    "inter-DC link.",
    _S + "ClusterSpec.kind": "`prfaas` (prefill only, reached over the WAN) or `pd` (prefill and decode).",
    _S + "ClusterSpec.hardware": "A key of `hardware`.",
    _S + "ClusterSpec.decode": "Decode instances.",
    _S + "LinksSpec.intra_dc": "Link profile inside a datacenter.",
    _S + "LinksSpec.inter_dc": "Link profile between datacenters (the WAN).",
    _S + "PolicySpec.name": "`homogeneous` (PD only), `naive` (every prefill in PrfaaS) or `prfaas` (by length "
    "threshold).",
    _S + "PolicySpec.threshold": "Length threshold t in tokens (requests with more incremental tokens go to "
    "PrfaaS), or `auto` from the analytical optimiser; policy `prfaas` needs one.",
    _S + "PolicySpec.bandwidth_aware": "Run the short-term control loop that moves t with the measured WAN "
    "(policy `prfaas`).",
    _S + "PolicySpec.cache_aware": "Route by the prefix each cluster has cached (the paper's cache rules).",
    _S + "PolicySpec.load_aware": "Load-aware cache routing's parameters.",
    _S + "PolicySpec.control": "The control loops' parameters.",
    _S + "LoadAwareSpec.min_gain_s": "Paper seconds another candidate must be predicted faster by to beat the "
    "rule's pick.",
    _S + "ControlSpec.interval_s": "Paper seconds between the short-term loop's samples.",
    _S + "ControlSpec.abundant_utilisation": "Link utilisation under which bandwidth counts as abundant (the "
    "cache rules).",
    _S + "LongTermSpec.enabled": "Run the long-term loop (role conversion, threshold re-optimisation).",
    _S + "LongTermSpec.sample_s": "Paper seconds between samples of the stage loads.",
    _S + "LongTermSpec.interval_s": "Paper seconds between judgements.",
    _S + "LongTermSpec.min_prefill": "Fewest PD prefill instances a conversion may leave.",
    _S + "LongTermSpec.min_decode": "Fewest PD decode instances a conversion may leave.",
    _S + "ScaleSpec.speedup": "s: every duration (arrival gaps, service times, link delays) is divided by s on "
    "the wire.",
    _S + "ScaleSpec.byte_scale": "b: KV bytes on the wire are divided by b (link rates by b and multiplied by s).",
    _S + "SLOSpec.ttft_s": "TTFT target, paper seconds.",
    _S + "SLOSpec.tpot_s": "TPOT target, paper seconds.",
    _S + "WorkloadSpec.kind": "The only kind: the paper's synthetic workload.",
    _S + "WorkloadSpec.input": "Input length distribution.",
    _S + "WorkloadSpec.output_tokens": "Output tokens of every request.",
    _S + "WorkloadSpec.rate": "Poisson arrival rate, paper req/s.",
    _S + "WorkloadSpec.requests": "Requests to generate.",
    _S + "WorkloadSpec.seed": "Seed of the arrivals and lengths.",
    _S + "LengthDist.distribution": "The only distribution: log-normal.",
    _S + "LengthDist.mu": "mu of the log-normal (of ln tokens).",
    _S + "LengthDist.sigma": "sigma of the log-normal.",
    _S + "LengthDist.min": "Shortest length; draws below are truncated to it.",
    _S + "LengthDist.max": "Longest length; draws above are truncated to it.",
    _S + "TransferSpec.connections": "Persistent TCP connections per destination; chunks are striped over them.",
    _S + "TransferSpec.chunk_bytes": "Bytes per KV chunk (frame payload).",
    _S + "TransferSpec.sndbuf_bytes": "SO_SNDBUF of KV sockets (default: the kernel's).",
    _S + "TransferSpec.rcvbuf_bytes": "SO_RCVBUF of KV sockets (default: the kernel's).",
    _S + "TransferSpec.congestion": "TCP congestion control of KV sockets (default: the link profile's on "
    "netns, else the kernel's).",
    _S + "TransferSpec.checksum": "Add a CRC per chunk and a byte pattern the receiver checks (for tests).",
    _S + "ServingSpec.stream_interval": "Tokens per streamed chunk (SSE event).",
    _S + "ServingSpec.max_output_tokens": "Largest `max_tokens` a request may ask for (larger: a 400).",
    _S + "ServingSpec.max_body_bytes": "Largest request body the router reads, bytes (larger: refused).",
    _S + "ServingSpec.deadline_factor": "The default deadline: this x (TTFT SLO + TPOT SLO x the request's "
    "max_tokens).",
    _S + "_FaultBase.note": "Free text, carried into `faults.jsonl`.",
    _S + "_NodeFault.node": "The instance's id, e.g. `pd-d0` (or give `cluster`, `role` and `index`).",
    _S + "_NodeFault.cluster": "The instance's cluster (with `role` and `index`).",
    _S + "_NodeFault.role": "The instance's role (with `cluster` and `index`).",
    _S + "_NodeFault.index": "The instance's index in its cluster and role (with `cluster` and `role`).",
    _S + "PauseFault.duration_s": "Paper seconds the instance stays stopped.",
    _S + "RestartFault.down_s": "Paper seconds between the kill and the start.",
    _S + "SlowFault.factor": "Factor on every modelled service time (> 1).",
    _S + "SlowFault.duration_s": "Paper seconds it lasts.",
    _S + "_LinkFault.duration_s": "Paper seconds it lasts.",
    _S + "RateDropFault.factor": "Factor on the link's rate (< 1).",
    _S + "PartitionFault.duration_s": "Paper seconds it lasts.",
    _S + "PartitionFault.src": "Datacenter whose packets toward `dst` are lost.",
    _S + "PartitionFault.dst": "Datacenter they were going to.",
    _S + "TcpResetFault.duration_s": "Paper seconds the injector runs.",
    _S + "TcpResetFault.count": "How many KV connections to reset (the first seen), or `all`.",
    _S + "TcpResetFault.ends": "Which end gets the RST: both, the receiver (decode side) or the sender.",
    # -- link profiles -------------------------------------------------------------------------
    _L + "LinkProfile.name": "The profile's name (its file's stem).",
    _L + "LinkProfile.description": "One line on what it models.",
    _L + "LinkProfile.jitter": "Delay variation each way, seconds (the delay line never reorders).",
    _L + "LinkProfile.loss": "Mean packet loss, 0-1.",
    _L + "LinkProfile.loss_correlation": "Lag-1 correlation of losses (a Gilbert chain with mean `loss`).",
    _L + "LinkProfile.mtu": "MTU of the emulated network (default: the backend's).",
    _L + "LinkProfile.tcp": "TCP settings in the link's namespaces.",
    _L + "LinkProfile.schedule": "Changes over time (rate drops, outages), applied while the run goes on.",
    _L + "LinkChange.at": "Paper seconds after the run's start.",
    _L + "LinkChange.rate": "New rate, bit/s (paper).",
    _L + "LinkChange.delay": "New one-way delay, seconds.",
    _L + "LinkChange.jitter": "New jitter, seconds.",
    _L + "LinkChange.loss": "New loss, 0-1 (1: an outage).",
    _L + "LinkChange.note": "Free text, shown in reports.",
    # -- run.json ------------------------------------------------------------------------------
    _R + "RunInfo.schema_version": "Version of this file's model (see the schema versions).",
    _R + "RunInfo.name": "The run's name.",
    _R + "RunInfo.scenario": "The scenario's name.",
    _R + "RunInfo.policy": "The routing policy.",
    _R + "RunInfo.backend": "The backend that ran it (`netns`, `local`, `sim`, ...).",
    _R + "RunInfo.t_end": "Unix time the run ended.",
    _R + "RunInfo.scale": "speedup and byte_scale in force.",
    _R + "RunInfo.shaping": "How the WAN was shaped: method, profile, MTU, per-direction parameters.",
    _R + "RunInfo.offered_rate": "Offered rate, paper req/s (1 / mean inter-arrival gap); null when it has none: "
    "fewer than two requests, or all at one instant (a burst).",
    _R + "RunInfo.trace": "Where the workload came from, and how many requests it holds.",
    _R + "RunInfo.threshold": "Routing threshold at the start (tokens).",
    _R + "RunInfo.versions": "Versions of Python, the platform, the testbed and its main libraries (free-form).",
    _R + "RunInfo.interrupted": "The run was stopped early (Ctrl-C, SIGTERM).",
    _R + "RunInfo.hold": "`testbed up --hold`: the URLs clients were given and how the hold ended.",
    _R + "RunInfo.sim": "The simulator's own figures (events, wall time).",
    _R + "Shaping.method": "`netem`, `fallback` (HTB and the userspace delay line), `sim`, or `none`.",
    _R + "Shaping.profile": "The inter-DC link profile.",
    _R + "Shaping.mtu": "MTU of the emulated network.",
    _R + "Shaping.links": "Per shaped direction (`src->dst`), wire units.",
    _R + "Shaping.detail": "Free text on how it was shaped.",
    _R + "ShapedLink.rate_bps_wire": "Rate, wire bit/s.",
    _R + "ShapedLink.delay_s_wire": "One-way delay, wire seconds.",
    _R + "ShapedLink.loss": "Loss, 0-1.",
    _R + "ShapedLink.queue_bytes": "Bottleneck queue, bytes.",
    _R + "Slo.ttft_s": "TTFT SLO, paper seconds.",
    _R + "Slo.tpot_s": "TPOT SLO, paper seconds.",
    _R + "TraceInfo.source": "The trace file, or the synthetic workload's description.",
    _R + "HoldInfo.url": "The router's URL as this host reaches it.",
    _R + "HoldInfo.base_url": "The OpenAI base URL (`url` + `/v1`).",
    _R + "HoldInfo.prefix": "The run's name prefix (for `testbed down --prefix`).",
    _R + "HoldInfo.ended": "Why the hold ended (stopped, or the deployment went away).",
    _R + "SimInfo.events": "Events the simulator processed.",
    _R + "SimInfo.rebalances": "Times the link model recomputed its fair shares.",
    _R + "SimInfo.wall_s": (
        "Wall seconds the simulation took: its event loop, not the writing of the run directory that follows."
    ),
    _R + "SimInfo.write_s": (
        "Of `wall_s`, the seconds spent writing records and time series in batches while the loop ran; "
        "`wall_s` less this is the engine's own time."
    ),
    _R + "SimInfo.simulated_s_paper": "Paper seconds simulated.",
    # -- records.csv ---------------------------------------------------------------------------
    _REC + "RequestRecord.request_id": "The client's id (`X-Request-Id`, `testbed.request_id`) or the router's.",
    _REC + "RequestRecord.trace_index": "Row of the trace it came from (-1: an outside client's request).",
    _REC + "RequestRecord.input_tokens": "Prompt tokens.",
    _REC + "RequestRecord.output_tokens": "Output tokens asked for.",
    _REC + "RequestRecord.prefill_cluster": "Cluster that ran the prefill.",
    _REC + "RequestRecord.prefill_node": "Instance that ran the prefill.",
    _REC + "RequestRecord.decode_node": "Instance that decoded.",
    _REC + "RequestRecord.decode_cluster": "Cluster that decoded.",
    _REC + "RequestRecord.tokens_received": "Tokens the client received.",
    _REC + "RequestRecord.reason": "Why it failed (empty when it completed).",
    _REC + "RequestRecord.cache_move_bytes_paper": "Paper bytes of the moved prefix.",
    _REC + "StageTimes.prefill_start": "The prefill's compute began.",
    _REC + "StageTimes.prefill_end": "The prefill's compute ended.",
    _REC + "StageTimes.decode_admitted": "The decode node admitted it into its batch.",
    _REC + "StageTimes.last_token": "The client saw the last token.",
    _REC + "StageTimes.decode_last_token": "The decode node produced the last token.",
}
