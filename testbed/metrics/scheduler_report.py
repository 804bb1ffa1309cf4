"""The report's account of what a batching scheduler did: the prefill passes (run.json's
`sim.prefill_passes`, `testbed.core.engine.prefill_batch`) and the decode preemptions by recompute
(`preemptions.csv`, `testbed.core.engine.decode_blocks`). Nothing under FCFS, which batches no
prefill and never preempts."""

from __future__ import annotations

import math
from pathlib import Path

from testbed.core.schema.scaling import Scale
from testbed.metrics.artefacts import RunInfo
from testbed.metrics.preemptions import PREEMPTIONS_CSV, read_preemptions
from testbed.metrics.report_format import fmt


def scheduler_rows(run_dir: Path, run: RunInfo, scale: Scale) -> list[tuple[str, str]]:
    """(measure, value) rows; empty when no instance batched and nothing was preempted."""
    rows: list[tuple[str, str]] = []
    passes = run.sim.prefill_passes if run.sim is not None else None
    if passes is not None:
        rows += [
            ("Batching prefill instances", str(passes.instances)),
            ("Forward passes", f"{passes.passes:,}"),
            ("Prompts completed in them", f"{passes.prompts:,}"),
            ("Uncached tokens per pass, mean (max)", f"{passes.tokens_per_pass:,.0f} ({passes.max_tokens:,})"),
            ("Prompts per pass, mean (max)", f"{fmt(passes.prompts_per_pass)} ({passes.max_prompts})"),
            ("Passes per prompt (chunks), mean", fmt(passes.chunks_per_prompt)),
            ("Time in passes, all instances (paper s)", f"{passes.busy_s_paper:,.1f}"),
            (
                "Time per pass, mean (paper ms)",
                f"{passes.busy_s_paper / passes.passes * 1e3:,.1f}" if passes.passes else "-",
            ),
        ]
    path = run_dir / PREEMPTIONS_CSV
    if path.exists():
        pre = read_preemptions(path)
        waited = [p.waited_s for p in pre if math.isfinite(p.waited_s)]
        rows += [
            ("Decode preemptions (by recompute)", f"{len(pre):,} of {len({p.request_id for p in pre}):,} requests"),
            (
                "Time preempted, mean / total (paper s)",
                f"{scale.paper_seconds(sum(waited) / len(waited)):.3f} / {scale.paper_seconds(sum(waited)):,.1f}"
                if waited
                else "-",
            ),
            ("Recompute carried, total (paper s)", f"{scale.paper_seconds(sum(p.recompute_s for p in pre)):,.2f}"),
            ("Preempted and not run again by the end", str(len(pre) - len(waited))),
        ]
    return rows
