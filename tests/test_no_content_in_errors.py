"""Errors about a file that is not ours name it and a position, never its text: a scenario, a
link profile or a trace may be any readable file (`--scenario /etc/shadow` under sudo), and its
lines must not reach the terminal. Also: `--set` errors name the override, an unwritable --out
is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.cli import main
from testbed.core.finite_json import dumps, finite

pytestmark = pytest.mark.pure

# Lines shaped like /etc/shadow's (a copy, not the file): each holds a token that must not show.
SECRETS = [
    "root:$6$Qx1SECRETroot$hash1:19000:0:99999:7:::",
    "daemon:*:19000:0:99999:7:::",
    "alice:$6$Zy2SECRETalice$hash2:19001:0:99999:7:::",
    "svc-backup:!SECRETsvc:19002::::::",
]


def _shadow(path: Path) -> Path:
    path.write_text("\n".join(SECRETS) + "\n")
    return path


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out + out.err


def _assert_quotes_nothing(text: str) -> None:
    for line in SECRETS:
        for part in line.split(":"):
            if len(part) > 6:  # anything longer than a field name's length
                assert part not in text, f"{part!r} leaked:\n{text}"
    assert "SECRET" not in text, text


@pytest.fixture
def shadow(tmp_path: Path) -> Path:
    real = _shadow(tmp_path / "shadow")
    link = tmp_path / "s.yaml"
    link.symlink_to(real)
    return link


def test_a_shadow_file_as_scenario_quotes_none_of_it(shadow: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, text = _run(["replay", "--scenario", str(shadow), "--backend", "sim"], capsys)
    assert rc == 2
    _assert_quotes_nothing(text)
    assert f"{shadow}: not a scenario" in text and "line 1" in text, text


def test_a_shadow_file_as_link_profile_quotes_none_of_it_and_names_the_override(
    shadow: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pair = f"links.inter_dc={shadow}"
    rc, text = _run(["replay", "--scenario", "paper-prfaas", "--set", pair, "--backend", "sim"], capsys)
    assert rc == 2
    _assert_quotes_nothing(text)
    assert text.startswith(f"error: --set {pair}:"), text
    assert "not a link profile" in text


@pytest.mark.parametrize("fmt", ["azure", "burstgpt", "mooncake", "auto"])
@pytest.mark.parametrize("name", ["shadow.csv", "shadow.jsonl", "shadow"])
def test_a_shadow_file_as_trace_quotes_none_of_it(
    fmt: str, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _shadow(tmp_path / name)
    rc, text = _run(["trace", "validate", "--format", fmt, str(path)], capsys)
    assert rc != 0
    _assert_quotes_nothing(text)
    assert str(path) in text


def test_yaml_that_does_not_parse_is_named_by_position_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("token: [SECRETone\nSECRETtwo: {x\n")
    rc, text = _run(["replay", "--scenario", str(bad), "--backend", "sim"], capsys)
    assert rc == 2 and "SECRET" not in text, text
    assert "not valid YAML (line 2, column" in text, text


def test_a_scenario_with_a_stray_line_names_its_fields_but_not_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sc = tmp_path / "sc.yaml"
    sc.write_text(f'extends: {Path("scenarios/paper-prfaas.yaml").resolve()}\n"{SECRETS[0]}": 1\nbogus_field: 2\n')
    rc, text = _run(["replay", "--scenario", str(sc), "--backend", "sim"], capsys)
    assert rc == 2
    _assert_quotes_nothing(text)
    assert "field 'bogus_field'" in text and "field '<key>'" in text, text


def test_a_set_error_names_the_override_not_the_file(capsys: pytest.CaptureFixture[str]) -> None:
    rc, text = _run(
        ["replay", "--scenario", "paper-prfaas", "--set", "clusters.0.prefill=x", "--backend", "sim"], capsys
    )
    assert rc == 2
    assert text.startswith("error: --set clusters.0.prefill=x: invalid scenario field"), text
    rc, text = _run(
        ["replay", "--scenario", "paper-prfaas", "--set", "clusters.9.prefill=1", "--backend", "sim"], capsys
    )
    assert rc == 2 and text.startswith("error: --set clusters.9.prefill=1: "), text


@pytest.mark.parametrize("out", ["/proc/x", "/proc/self/x/y"])
def test_an_unwritable_out_is_one_line(out: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, text = _run(
        ["replay", "--scenario", "paper-prfaas", "--backend", "sim", "--requests", "2", "--out", out], capsys
    )
    assert rc == 2
    # Refused while the flags are parsed: nothing else is printed.
    assert text.splitlines() == [f"error: --out {out!r}: cannot write the output there: No such file or directory"], (
        text
    )


def test_finite_json_writes_null_for_what_has_no_figure() -> None:
    value = {"a": float("inf"), "b": [1.5, float("nan"), (float("-inf"),)], "c": "inf", "d": 2}
    assert finite(value) == {"a": None, "b": [1.5, None, [None]], "c": "inf", "d": 2}
    assert json.loads(dumps(value)) == {"a": None, "b": [1.5, None, [None]], "c": "inf", "d": 2}


@pytest.mark.parametrize("reader", ["prefill_csv", "decode_csv", "aiperf", "vllm", "baseline"])
def test_a_shadow_file_as_measurements_or_baseline_quotes_none_of_it(reader: str, tmp_path: Path) -> None:
    from testbed.core.errors import UserError
    from testbed.hardware import measurements
    from testbed.metrics.regress import RegressError, load_baseline

    path = _shadow(tmp_path / "m")
    read = {
        "prefill_csv": measurements.read_prefill_csv,
        "decode_csv": measurements.read_decode_csv,
        "aiperf": measurements.read_aiperf,
        "vllm": measurements.read_vllm,
        "baseline": load_baseline,
    }[reader]
    with pytest.raises((UserError, RegressError)) as e:
        read(path)
    _assert_quotes_nothing(str(e.value))
    assert str(path) in str(e.value)


def test_a_json_lines_file_of_strings_is_named_by_type(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('"SECRETstring"\n["SECRETlist"]\n')
    rc, text = _run(["trace", "validate", str(path)], capsys)
    assert rc != 0 and "SECRET" not in text, text
    assert "expected a JSON object, got a string" in text and "got an array" in text
