"""`run.json`: what a run was (scenario, scale, shaping, SLOs, trace) and when it ran.

Written by `testbed.run.runner` (and `hold`) when the run directory is made, again when the
services are up (`shaping`, `t0`) and when it ends or is interrupted (`t_end`, `interrupted`).

Schema versions:
- 1: no `schema_version` key (files written before the models); read by the same model.
- 2: `schema_version` added; every other key and value as in version 1.
- 3: `state`, `pid` and `host`: the file is written at the start with state `running` and the
  pid and host of the process running it, and ends `finished`, `interrupted` or `failed`. A run
  whose process died without closing it (`kill -9`, a crash, a power cut) keeps `running`, so a
  reader sees that it was cut short. Older files have no `state` (None).
"""

from __future__ import annotations

import os
import socket
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field

from testbed.core.json_types import JSONObject
from testbed.metrics.artefacts.io import Artefact, Section

RUN_VERSION = 3

RunState = Literal["running", "finished", "interrupted", "failed"]


class ScaleInfo(Section):
    # Required and finite: guessing 1/1 would print wire figures as paper figures.
    speedup: float = Field(gt=0, allow_inf_nan=False)  # wire time = paper time / speedup
    byte_scale: float = Field(gt=0, allow_inf_nan=False)  # wire KV bytes = paper bytes / byte_scale


class ShapedLink(Section):
    """One shaped direction (`src->dst`), wire units unless named `_paper`."""

    # Each backend records what its shaper has (a flow model has no queue, tc has a burst...).
    model_config = ConfigDict(extra="allow")

    rate_bps_wire: float | None = None
    delay_s_wire: float | None = None
    loss: float = 0.0
    queue_bytes: int | None = None


class Shaping(Section):
    """How the WAN was shaped. Backends add their own facts (namespace prefix, TCP settings,
    link schedule, container names): those stay free-form, as each backend owns its part."""

    model_config = ConfigDict(extra="allow")

    method: str = "unknown"
    profile: str | None = None
    mtu: int | None = None
    links: dict[str, ShapedLink] = Field(default_factory=dict)
    detail: str | None = None


class Slo(Section):
    ttft_s: float | None = None
    tpot_s: float | None = None


class TraceInfo(Section):
    source: str
    requests: int | None = None  # None: outside clients (`testbed up --hold`)
    arrivals: Literal["open", "closed"] | None = None  # how it was sent; None: written before sessions


class HoldInfo(Section):
    url: str | None = None
    base_url: str | None = None
    prefix: str | None = None
    ended: str | None = None


class PrefillPasses(Section):
    """What the batching prefill instances' scheduler did (`testbed.core.engine.prefill_batch`),
    over all of them; absent when every instance runs one whole prompt a pass (fcfs)."""

    instances: int  # prefill instances with a batching scheduler
    passes: int  # forward passes they ran
    prompts: int  # prompts whose last chunk was computed
    tokens_per_pass: float  # uncached tokens, mean
    prompts_per_pass: float  # chunks a pass, mean
    chunks_per_prompt: float  # passes a prompt took part in, mean
    busy_s_paper: float  # modelled time in passes, all instances
    max_tokens: int  # in one pass
    max_prompts: int  # in one pass


class SimInfo(Section):
    events: int
    rebalances: int
    wall_s: float
    simulated_s_paper: float
    write_s: float | None = None  # of wall_s, writing records and series as the loop ran
    retries: int | None = None  # attempts routed again after a failed one
    live_path: dict[str, object] | None = None  # what the simulator added for the live path (wire s)
    mechanisms: str | None = None  # "native" (compiled twins) or "python" (testbed.core.native)
    modules: str | None = None  # the hot modules: "compiled" or "python", "python (stale build)" (testbed.compiled)
    prefill_passes: PrefillPasses | None = None
    preemptions: int | None = None  # decode preemptions by recompute (preemptions.csv lists them)


class RunInfo(Artefact):
    """`run.json`. Optional fields hold what hand-made or older files may leave out; the
    summary reads names back from the directory when they are absent."""

    VERSION: ClassVar[int] = RUN_VERSION

    schema_version: int = RUN_VERSION
    name: str | None = None
    scenario: str = ""
    policy: str = ""
    backend: str | None = None
    t0: float | None = None  # None: stopped before anything was sent (no time base)
    t_end: float | None = None
    scale: ScaleInfo
    shaping: Shaping = Field(default_factory=Shaping)
    slo: Slo | None = Field(default_factory=Slo)  # null: no SLOs (goodput is not judged)
    offered_rate: float | None = None
    trace: TraceInfo | None = None
    threshold: float | None = None
    versions: dict[str, str] = Field(default_factory=dict)
    interrupted: bool = False
    state: RunState | None = None  # None: written before version 3
    pid: int | None = None  # the process that ran it, and where: a `running` file whose
    host: str | None = None  # process is gone was cut short
    hold: HoldInfo | None = None
    sim: SimInfo | None = None


def run_info(**fields: Any) -> RunInfo:
    """A RunInfo whose every given field counts as set (so it is written), `schema_version` first."""
    return RunInfo.model_validate({"schema_version": RUN_VERSION, **fields})


def this_process() -> JSONObject:
    """The `pid` and `host` fields of a run this process runs."""
    return {"pid": os.getpid(), "host": socket.gethostname()}


def was_cut_short(info: RunInfo) -> bool:
    """`run.json` still says `running`, and its process is gone: it died without closing the run.
    On another host, or without a pid, there is no telling whether it still runs; a `running`
    file is then taken as cut short only when no pid was recorded at all."""
    if info.state != "running":
        return False
    if info.pid is None:
        return True
    if info.host is not None and info.host != socket.gethostname():
        return False
    try:
        os.kill(info.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False
