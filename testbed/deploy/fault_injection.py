"""Executing a scenario's fault timeline against a running deployment; `faults.jsonl`.

A backend builds a `FaultTarget` (what it can do: node faults, link faults, connection resets)
and starts a `FaultScheduler` in its `on_t0`. Each fault runs as a task of its own at
t0 + at_s / speedup (wire), so an action that takes time (a restart waiting for health) never
delays another. What a backend cannot do is recorded as `unsupported`, not silently skipped.

Every step executed goes to `faults.jsonl` in the run directory, one JSON object a line:
    {"t": paper s after t0 when it took effect (when it was executed; a restart's end: when the
     instance answers /health again; a reset window: when sniffing began and ended),
     "t_wire": the same in wire s, "fault": index in the scenario,
     "kind", "phase": "start" | "end", "target", "at_s": scheduled (paper),
     "detail": {...}, "outcome": "ok" | "failed: ..." | "unsupported: ..." | "skipped: ..."}
A fault the run ended before reaching is written as skipped; one cut short by the end of the
run gets an "end" line saying so (a paused node is resumed first, so it can stop cleanly).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from testbed.core.fault_timeline import FaultEvent, Phase, fault_scope, fault_timeline
from testbed.core.json_types import JSONObject
from testbed.core.schema.kinds import unknown_kind
from testbed.core.schema.scenario import (
    KillFault,
    OutageFault,
    PartitionFault,
    PauseFault,
    RateDropFault,
    RestartFault,
    Scenario,
    SlowFault,
    TcpResetFault,
)
from testbed.live.clock import now, sleep_until
from testbed.metrics.fault_effects import FaultLogFile
from testbed.net.procs import ProcessGroup, log_tail, start_reporting_child
from testbed.net.rst import injector_argv

log = logging.getLogger("testbed.faults")
HEALTH_TIMEOUT_S = 60.0
KILL_WAIT_S = 10.0


class FaultUnsupported(Exception):
    """The backend cannot execute this kind of fault."""


class NodeControl(Protocol):
    """Faults of one node instance; each returns facts for the log's `detail`."""

    async def kill(self, node: str) -> JSONObject: ...
    async def pause(self, node: str) -> JSONObject: ...
    async def resume(self, node: str) -> JSONObject: ...
    async def start(self, node: str) -> JSONObject:
        """Start a killed instance again; returns once it answers /health."""
        ...

    async def slow(self, node: str, factor: float, until: float | None) -> JSONObject: ...


class LinkFaults(Protocol):
    async def set_link_faults(self, active: list[FaultEvent]) -> JSONObject:
        """Shape every WAN direction with the link faults `active` in force (and no others)."""
        ...


class ResetInjection(Protocol):
    async def inject(
        self, spec: TcpResetFault, start: float, end: float, on_open: Callable[[JSONObject], None]
    ) -> JSONObject:
        """Reset KV connections crossing the WAN between unix times `start` and `end`; calls
        `on_open` when sniffing begins; returns the injector's summary at the end."""
        ...


@dataclass
class FaultTarget:
    backend: str
    nodes: NodeControl | None = None
    links: LinkFaults | None = None
    resets: ResetInjection | None = None


def _outcome(e: BaseException) -> str:
    if isinstance(e, FaultUnsupported):
        return f"unsupported: {e}"
    return f"failed: {type(e).__name__}: {e}"


class FaultLog:
    """`faults.jsonl` (`testbed.metrics.fault_effects.FaultLogFile`) on the wall clock, from t0."""

    def __init__(self, path: Path, t0: float, speedup: float) -> None:
        self.path = path
        self.t0 = t0
        self.speedup = speedup
        self._file = FaultLogFile(path, speedup)

    def write(
        self, ev: FaultEvent, phase: Phase, outcome: str, detail: JSONObject | None = None, t: float | None = None
    ) -> None:
        line = self._file.write(ev, phase, outcome, detail, (now() if t is None else t) - self.t0)
        level = logging.INFO if outcome == "ok" else logging.WARNING
        log.log(
            level, "fault %d %s %s %s at %.2f s (paper): %s", ev.index, ev.kind, phase, ev.target, line["t"], outcome
        )

    def close(self) -> None:
        self._file.close()


