"""The trace format registry: lookup of outside names, detection and a round trip per format
through its protocol, and `trace synth` writing the same bytes it always has."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest

from testbed.traces import trace_command as command
from testbed.traces.formats import FORMATS, SUPPORTED_FORMATS, ReadOptions, WriteOptions, detect_format, trace_format
from testbed.traces.loader import iter_trace
from testbed.traces.synthetic import synth_with_prefixes
from testbed.traces.types import TraceError

pytestmark = pytest.mark.pure


def test_unknown_format_name_refused_naming_it_and_the_known_ones() -> None:
    with pytest.raises(
        TraceError,
        match=r"unsupported format 'parquet' \(supported: mooncake, azure, burstgpt, bailian, aiperf-multi-turn\)",
    ):
        trace_format("parquet")
    assert trace_format("azure") is FORMATS["azure"]


def test_unknown_format_given_to_the_loader_is_refused_before_reading(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="unsupported format 'jsonl'"):
        list(iter_trace(tmp_path / "missing.jsonl", "jsonl"))


@pytest.mark.parametrize("name", SUPPORTED_FORMATS)
def test_each_format_writes_what_it_detects_and_reads(tmp_path: Path, name: str) -> None:
    fmt = FORMATS[name]
    trace = synth_with_prefixes(30, 2.0, seed=4, block_tokens=fmt.block_tokens)
    path = tmp_path / f"t{fmt.suffix}"
    fmt.write(path, trace, WriteOptions())
    assert detect_format(path) == name
    got = list(fmt.read(path, ReadOptions()))
    assert [(r.input_tokens, r.output_tokens) for r in got] == [(r.input_tokens, r.output_tokens) for r in trace]
    assert [len(r.hash_ids) > 0 for r in got] == [fmt.carries_hashes and len(r.hash_ids) > 0 for r in trace]


def test_synth_choices_come_from_the_registry() -> None:
    p = argparse.ArgumentParser(prog="testbed")
    command.register(p.add_subparsers(dest="command", required=True))
    with pytest.raises(SystemExit):
        p.parse_args(["trace", "synth", "--format", "parquet", "--requests", "1", "--rate", "1", "--out", "x"])
    for sub in ("info", "validate"):
        assert p.parse_args(["trace", sub, "x", "--format", "burstgpt"]).format == "burstgpt"


# sha256 of `trace synth ... --requests 40 --rate 2 --seed 7` as written before the formats were
# one protocol: the registry must keep every format's output byte for byte.
GOLDEN = {
    ("mooncake",): "62163b009c0c07ae95e5539d6ae623fe00f26f8fca638bd49f150d0f74e59b18",
    ("mooncake", "--prefix-reuse"): "53bd5746fddfad4fd94d73b83824838f40a17b21ba043294677a4ba1403cf49f",
    ("mooncake", "--prefix-reuse", "agent"): "7842e34c155877da2a881b2504340ef476f83054f41ccd40d0fcfbb794117c37",
    ("azure",): "24c0064c79912db91babc2e80d84cd973cb59825115944aa6d2fc3cbb5143a83",
    ("azure", "--variant", "2023"): "b3e7c21bd2c34f98c5433318843b0d0059098e5ad69088302be858b7446c74a7",
    ("burstgpt",): "1c0eac025cd0867943e16cd4770d4db04448578747dcacc36c9dab949b2422de",
    (
        "burstgpt",
        "--variant",
        "v1",
        "--failed-share",
        "0.2",
    ): "9555aefce1d13993451cd6c0a57d9cad5c3d68e633db73a027765ed051987737",
}


@pytest.mark.parametrize("argv", list(GOLDEN), ids=lambda a: "-".join(a).replace("--", ""))
def test_synth_output_unchanged(tmp_path: Path, argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser(prog="testbed")
    command.register(p.add_subparsers(dest="command", required=True))
    out = tmp_path / "t.out"
    args = p.parse_args(
        ["trace", "synth", "--format", *argv, "--requests", "40", "--rate", "2", "--seed", "7", "--out", str(out)]
    )
    assert args.func(args) == 0
    data = out.read_bytes()
    if "--prefix-reuse" in argv:
        # Sessions are written since (`chat_id`, `parent_chat_id`, `think_time`); the rest is unchanged.
        rows = [json.loads(line) for line in data.splitlines()]
        assert all("chat_id" in r for r in rows)
        stripped = [{k: v for k, v in r.items() if k not in ("chat_id", "parent_chat_id", "think_time")} for r in rows]
        data = "".join(json.dumps(r) + "\n" for r in stripped).encode()
    assert hashlib.sha256(data).hexdigest() == GOLDEN[argv]
