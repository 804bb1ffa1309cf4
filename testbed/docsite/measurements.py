"""The measurements the documentation quotes, one `Measurement(...)` each: what runs, on what, and
how its results file is rendered. `make docs-results` (`results.py`) runs them."""

from __future__ import annotations

import json
from collections.abc import Sequence

import yaml

from testbed.docsite.markdown import demote, table
from testbed.docsite.measurement import (
    Done,
    Measurement,
    Render,
    SummaryCell,
    both,
    cached_share,
    completed,
    halves,
    include,
    offload,
    queue_compute,
    roles,
    runs_table,
    stdout_of,
    tail_ms,
    tail_s,
    thresholds,
    tpot_ms,
    transcript,
    ttft_mean_p90,
    ttft_p99,
    validity,
    wan_bytes_per_request,
    wan_link,
)
from testbed.metrics.artefacts import Summary, read_artefact

# -- what the newer measurements share and how they are read ----------------------------------

AIC_MODELS = ("minimax-m2.5", "mimo-v2-flash", "qwen3.5-397b", "qwen3-235b")
FAULT_SCENARIOS = ("decode-kill", "prefill-kill", "wan-outage-resets")
SURROGATE_1H = "testbed trace synth --prefix-reuse chat --requests 12000 --rate 3.3333 --seed 1"
PEER_CHECK = (
    "testbed crosscheck --peer dynamo --scenario paper-homogeneous --set clusters.0.prefill=8 "
    "--set clusters.0.decode=4 --trace {work}/mooncake-chat-1h.jsonl"
)
# The testbed served and deployed as the mocker models it, against the mocker's own scheduler.
PEER_LIKE = (
    "--peer-scheduler native --peer-deployment peer --set 'model.layer_pattern=[full]' --set model.linear_state_bytes=0"
)
TIME_FORMAT = "'%e s wall, %U s user, %M KiB peak RSS, exit %x'"


def titled(title: str, part: Render) -> Render:
    """`part` under a heading of its own, its headings one level below it."""

    def render(d: Done) -> str:
        return f"### {title}\n\n{demote(part(d), 1)}"

    return render


def profile_fits(models: Sequence[str]) -> Render:
    """How closely each written profile follows aiconfigurator, from the `fit:` block it records."""

    def render(d: Done) -> str:
        rows = []
        for name in models:
            prov = yaml.safe_load((d.work / f"{name}.yaml").read_text())["hardware"]["h200"]["provenance"]
            fit = prov["fit"]
            rows.append(
                (
                    prov["model"],
                    str(fit["prefill_points"]),
                    _rel(fit["prefill_interpolation_max_rel_error"]),
                    f"{_rel(fit['cached_mean_rel_error'])} / {_rel(fit['cached_max_rel_error'])}",
                    f"{_rel(fit['decode_mean_rel_error'])} / {_rel(fit['decode_max_rel_error'])}",
                    f"{fit['decode_step_at_bs_max_s'] * 1e3:.2f}",
                )
            )
        return table(
            (
                "model",
                "prefill points",
                "prefill, worst off the points",
                "cached prefix, mean / max",
                "decode step, mean / max",
                "step at BS_max (ms)",
            ),
            rows,
        )

    return render


def _rel(x: float) -> str:
    return f"{x * 100:.2f}%"


def peer_variants(subdirs: Sequence[str]) -> Render:
    """The crosscheck's headline figures (testbed / mocker, their difference) for each setting of the peer."""

    def render(d: Done) -> str:
        rows = []
        labels: list[str] = []
        for sub in subdirs:
            by_key = {r["key"]: r for r in json.loads((d.work / sub / "peer-crosscheck.json").read_text())["rows"]}
            picked = [by_key[k] for k in PEER_KEYS if k in by_key]
            labels = [r["label"] for r in picked]
            rows.append(
                (
                    f"`{sub}`",
                    *[f"{r['cells']['testbed']} / {r['cells']['peer']} ({r['cells']['diff']})" for r in picked],
                )
            )
        return "### The peer's settings side by side (testbed / mocker)\n\n" + table(("peer setting", *labels), rows)

    return render


PEER_KEYS = ("ttft_mean", "ttft_p90", "itl_mean", "cache_hit", "prefill_queue", "prefill_compute")