class FaultScheduler:
    def __init__(
        self, timeline: Sequence[FaultEvent], target: FaultTarget, t0: float, speedup: float, log_path: Path
    ) -> None:
        for ev in timeline:
            fault_scope(ev.spec)  # refuses a kind no step handles before any fault runs
        self.timeline = list(timeline)
        self.target = target
        self.t0 = t0
        self.speedup = speedup
        self.log = FaultLog(log_path, t0, speedup)
        self._tasks: list[asyncio.Task[None]] = []
        self._phase: dict[int, Phase] = {}  # the last phase each fault reached
        self._active_links: list[FaultEvent] = []
        self._links_lock = asyncio.Lock()

    def wall(self, paper_s: float) -> float:
        return self.t0 + paper_s / self.speedup

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(ev), name=f"fault-{ev.index}") for ev in self.timeline]

    async def wait(self) -> None:
        """Until every fault has run its course (for tests and short runs)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def stop(self) -> None:
        """Cancel what has not happened, resume paused nodes, and log both."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for ev in self.timeline:
            phase = self._phase.get(ev.index)
            if phase is None:
                self.log.write(ev, "start", "skipped: the run ended first")
            elif phase == "start" and ev.end_s is not None:
                detail: JSONObject = {"cut_short": True}
                if isinstance(ev.spec, PauseFault) and self.target.nodes is not None:
                    try:
                        detail.update(await self.target.nodes.resume(ev.node or ""))
                    except Exception as e:
                        detail["resume"] = _outcome(e)
                self.log.write(ev, "end", "skipped: the run ended first", detail)
        self.log.close()

    async def _run(self, ev: FaultEvent) -> None:
        if isinstance(ev.spec, TcpResetFault):
            await self._reset(ev, ev.spec)
            return
        await sleep_until(self.wall(ev.start_s))
        await self._step(ev, "start")
        if ev.end_s is not None:
            await sleep_until(self.wall(ev.end_s))
            await self._step(ev, "end")

    async def _step(self, ev: FaultEvent, phase: Phase) -> None:
        t = now()
        try:
            detail = await self._act(ev, phase)
            outcome = "ok"
        except asyncio.CancelledError:
            raise
        except Exception as e:
            detail, outcome = {}, _outcome(e)
        detail["took_s_wire"] = round(now() - t, 6)
        self._phase[ev.index] = phase
        up_again = isinstance(ev.spec, RestartFault) and phase == "end"
        self.log.write(ev, phase, outcome, detail, None if up_again else t)

    async def _act(self, ev: FaultEvent, phase: Phase) -> JSONObject:
        spec = ev.spec
        match spec:
            case OutageFault() | RateDropFault() | PartitionFault():
                return await self._links(ev, phase)
            case KillFault() | PauseFault() | RestartFault() | SlowFault():
                return await self._node(ev.node or "", spec, phase)
            case TcpResetFault():
                raise AssertionError("a tcp_reset runs as a window of its own (_reset), not in steps")
            case _:
                unknown_kind("fault kind", spec)

    async def _links(self, ev: FaultEvent, phase: Phase) -> JSONObject:
        if self.target.links is None:
            raise FaultUnsupported(f"the {self.target.backend} backend shapes no WAN link")
        async with self._links_lock:
            if phase == "start":
                self._active_links.append(ev)
            else:
                self._active_links = [e for e in self._active_links if e is not ev]
            return await self.target.links.set_link_faults(list(self._active_links))

    async def _node(
        self, node: str, spec: KillFault | PauseFault | RestartFault | SlowFault, phase: Phase
    ) -> JSONObject:
        nodes = self.target.nodes
        if nodes is None:
            raise FaultUnsupported(f"the {self.target.backend} backend cannot act on node processes")
        match spec:
            case KillFault():
                return await nodes.kill(node)
            case PauseFault():
                return await (nodes.pause(node) if phase == "start" else nodes.resume(node))
            case SlowFault():
                if phase == "start":
                    # The node clears the factor by itself at the end, even if this process stalls.
                    return await nodes.slow(node, spec.factor, self.wall(spec.at_s + spec.duration_s))
                return await nodes.slow(node, 1.0, None)
            case RestartFault():
                return await (nodes.kill(node) if phase == "start" else nodes.start(node))
            case _:
                unknown_kind("fault kind", spec)

    async def _reset(self, ev: FaultEvent, spec: TcpResetFault) -> None:
        assert ev.end_s is not None
        if self.target.resets is None:
            await sleep_until(self.wall(ev.start_s))
            self._phase[ev.index] = "end"
            self.log.write(ev, "start", f"unsupported: the {self.target.backend} backend cannot inject TCP resets")
            return

        def opened(info: JSONObject) -> None:
            self._phase[ev.index] = "start"
            t = info.get("t")
            self.log.write(
                ev,
                "start",
                "ok",
                {k: v for k, v in info.items() if k not in ("event", "t")},
                t if isinstance(t, (int, float)) else None,
            )

        # Started now, not at the window: the injector needs a moment (scapy's import) to be ready.
        try:
            result = await self.target.resets.inject(spec, self.wall(ev.start_s), self.wall(ev.end_s), opened)
            outcome = "ok"
        except asyncio.CancelledError:
            raise
        except Exception as e:
            result, outcome = {}, _outcome(e)
        if ev.index not in self._phase:
            self.log.write(ev, "start", outcome)
        self._phase[ev.index] = "end"
        t = result.get("t")
        self.log.write(
            ev,
            "end",
            outcome,
            {k: v for k, v in result.items() if k not in ("event", "t")},
            t if isinstance(t, (int, float)) else None,
        )


def start_faults(sc: Scenario, target: FaultTarget, t0: float, run_dir: Path) -> FaultScheduler | None:
    """The scheduler of `sc`'s faults, started (None when the scenario has none)."""
    if not sc.faults:
        return None
    sched = FaultScheduler(fault_timeline(sc), target, t0, sc.scale.speedup, run_dir / "faults.jsonl")
    sched.start()
    return sched


