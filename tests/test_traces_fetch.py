"""`traces/fetch` against a mirror on 127.0.0.1 serving generated files: download, validation,
skip when complete, resume of a partial file, failures."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from testbed.traces import fetch
from testbed.traces.azure import write_azure
from testbed.traces.burstgpt import write_burstgpt
from testbed.traces.synthetic import synth_with_prefixes

pytestmark = pytest.mark.app

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "traces" / "fetch"


def _handler(root: Path, ranges: bool, log: list[str]) -> type[BaseHTTPRequestHandler]:
    class Mirror(BaseHTTPRequestHandler):
        """GET of ROOT/<path>, with `Range: bytes=N-` when `ranges`."""

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = root / self.path.lstrip("/")
            rng = self.headers.get("Range")
            log.append(f"{self.path} {rng or ''}".strip())
            if not path.is_file():
                self.send_error(404)
                return
            data = path.read_bytes()
            if ranges and rng and rng.startswith("bytes=") and rng.endswith("-"):
                start = int(rng[6:-1])
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                data = data[start:]
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Mirror


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[tuple[str, Path, list[str]]]:
    root = tmp_path / "mirror"
    t = synth_with_prefixes(400, 4.0, seed=11)
    (root / "mooncake").mkdir(parents=True)
    shutil.copy(ROOT / "traces" / "samples" / "mooncake-sample.jsonl", root / "mooncake" / "conversation_trace.jsonl")
    write_azure(root / "azure-2023" / "AzureLLMInferenceTrace_code.csv", t, "2023")
    write_azure(root / "azure-2023" / "AzureLLMInferenceTrace_conv.csv", t, "2023")
    write_burstgpt(root / "burstgpt" / "BurstGPT_3.csv", t, "v2", failed_share=0.1)
    log: list[str] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(root, True, log))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root, log
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _fetch(base: str, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, fetch.MIRROR_ENV: base}
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, env=env, timeout=120)


def test_fetch_validate_skip_resume(mirror: tuple[str, Path, list[str]], tmp_path: Path) -> None:
    base, root, log = mirror
    dest = tmp_path / "public"
    names = ["conversation_trace.jsonl", "azure-2023", "BurstGPT_3.csv"]
    r = _fetch(base, *names, "--dest", str(dest))
    assert r.returncode == 0, r.stdout + r.stderr
    rels = [
        "mooncake/conversation_trace.jsonl",
        "azure-2023/AzureLLMInferenceTrace_code.csv",
        "azure-2023/AzureLLMInferenceTrace_conv.csv",
        "burstgpt/BurstGPT_3.csv",
    ]
    for rel in rels:
        assert (dest / rel).read_bytes() == (root / rel).read_bytes(), rel
        assert not (dest / (rel + ".part")).exists()
    out = r.stdout
    assert "mooncake/conversation_trace.jsonl: downloaded" in out and "mooncake, 300 requests over" in out
    assert "AzureLLMInferenceTrace_conv.csv: downloaded" in out and "azure, 400 requests over" in out
    assert "burstgpt, " in out and "failed requests" in out

    # Complete files are skipped: one ranged request each, answered 416.
    log.clear()
    r = _fetch(base, *names, "--dest", str(dest), "--no-validate")
    assert r.returncode == 0 and r.stdout.count(": present,") == 4, r.stdout
    assert all(line.endswith("-") and "bytes=" in line for line in log)

    # A partial file is resumed from where it stopped.
    rel = rels[3]
    whole = (dest / rel).read_bytes()
    (dest / rel).unlink()
    (dest / (rel + ".part")).write_bytes(whole[:5000])
    log.clear()
    r = _fetch(base, "BurstGPT_3.csv", "--dest", str(dest))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "burstgpt/BurstGPT_3.csv: resumed" in r.stdout
    assert log == ["/burstgpt/BurstGPT_3.csv bytes=5000-"]
    assert (dest / rel).read_bytes() == whole

    # A local file that differs in size from the server's is fetched again.
    (dest / rel).write_bytes(whole + b"extra")
    r = _fetch(base, "BurstGPT_3.csv", "--dest", str(dest), "--no-validate")
    assert r.returncode == 0 and (dest / rel).read_bytes() == whole, r.stdout


def test_fetch_without_range_support_and_failures(tmp_path: Path) -> None:
    root = tmp_path / "mirror"
    write_azure(root / "azure-2023" / "AzureLLMInferenceTrace_code.csv", synth_with_prefixes(50, 1.0, seed=1), "2023")
    (root / "azure-2023" / "AzureLLMInferenceTrace_conv.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,1\n"
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(root, False, []))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    dest = tmp_path / "public"
    try:
        code = dest / "azure-2023" / "AzureLLMInferenceTrace_code.csv"
        code.parent.mkdir(parents=True)
        (code.parent / (code.name + ".part")).write_bytes(b"TIMESTAMP,Cont")
        r = _fetch(base, "azure", "mooncake", "--dest", str(dest))
        assert r.returncode == 1
        # Ranges ignored: the partial file is fetched whole.
        assert "AzureLLMInferenceTrace_code.csv: downloaded" in r.stdout and "azure, 50 requests" in r.stdout
        assert code.read_bytes() == (root / "azure-2023" / code.name).read_bytes()
        assert "AzureLLMInferenceTrace_conv.csv: downloaded" in r.stdout and "INVALID: " in r.stdout
        assert ":2: field 'TIMESTAMP'" in r.stdout
        assert "azure-2024/AzureLLMInferenceTrace_code_1week.csv: FAILED: " in r.stdout and "HTTP 404" in r.stdout
        assert "fetch: 6 of 7 files failed" in r.stderr
        # Complete without ranges: the server's Content-Length matches, so it is not fetched again.
        r = _fetch(base, "AzureLLMInferenceTrace_code.csv", "--dest", str(dest))
        assert r.returncode == 0 and ": present," in r.stdout, r.stdout
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    r = _fetch(base, "nonsense", "--dest", str(dest))
    assert r.returncode == 2 and "unknown trace 'nonsense'" in r.stderr


def test_select_and_catalogue() -> None:
    assert [f.name for f in fetch.select(["mooncake"])] == [
        "conversation_trace.jsonl",
        "toolagent_trace.jsonl",
        "synthetic_trace.jsonl",
    ]
    assert len(fetch.select(["all"])) == len(fetch.CATALOGUE)
    assert [f.group for f in fetch.select(["azure", "AzureLLMInferenceTrace_code.csv"])] == ["azure-2023"] * 2 + [
        "azure-2024"
    ] * 2
    assert all(u.startswith("https://") for f in fetch.CATALOGUE for u in f.urls)
    assert os.access(SCRIPT, os.X_OK)