def plan_tables(subdirs: Sequence[str]) -> Render:
    """Each plan's workload, first choices and predicted-against-simulated table, from its plan.md."""
    keep = ("Workload", "Best of each kind", "Chosen by simulation", "Simulation")

    def render(d: Done) -> str:
        return "\n\n".join(titled(f"`{sub}`", include(f"{sub}/plan.md", only=keep))(d) for sub in subdirs)

    return render


def million_run(stop_after_s: float = 30) -> Render:
    """The whole run and the stopped one: `/usr/bin/time`'s line of each (the last of its stderr),
    the simulator's own figures, how long the stop took after the signal, the whole run's directory
    and `testbed report` on it."""

    def render(d: Done) -> str:
        whole = read_artefact(d.work / "whole" / "summary.json", Summary)
        info = json.loads((d.work / "whole" / "run.json").read_text())
        stopped = json.loads((d.work / "stopped" / "run.json").read_text())
        kept = sum(1 for _ in (d.work / "stopped" / "records.csv").open()) - 1
        timed = [d.stderr[i].strip().splitlines()[-1] for i in (1, 2, 3)]
        stop_wall = float(timed[1].split(" s wall")[0])
        # The report's own files (report.md, its plots) came after.
        made = [
            f for f in (d.work / "whole").rglob("*") if f.is_file() and f.name != "report.md" and f.suffix != ".png"
        ]
        size = sum(f.stat().st_size for f in made)
        sim = info["sim"]
        rows = [
            ("requests completed / total", completed(whole)),
            (
                "events; simulated in (wall), of which writing",
                f"{sim.get('events', 0):,}; {sim['wall_s']:.1f} s, {sim.get('write_s', 0.0):.1f} s",
            ),
            ("the whole command (`/usr/bin/time`)", timed[0]),
            ("its run directory, before the report", f"{size / 1e6:.0f} MB"),
            ("`testbed report` on it (`/usr/bin/time`)", timed[2]),
            (f"stopped by SIGTERM {stop_after_s:g} s in (`/usr/bin/time`)", timed[1]),
            ("the stop: exit after the signal", f"{stop_wall - stop_after_s:.2f} s"),
            ("stopped run: run.json state; records kept", f"{stopped['state']}; {kept:,}"),
        ]
        return table(("", "paper-prfaas, a million requests over ten days"), rows)

    return render


PAPER3 = ("paper-homogeneous", "paper-prfaas", "paper-naive")
LABELS3 = ("homogeneous PD", "PrfaaS-PD", "naive heterogeneous")
COMPARE_ROWS: tuple[tuple[str, SummaryCell], ...] = (
    ("completed / total", completed),
    ("TTFT mean / P90 (s)", ttft_mean_p90),
    ("TTFT P99 (s)", ttft_p99),
    ("prefill queue / compute, mean (s)", queue_compute),
    ("KV transfer tail, mean (ms)", tail_ms),
    ("TPOT mean (ms)", tpot_ms),
    ("offload ratio", offload),
    ("WAN link mean / peak (counters)", wan_link),
    ("timing", validity),
)


def _three(sub: str) -> tuple[tuple[str, str], ...]:
    return tuple((label, f"{sub}/{sc}") for label, sc in zip(LABELS3, PAPER3))