# -- node faults on service processes (local and netns backends) -------------------------------

Request = Callable[[str, str, JSONObject | None], Awaitable[JSONObject]]


def http_json(
    url: str, body: JSONObject | None = None, timeout: float = 5.0, headers: dict[str, str] | None = None
) -> JSONObject:
    """GET (no body) or POST JSON; the reply's JSON object (blocking: run it in a thread).
    `headers`: e.g. the run secret a node's control routes ask for."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url,
        data=data,
        headers={"Content-Type": "application/json", **(headers or {})},
        method="GET" if body is None else "POST",
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = json.loads(r.read() or b"{}")
    if not isinstance(out, dict):
        raise ValueError(f"{url}: reply is not a JSON object")
    return out


class ProcessNodes:
    """Node faults on the processes of a `ProcessGroup`: signals to the service's session, a
    restart with the same command line, HTTP to the node's /testbed/fault endpoint.
    `request(node, path, body)` reaches the node's HTTP port wherever it lives."""

    def __init__(
        self,
        procs: ProcessGroup,
        argv: Callable[[str], list[str]],
        request: Request,
        health_timeout: float = HEALTH_TIMEOUT_S,
    ) -> None:
        self.procs = procs
        self.argv = argv
        self.request = request
        self.health_timeout = health_timeout

    def _known(self, node: str) -> None:
        if node not in self.procs.procs:
            raise KeyError(f"no process for node {node!r}")

    async def kill(self, node: str) -> JSONObject:
        self._known(node)
        pid = self.procs.send_signal(node, signal.SIGKILL)
        rc = await asyncio.to_thread(self.procs.procs[node].wait, KILL_WAIT_S)
        return {"pid": pid, "signal": "SIGKILL", "returncode": rc}

    async def pause(self, node: str) -> JSONObject:
        self._known(node)
        return {"pid": self.procs.send_signal(node, signal.SIGSTOP), "signal": "SIGSTOP"}

    async def resume(self, node: str) -> JSONObject:
        self._known(node)
        return {"pid": self.procs.send_signal(node, signal.SIGCONT), "signal": "SIGCONT"}

    async def start(self, node: str) -> JSONObject:
        self._known(node)
        if self.procs.procs[node].poll() is None:
            raise RuntimeError(f"node {node} is still running")
        t = now()
        self.procs.spawn(node, self.argv(node), append_log=True)
        p = self.procs.procs[node]
        while True:
            if p.poll() is not None:
                raise RuntimeError(
                    f"node {node} exited with code {p.returncode} on restart:\n"
                    + log_tail(self.procs.log_dir / f"{node}.log")
                )
            try:
                await self.request(node, "/health", None)
                return {"pid": p.pid, "healthy_after_s_wire": round(now() - t, 4)}
            except (OSError, ValueError):
                pass
            if now() - t > self.health_timeout:
                raise RuntimeError(f"node {node} not healthy {self.health_timeout:g} s after its restart")
            await asyncio.sleep(0.05)

    async def slow(self, node: str, factor: float, until: float | None) -> JSONObject:
        reply = await self.request(node, "/testbed/fault", {"slow": factor, "until_s": until})
        return {"slow": reply.get("slow"), "until_s": reply.get("until_s")}


# -- TCP resets by the injector process (netns backend; compose through the WAN container's netns) ---


class InjectorProcess:
    """Runs `python -m testbed.net.rst` for each tcp_reset fault and relays its progress.
    `wrap(argv)` makes the command run where it must (e.g. nsexec into the WAN namespace)."""

    def __init__(
        self,
        ifaces: Sequence[str],
        port: int,
        log_dir: Path,
        wrap: Callable[[list[str]], list[str]] = lambda a: a,
        netns: str | None = None,
    ) -> None:
        self.ifaces = list(ifaces)
        self.port = port
        self.log_dir = log_dir
        self.wrap = wrap
        self.netns = netns
        self._n = 0

    async def inject(
        self, spec: TcpResetFault, start: float, end: float, on_open: Callable[[JSONObject], None]
    ) -> JSONObject:
        self._n += 1
        argv = self.wrap(
            injector_argv(
                self.ifaces, self.port, start, end, None if spec.count == "all" else spec.count, spec.ends, self.netns
            )
        )
        log_path = self.log_dir / f"rst-{self._n}.log"
        proc = await start_reporting_child(argv, log_path)
        result: JSONObject = {}
        try:
            assert proc.stdout is not None
            async for raw in proc.stdout:
                try:
                    msg = json.loads(raw)
                except ValueError:
                    continue
                if msg.get("event") == "open":
                    on_open(msg)
                elif msg.get("event") == "done":
                    result = msg
            rc = await proc.wait()
        except asyncio.CancelledError:
            if proc.returncode is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 5)
                except TimeoutError:
                    proc.kill()
            raise
        if rc != 0 or not result:
            raise RuntimeError(f"reset injector exited with code {rc}: {log_tail(log_path, 5)}")
        return result
