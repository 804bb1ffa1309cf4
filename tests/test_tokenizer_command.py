"""`testbed tokenizer` writes a Hugging Face cache that transformers loads offline by name, and its
token counts sit near the router's 4-bytes-a-token estimate on English text."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.cli import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.app
def test_writes_a_cache_transformers_loads_offline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    home = tmp_path / "hf"
    assert main(["tokenizer", "--out", str(home), "--repo", "me/tok"]) == 0
    out = capsys.readouterr().out
    assert f"export HF_HOME={home.resolve()} HF_HUB_OFFLINE=1" in out.splitlines()
    text = (ROOT / "README.md").read_text()[:20000]
    probe = (
        "from transformers import AutoTokenizer; import sys; "
        "t = AutoTokenizer.from_pretrained('me/tok'); print(len(t.encode(sys.stdin.read())))"
    )
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", probe], input=text, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    bytes_per_token = len(text.encode()) / int(r.stdout.split()[-1])
    # The README is prose with tables and code (2.4 bytes a token); plain English nears 4.
    assert 2 < bytes_per_token < 6, bytes_per_token


@pytest.mark.pure
def test_a_bad_repo_name_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["tokenizer", "--out", str(tmp_path), "--repo", "no-owner"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "OWNER/NAME" in err, err