# The routers study (#routers): each deployment's PD stacks on the one-hour chat surrogate's first
# ten minutes, emulated: the testbed's router with each node protocol, the real PD routers with
# their policies. Closed loop (each turn once its parent's answer arrived, then its think time), as
# chat users send: open loop, the window's follow-ups outrun their answers, lose their prefix hits
# and saturate every stack's prefill (TTFT ~60 s), which would compare queues, not routers.
ROUTER_STACKS: tuple[tuple[str, str, str], ...] = (
    ("testbed router, layer-wise push", "testbed-push", ""),
    ("testbed router, vLLM protocol", "testbed-vllm", "--set nodes.protocol=vllm"),
    ("testbed router, SGLang protocol", "testbed-sglang", "--set nodes.protocol=sglang"),
    ("vllm-router cache_aware", "vllm-cache", "--router vllm-router --router-policy cache_aware"),
    ("vllm-router power_of_two", "vllm-p2", "--router vllm-router --router-policy power_of_two"),
    ("vllm-router round_robin", "vllm-rr", "--router vllm-router --router-policy round_robin"),
    ("sglang-router cache_aware", "sglang-cache", "--router sglang-router --router-policy cache_aware"),
)
ROUTER_DEPLOYMENTS = (("PrfaaS-PD", "paper-prfaas"), ("homogeneous PD across regions", "pd-cross-region"))
ROUTER_ROWS: tuple[tuple[str, SummaryCell], ...] = (
    ("completed / total", completed),
    ("TTFT mean / P90 (s)", ttft_mean_p90),
    ("prefill queue / compute, mean (s)", queue_compute),
    ("KV transfer tail, mean (ms)", tail_ms),
    ("offload ratio", offload),
    ("WAN KV per offloaded request", wan_bytes_per_request),
    ("WAN link mean / peak (counters)", wan_link),
    ("cached prompt share", cached_share),
    ("timing", validity),
)


def routers_steps() -> tuple[str, ...]:
    steps = [f"{SURROGATE_1H} --format mooncake --out {{work}}/chat-1h.jsonl"]
    for _, scenario in ROUTER_DEPLOYMENTS:
        for _, stem, flags in ROUTER_STACKS:
            cmd = (
                f"testbed replay --scenario {scenario} --backend netns --trace {{work}}/chat-1h.jsonl "
                f"--window :10m --arrivals closed {flags} --out {{work}}/{scenario}/{stem} --accept-invalid"
            )
            steps.append(cmd.replace("  ", " "))
    return tuple(steps)


def routers_render() -> Render:
    def render(d: Done) -> str:
        parts = []
        for label, scenario in ROUTER_DEPLOYMENTS:
            runs = tuple((name, f"{scenario}/{stem}") for name, stem, _ in ROUTER_STACKS)
            parts.append(f"### {label} (`{scenario}`)\n\n" + runs_table(runs, ROUTER_ROWS)(d))
        return "\n\n".join(parts)

    return render


PAPER_TABLE = "--probes 6 --requests 300 --ttft-slo 30 --wait-growth 2.5 --set workload.seed=45"
CACHE_SET = "--trace traces/samples/mooncake-agent-sample.jsonl --set links.inter_dc=cross-region-15g-measured"
BW_SET = "--set links.inter_dc=cross-region-100g-fluctuating --rate 2.2 --requests 400 --set workload.seed=45"

