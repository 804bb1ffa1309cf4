"""`testbed up --hold` as a child process, for the tests that drive it with real clients."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 120.0


@dataclass
class Held:
    proc: subprocess.Popen[str]
    info: dict[str, Any]  # the hold's first JSON line: base_url, url, run_dir, prefix, ...
    run_dir: Path

    def end(self, timeout: float = 90.0, sig: signal.Signals = signal.SIGTERM) -> dict[str, Any]:
        """Send `sig`, then the hold's last JSON line."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait(timeout)

    def wait(self, timeout: float) -> dict[str, Any]:
        out, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, err[-3000:]
        return dict(json.loads(out.strip().splitlines()[-1]))

    def kill(self) -> None:
        """Last resort after a failure: SIGINT (the hold tears down), then SIGKILL."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()


def start_hold(run_dir: Path, *args: str, ready_timeout: float = READY_TIMEOUT_S) -> Held:
    """Start a hold (`--json`) and return once it has printed its base URL."""
    cmd = [sys.executable, "-m", "testbed", "up", "--hold", "--json", "--out", str(run_dir), *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None
    deadline = time.monotonic() + ready_timeout
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))
        if ready:
            line = proc.stdout.readline()
            if line:
                return Held(proc, json.loads(line), run_dir)
        if not ready or proc.poll() is not None:
            # SIGINT first: a hold that is still starting tears down what it started.
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            try:
                _, err = proc.communicate(timeout=180)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            raise AssertionError(f"the hold never became ready: {err[-3000:]}")


# Over the paper-prfaas threshold (19,400 tokens; text counts 4 bytes a token): prefilled in the
# PrfaaS cluster, its KV crosses the shaped WAN. The short one stays in the local PD cluster.
LONG_PROMPT = "hello " * 14_000
SHORT_PROMPT = "hello " * 500


def check_api_key(info: dict[str, Any]) -> str:
    """The key a hold printed: in its run directory too, readable by its user only; the router
    refuses a client without it (401, as OpenAI's API does)."""
    import urllib.error
    import urllib.request

    path = Path(info["api_key_file"])
    assert path.read_text().strip() == info["api_key"] and path.stat().st_mode & 0o777 == 0o600
    try:
        urllib.request.urlopen(info["base_url"] + "/models", timeout=10)
        raise AssertionError("the router answered without the API key")
    except urllib.error.HTTPError as e:
        assert e.code == 401, e
    return str(info["api_key"])


def drive_with_openai(base_url: str, api_key: str, model: str = "kimi-linear-1t") -> dict[str, int]:
    """A streaming and a non-streaming chat completion with the `openai` package, each under its
    own X-Request-Id; checks the answers and returns each id's max_tokens."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=model,
        max_tokens=9,
        stream=True,
        messages=[{"role": "user", "content": LONG_PROMPT}],
        stream_options={"include_usage": True},
        extra_headers={"X-Request-Id": "held-stream"},
    )
    text, usage, final = "", None, None
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            text += ch.choices[0].delta.content
        if ch.usage:
            usage = ch.usage
        extra = getattr(ch, "model_extra", None) or {}
        if "testbed" in extra:
            final = extra["testbed"]
    assert text == " the" * 9, text
    assert usage is not None and usage.completion_tokens == 9 and usage.prompt_tokens > 19_400
    assert final is not None and final["request_id"] == "held-stream" and final["crossed_wan"] is True, final
    plain = client.chat.completions.create(
        model=model,
        max_tokens=3,
        messages=[{"role": "user", "content": SHORT_PROMPT}],
        extra_headers={"X-Request-Id": "held-plain"},
    )
    assert plain.choices[0].message.content == " the" * 3 and plain.choices[0].finish_reason == "length"
    assert plain.usage is not None and plain.usage.completion_tokens == 3
    assert client.models.list().data[0].id == model
    return {"held-stream": 9, "held-plain": 3}


def check_held_run(run_dir: Path, sent: dict[str, int], last: dict[str, Any]) -> None:
    """The run a hold wrote once stopped: the router's record of every request it answered."""
    from testbed.metrics.records import read_records

    assert last["ended"] == "stopped" and last["requests"] == len(sent), last
    recs = {r.request_id: r for r in read_records(run_dir / "records.csv")}
    assert set(recs) == set(sent)
    for rid, tokens in sent.items():
        r = recs[rid]
        t = r.times
        assert r.outcome == "completed" and r.tokens_received == r.output_tokens == tokens, r
        assert 0 <= t.arrival <= t.routed <= t.prefill_start <= t.first_token <= t.last_token, r
    assert recs["held-stream"].crossed_wan and recs["held-stream"].prefill_cluster == "prfaas"
    assert recs["held-stream"].kv_bytes_wire > 0
    assert not recs["held-plain"].crossed_wan and recs["held-plain"].prefill_cluster == "pd"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["requests"]["completed"] == len(sent) and summary["run"]["speedup"] == 1
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["hold"]["ended"] == "stopped" and meta["t0"] <= meta["t_end"]
    assert (run_dir / "report.md").is_file()


def answers(url: str) -> bool:
    """Whether anything still answers at the hold's URL."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(url + "/health", timeout=3)
    except (urllib.error.URLError, OSError):
        return False
    return True