MEASUREMENTS: tuple[Measurement, ...] = (
    Measurement(
        "replay",
        "make replay: the three paper deployments, emulated",
        "The paper's three deployments (Table 6) on one seeded workload (240 requests of the paper's "
        "synthetic workload at 1.6 req/s, seed 7) over the 100 Gbit/s cross-region link, speedup 4, "
        "byte_scale 256; paper units.",
        "netns",
        ("make replay RUNS={work}",),
        runs_table(_three("paper-compare"), COMPARE_ROWS),
        figures=(("paper-compare/ttft_cdf.png", "replay-ttft-cdf.png"),),
        needs_root=True,
    ),
    Measurement(
        "replay-sim",
        "make replay-sim: the same comparison, simulated",
        "make replay's workload and deployments on the discrete-event simulator.",
        "sim",
        ("make replay-sim RUNS={work}",),
        runs_table(_three("paper-compare-sim"), COMPARE_ROWS),
    ),
    Measurement(
        "crosscheck",
        "Model, simulation and emulation side by side",
        "`testbed crosscheck` on make replay's recorded emulation: the simulator's figures against the "
        "emulated ones, each difference against its tolerance, and the model's figure where it has one.",
        "sim",
        (
            "testbed crosscheck --scenario paper-homogeneous --scenario paper-prfaas --scenario paper-naive "
            "--emulated {results}/replay/paper-compare --out {work}",
        ),
        include("crosscheck.md"),
        reads=("replay",),
    ),
    Measurement(
        "model",
        "The analytical model (Table 6)",
        "The paper's analytical model and optimiser on its three deployments.",
        "model",
        ("testbed model --scenario paper-prfaas --scenario paper-homogeneous --scenario paper-naive --optimise",),
        stdout_of(),
    ),
    Measurement(
        "model-bandwidth",
        "KV bandwidth of the paper's six models (Table 3, section 2.3)",
        "Phi_kv per instance and cluster egress from the model profiles, against the paper's figures.",
        "model",
        ("testbed model --bandwidth",),
        stdout_of(),
    ),
    Measurement(
        "table6-sim",
        "Table 6 by simulation: Lambda_max of the three deployments",
        "The capacity search of make replay-paper (6 probes of 300 requests, seed 45, TTFT SLO 30 s, wait "
        "growth at most 2.5 s) with every probe simulated.",
        "sim",
        ("make replay-paper-sim RUNS={work}",),
        include("paper-table-sim/table6.md"),
    ),
    Measurement(
        "table6",
        "Table 6 by emulation: Lambda_max of the three deployments",
        "make replay-paper: the capacity search on the netns backend over the 100 Gbit/s cross-region link.",
        "netns",
        ("make replay-paper RUNS={work}",),
        include("paper-table/table6.md"),
        needs_root=True,
    ),
    Measurement(
        "threshold-sweep-sim",
        "Lambda_max over the threshold, simulated",
        "A capacity search at each threshold t (4 probes of 300 requests, seed 45) against the model's "
        "Lambda_max(t): the shape of the paper's Fig. 5b.",
        "sim",
        (
            "testbed sweep --scenario paper-prfaas --param policy.threshold=10000,15000,19400,25000,32000 "
            "--capacity-probes 4 --requests 300 --set workload.seed=45 --backend sim --out {work}",
        ),
        include("sweep.md"),
    ),
    Measurement(
        "cache-aware-sim",
        "Cache-aware against length-only routing, simulated",
        "The agent sample (Mooncake format, 400 long-context agent requests with prefix reuse) on "
        "paper-prfaas and paper-prfaas-cache over the measured 14.7 Gbit/s cross-cloud profile.",
        "sim",
        (
            f"testbed replay --compare paper-prfaas paper-prfaas-cache {CACHE_SET} "
            "--backend sim --report --out {work}",
        ),
        runs_table(
            (("length-only", "paper-prfaas"), ("cache-aware", "paper-prfaas-cache")),
            (
                ("TTFT mean / P90 (s)", ttft_mean_p90),
                ("TTFT P99 (s)", ttft_p99),
                ("prefill queue / compute, mean (s)", queue_compute),
                ("KV transfer tail, mean (s)", tail_s),
                ("offloaded to PrfaaS", offload),
                ("WAN bytes per request (KV + cache moves)", wan_bytes_per_request),
                ("prompt tokens served from cache", cached_share),
            ),
        ),
    ),
    Measurement(
        "load-aware-sim",
        "Load-aware cache routing, simulated",
        "make replay-load-aware: the first 10 minutes of a one-hour Mooncake-format surrogate of a "
        "conversation trace on length-only, the paper's cache rules and load-aware routing.",
        "sim",
        ("make replay-load-aware RUNS={work}",),
        runs_table(
            (
                ("length-only", "load-aware/paper-prfaas"),
                ("paper cache rules", "load-aware/paper-prfaas-cache"),
                ("load-aware", "load-aware/paper-prfaas-load-aware"),
            ),
            (
                ("completed / total", completed),
                ("TTFT mean / P90 (s)", ttft_mean_p90),
                ("offloaded to PrfaaS", offload),
                ("WAN bytes per request", wan_bytes_per_request),
                ("prompt tokens served from cache", cached_share),
            ),
        ),
    ),
    Measurement(
        "bandwidth-aware-sim",
        "Bandwidth-aware against fixed-threshold routing, simulated",
        "The paper workload at 2.2 req/s (400 requests, seed 45) on paper-prfaas and paper-prfaas-bw while "
        "the WAN drops to 10% for a minute, then to half, then recovers (cross-region-100g-fluctuating).",
        "sim",
        (f"testbed replay --compare paper-prfaas paper-prfaas-bw {BW_SET} --backend sim --report --out {{work}}",),
        both(
            runs_table(
                (("fixed threshold", "paper-prfaas"), ("bandwidth-aware", "paper-prfaas-bw")),
                (
                    ("TTFT mean / P90 (s)", ttft_mean_p90),
                    ("TTFT P99 (s)", ttft_p99),
                    ("KV transfer tail, mean (s)", tail_s),
                    ("offloaded", offload),
                    ("threshold changes; time-weighted mean t", thresholds),
                ),
            ),
            include("comparison.md", drop=("Verdict", "Side by side", "TTFT CDF", "Runs")),
        ),
    ),
    Measurement(
        "longterm-sim",
        "The long-term loop, simulated",
        "make replay-longterm: the first 10 minutes of a one-hour conversation trace at its own rate on the "
        "paper's static configuration, on the same with both loops on, and on what `testbed plan` makes of "
        "the trace.",
        "sim",
        ("make replay-longterm RUNS={work}",),
        both(
            runs_table(
                (
                    ("static (paper-prfaas)", "longterm/compare/paper-prfaas"),
                    ("both loops (paper-prfaas-adaptive)", "longterm/compare/paper-prfaas-adaptive"),
                    ("planned", "longterm/compare/plan-prfaas-1"),
                ),
                (
                    ("TTFT mean, first / last half of arrivals (s)", halves),
                    ("TTFT mean / P90 (s)", ttft_mean_p90),
                    ("TTFT P99 (s)", ttft_p99),
                    ("offloaded", offload),
                    ("threshold changes; time-weighted mean t", thresholds),
                    ("role conversions: PD split", roles),
                ),
            ),
            include("longterm/plan/plan.md", drop=("The base scenarios", "Ranking", "How the figures")),
        ),
    ),
    Measurement(
        "bench-sim",
        "The simulator's speed and scale",
        "make bench-sim: a one-hour Mooncake-format trace on paper-prfaas, and a 10,000-GPU deployment under "
        "15 minutes of the paper's workload at 80% of its model Lambda_max.",
        "sim",
        ("make bench-sim RUNS={work}",),
        stdout_of(),
    ),
    Measurement(
        "fidelity",
        "Timing fidelity of the emulator",
        "make bench: 40 requests at 0.3 req/s (no queueing), measured against modelled timings.",
        "netns",
        ("testbed bench fidelity --scenario paper-prfaas --out {work}",),
        stdout_of(),
        needs_root=True,
    ),
    Measurement(
        "linkcheck",
        "What shaped links deliver against their profiles",
        "make linkcheck: one shaped link per profile between two namespaces, scaled to 1 Gbit/s on the wire "
        "(speedup 1): RTT, goodput on several connections and on one, a window-limited connection, loss, and how "
        "fast throughput follows a rate change.",
        "netns",
        ("make linkcheck",),
        stdout_of(),
        needs_root=True,
    ),
    Measurement(
        "feasibility",
        "Which model can cross which link (the feasibility map)",
        "make models: PrfaaS-PD against homogeneous PD for every model profile x link rate x RTT, by the model "
        "and by simulation.",
        "sim",
        ("testbed feasibility --ttft-slo 30 --out {work}",),
        include("report.md"),
        figures=(("map.png", "feasibility-map.png"),),
    ),
    Measurement(
        "profiles",
        "Measured-kernel profiles from aiconfigurator",
        "`testbed profile --aiconfigurator` for the four models aiconfigurator knows (h200_sxm, SGLang, TP 8 with "
        "EP 8): what one prints, how closely each written file follows its source (its `fit:` block), and the "
        "database's refusals.",
        "profile",
        (
            *(f"testbed profile --aiconfigurator {m} --out {{work}}/{m}.yaml" for m in AIC_MODELS),
            "! testbed profile --aiconfigurator minimax-m2.5 --moe-tp 8 --ep 1 --out {work}/refused.yaml",
            "! testbed profile --aiconfigurator deepseek-ai/DeepSeek-V3 --kv-from minimax-m2.5 "
            "--kv-cache-quant fp8 --out {work}/refused.yaml",
            "! testbed profile --aiconfigurator minimax-m2.5 --system h20 --out {work}/refused.yaml",
        ),
        both(transcript(0), profile_fits(AIC_MODELS), transcript(4, 5, 6)),
        extra="profiles:aiconfigurator_core",
    ),
    Measurement(
        "feasibility-sources",
        "Paper-derived against measured-kernel profiles, by the model",
        "`testbed feasibility` by the analytical model alone: each model's feasibility under each profile source "
        "side by side.",
        "model",
        ("testbed feasibility --sim none --out {work}",),
        include("report.md", only=("Profile sources",)),
    ),
    Measurement(
        "feasibility-aic-sim",
        "The measured-kernel map, simulated",
        "`testbed feasibility` with the aiconfigurator profiles simulated: MiniMax-M2.5 (dense) and Qwen3.5-397B "
        "(hybrid) at 100 Gbit/s and 30 ms RTT, gain over homogeneous PD by the model and by simulation.",
        "sim",
        (
            "testbed feasibility --ttft-slo 30 --source aiconfigurator --model minimax-m2.5 --model qwen3.5-397b "
            "--rates 100 --rtts 30 --no-break-even --out {work}",
        ),
        include("report.md", only=("Headline",)),
    ),
    Measurement(
        "crosscheck-dynamo",
        "The simulator beside Dynamo's mocker",
        "`testbed crosscheck --peer dynamo` on the one-hour Mooncake-format conversation surrogate (12,000 "
        "requests), paper-homogeneous at 8 prefill / 4 decode instances, the same timing tables; then the same "
        "with the mocker's router crediting no cached blocks (`--peer-router load`) and with its own scheduler "
        "(`--peer-scheduler native`); last, the model served as the mocker models it (full attention alone) and "
        "deployed as the mocker is (`--peer-deployment peer`) against its own scheduler, with the testbed's FCFS "
        "scheduler (`native-peer-fcfs`) and its vLLM-like one (`native-peer-vllm`).",
        "sim",
        (
            f"{SURROGATE_1H} --format mooncake --out {{work}}/mooncake-chat-1h.jsonl",
            f"{PEER_CHECK} --out {{work}}/matched",
            f"{PEER_CHECK} --peer-router load --out {{work}}/load",
            f"{PEER_CHECK} --peer-scheduler native --out {{work}}/native",
            f"{PEER_CHECK} {PEER_LIKE} --out {{work}}/native-peer-fcfs",
            f"{PEER_CHECK} {PEER_LIKE} --set hardware.h20.scheduler.kind=vllm --out {{work}}/native-peer-vllm",
        ),
        both(
            include("matched/peer-crosscheck.md"),
            peer_variants(("matched", "load", "native", "native-peer-fcfs", "native-peer-vllm")),
            titled(
                "Deployed as the mocker, with the vLLM-like scheduler", include("native-peer-vllm/peer-crosscheck.md")
            ),
        ),
        extra="peer:dynamo",
    ),
    Measurement(
        "bench-peers",
        "The whole job raced against Dynamo's mocker",
        "make bench-peers: the testbed's `replay --backend sim` process and the mocker's offline replay on the same "
        "one-hour surrogate and worker counts (8P/4D; 80P/40D at 10x the rate), each run its own process pinned to "
        "one CPU, interleaved; medians.",
        "sim",
        ("testbed bench peers --out {work}",),
        stdout_of(),
        extra="peer:dynamo",
    ),
    Measurement(
        "plan-refine",
        "Plans by the model, checked by the simulator",
        "make plan-refine: two one-hour conversation surrogates that differ only in their arrivals (inter-arrival CV "
        "1 and 3), `testbed plan --refine 5` on each: each kind's first choice with its predicted and simulated "
        "mean TTFT, and every row's verdict.",
        "sim",
        ("make plan-refine PLAN_REFINE={work}",),
        plan_tables(("cv1", "cv3")),
        figures=(("cv1/plan.png", "plan-refine-cv1.png"), ("cv3/plan.png", "plan-refine-cv3.png")),
    ),
    Measurement(
        "bench-sim-faults",
        "Faults at 10,000 GPUs, simulated",
        "make bench-sim-faults: the 10,000-GPU deployment of make bench-sim under 15 minutes of the paper's "
        "workload at 80% of its model Lambda_max, a 60 s WAN outage at 5 minutes and a rack of 8 decode instances "
        "lost at 9 minutes, with the fixed threshold and with the short-term bandwidth loop.",
        "sim",
        ("testbed bench sim-faults --out {work}",),
        stdout_of(),
    ),
    Measurement(
        "sim-faults-crosscheck",
        "Fault scenarios: simulation against emulation",
        "The three shipped fault scenarios emulated on the netns backend (240 requests at 1.6 req/s, speedup 4), "
        "the live path probed on the same host, and `testbed crosscheck` of each against the simulator given "
        "those live-path figures.",
        "netns",
        (
            "testbed bench live-path --backend netns --no-save --out {work}/probe",
            *(
                f"testbed crosscheck --scenario scenarios/faults/{f}.yaml --backend netns "
                f"--set sim.live_path={{work}}/probe/live-path.json --out {{work}}/{f}"
                for f in FAULT_SCENARIOS
            ),
        ),
        both(stdout_of(0), *(titled(f, include(f"{f}/crosscheck.md")) for f in FAULT_SCENARIOS)),
        needs_root=True,
    ),
    Measurement(
        "bursty-crosscheck",
        "A planned PrfaaS-PD and a homogeneous PD on a bursty trace: simulation against emulation",
        "The first choices of make plan-refine on its inter-arrival-CV-3 surrogate (PrfaaS-PD and homogeneous PD): "
        "each deployment's live path probed on itself at speedup 2 on the trace's 20-25 min window, then the first "
        "10 minutes crosschecked on the netns backend at speedup 2 against the simulator given those figures.",
        "netns",
        tuple(
            step
            for kind in ("prfaas", "homogeneous")
            for step in (
                f"testbed bench live-path --backend netns --scenario {{results}}/plan-refine/cv3/plan-{kind}-1.yaml "
                f"--trace {{results}}/plan-refine/chat-cv3.jsonl --window 20m:25m --set scale.speedup=2 --no-save "
                f"--out {{work}}/probe-{kind}",
                f"testbed crosscheck --scenario {{results}}/plan-refine/cv3/plan-{kind}-1.yaml --trace "
                f"{{results}}/plan-refine/chat-cv3.jsonl --window :10m --speedup 2 --backend netns "
                f"--set sim.live_path={{work}}/probe-{kind}/live-path.json --out {{work}}/{kind}",
            )
        ),
        both(
            stdout_of(0),
            titled("PrfaaS-PD", include("prfaas/crosscheck.md")),
            stdout_of(2),
            titled("homogeneous PD", include("homogeneous/crosscheck.md")),
        ),
        needs_root=True,
        reads=("plan-refine",),
    ),
    Measurement(
        "routers",
        "PD stacks across datacenters: the testbed's router and the real PD routers",
        "The one-hour chat surrogate's first 10 minutes (2,022 requests), closed loop (each turn once its "
        "parent's answer arrived, then its think time), on PrfaaS-PD and on homogeneous PD "
        "with its prefill in the other region, over cross-region-100g, netns, speedup 4: the testbed's router "
        "with layer-wise push and with vLLM's and SGLang's PD protocols, vllm-router with cache_aware, "
        "power_of_two and round_robin, sglang-router with cache_aware; records from the nodes' own logs.",
        "netns",
        routers_steps(),
        routers_render(),
        needs_root=True,
        extra="routers:vllm_router",
    ),
    Measurement(
        "sim-1m",
        "A million requests over ten days, simulated, and stopped",
        "A 1,000,000-request trace of the paper's workload spanning 10 days replayed on paper-prfaas by the "
        "simulator under `/usr/bin/time`, then the same run sent SIGTERM 30 s in, and `testbed report` on the "
        "whole run.",
        "sim",
        (
            "testbed trace synth --requests 1000000 --rate 1.1574074 --seed 7 --out {work}/trace-1m.jsonl",
            f"/usr/bin/time -f {TIME_FORMAT} testbed replay --backend sim --scenario paper-prfaas "
            "--trace {work}/trace-1m.jsonl --out {work}/whole",
            f"! /usr/bin/time -f {TIME_FORMAT} timeout --preserve-status -s TERM 30 testbed replay --backend sim "
            "--scenario paper-prfaas --trace {work}/trace-1m.jsonl --out {work}/stopped",
            f"/usr/bin/time -f {TIME_FORMAT} testbed report {{work}}/whole",
        ),
        million_run(),
    ),
)
