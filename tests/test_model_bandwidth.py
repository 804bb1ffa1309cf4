"""Model profiles (scenarios/models) against the paper's Table 3 and section 2.3 (pure).

The figures compared with the paper are computed from the profile files; the paper's own
numbers are the constants of testbed.model.paper_bandwidth.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from testbed.cli import main
from testbed.config.scenarios import (
    MODEL_DIR,
    SCENARIO_DIR,
    ScenarioError,
    load_model_profile,
    load_scenario,
    model_profiles,
)
from testbed.core.schema.scenario import ModelSpec
from testbed.model.bandwidth import ModelCurve, datacenter_candidates, egress_bps, report
from testbed.model.bandwidth_command import parse_tokens
from testbed.model.model_command import register, run
from testbed.model.paper_bandwidth import CLAIMS, KV_BYTES_PER_TOKEN, TABLE3_GBPS, TABLE3_TOKENS, Claim

pytestmark = pytest.mark.pure


@pytest.fixture(scope="module")
def curves() -> dict[str, ModelCurve]:
    return {n: ModelCurve.from_profile(n, load_model_profile(n)) for n in model_profiles()}


def test_every_table1_model_has_a_profile() -> None:
    assert set(TABLE3_GBPS) <= set(model_profiles())


@pytest.mark.parametrize("model", sorted(TABLE3_GBPS))
def test_phi_matches_table3(curves: dict[str, ModelCurve], model: str) -> None:
    # T was fitted at these lengths, so anything beyond rounding means the file's KV bytes and
    # its curve disagree (one was changed without refitting the other).
    for tokens, gbps in zip(TABLE3_TOKENS, TABLE3_GBPS[model]):
        assert curves[model].phi_bps(tokens) == pytest.approx(gbps * 1e9, rel=0.005), (model, tokens)


@pytest.mark.parametrize("model", sorted(KV_BYTES_PER_TOKEN))
def test_per_token_bytes_match_the_paper(curves: dict[str, ModelCurve], model: str) -> None:
    assert curves[model].kv.full_bytes_per_token == pytest.approx(KV_BYTES_PER_TOKEN[model], rel=0.05)


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: c.key)
def test_section_2_3_claims(curves: dict[str, ModelCurve], claim: Claim) -> None:
    ours = egress_bps(curves[claim.model], claim.tokens, claim.gpus)
    if claim.bound == "below":
        assert ours < claim.paper_bps
        # "under 100 Gbps" should still be the same order, not an arbitrary small number.
        assert ours > 0.5 * claim.paper_bps
    else:
        assert ours == pytest.approx(claim.paper_bps, rel=0.10)


def test_report_claims_hold_and_datacenter_reading_is_unique(curves: dict[str, ModelCurve]) -> None:
    rep = report(list(curves.values()))
    assert len(rep.claims) == len(CLAIMS) and all(r.holds() for r in rep.claims)
    [(model, tokens, bps)] = datacenter_candidates()
    assert (model, tokens) == ("ring-2.5-1t", 131072) and bps == pytest.approx(1.825e12)
    # A wrong reading is rejected: Ring at 32K on 10,000 GPUs is far off 1.8 Tbps.
    assert egress_bps(curves["ring-2.5-1t"], 32768, 10000) > 1.5 * 1.8e12


@pytest.mark.parametrize("model", sorted(TABLE3_GBPS))
def test_derived_kv_gives_increasing_prefill_time(curves: dict[str, ModelCurve], model: str) -> None:
    """T(l) = S_kv(l) / Phi_kv(l) with the paper's Phi and our S_kv: a longer prompt cannot prefill
    faster. This bounds the fixed state from above (Kimi Linear: below ~54 MB)."""
    kv = curves[model].kv
    implied = [8 * kv.total(n) / (g * 1e9) for n, g in zip(TABLE3_TOKENS, TABLE3_GBPS[model])]
    assert all(b > a for a, b in zip(implied, implied[1:])), implied
    # And every model shares a fixed cost at 1K (0.34-0.48 s here) with fp32 recurrent state.
    assert 0.3 < implied[0] < 0.5


# The published config.json values the profiles' comments quote, and what they imply.
ARCH = {
    # model: (layers, full layers, full bytes/token, state layers, state bytes, window tokens)
    "kimi-linear": (27, 7, 7 * (512 + 64) * 2, 20, 20 * (32 * 128 * 128 * 4 + 3 * 32 * 128 * 3 * 2), 0),
    "mimo-v2-flash": (48, 9, 9 * 4 * (192 + 128) * 2, 39, 39 * 8 * (192 + 128) * 2 * 128, 128),
    "qwen3.5-397b": (
        60,
        15,
        15 * 2 * 256 * 2 * 2,
        45,
        45 * (64 * 128 * 128 * 4 + (2 * 16 * 128 + 64 * 128) * 3 * 2),
        0,
    ),
    "ring-2.5-1t": (80, 10, 10 * (512 + 64) * 2, 70, 70 * 64 * 128 * 128 * 4, 0),
    "minimax-m2.5": (62, 62, 62 * 8 * 128 * 2 * 2, 0, 0, 0),
    "qwen3-235b": (94, 94, 94 * 4 * 128 * 2 * 2, 0, 0, 0),
}


@pytest.mark.parametrize("model", sorted(ARCH))
def test_profile_bytes_follow_from_architecture(curves: dict[str, ModelCurve], model: str) -> None:
    layers, full, per_token, state_layers, state, window = ARCH[model]
    kv = curves[model].kv
    assert (kv.layers, kv.kinds.count("full"), kv.kinds.count("linear")) == (layers, full, state_layers)
    assert kv.full_bytes_per_token == per_token
    assert kv.max_state_bytes == state and kv.window_tokens == window


@pytest.mark.parametrize("path", sorted(MODEL_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_profiles_set_every_model_field(path: Path) -> None:
    # Merged over a parent, a field left out would keep the parent model's value.
    raw = yaml.safe_load(path.read_text())
    assert set(raw["model"]) == set(ModelSpec.model_fields)
    assert list(raw["hardware"]) == ["h200"] and raw["hardware"]["h200"]["prefill"]["kind"] == "table"


def test_profile_extends_into_the_paper_deployment(tmp_path: Path) -> None:
    f = tmp_path / "minimax.yaml"
    f.write_text(
        f"extends: [{SCENARIO_DIR / 'paper-prfaas.yaml'}, {MODEL_DIR / 'minimax-m2.5.yaml'}]\n"
        "name: paper-prfaas-minimax\n"
    )
    sc = load_scenario(f)
    base = load_scenario("paper-prfaas")
    assert sc.model == load_model_profile("minimax-m2.5").model
    assert sc.hardware["h200"] == load_model_profile("minimax-m2.5").hardware["h200"]
    assert sc.hardware["h20"] == base.hardware["h20"] and sc.clusters == base.clusters


def test_profile_errors(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="not found.*minimax-m2.5"):
        load_model_profile("no-such-model")
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "model: {name: x, layers: 2, layer_pattern: [full], linear_state_bytes: 5,"
        " full_attention_bytes_per_token: 1}\n"
        "hardware: {h200: {prefill: {kind: table, points: [[1, 1], [2, 2]]}}}\n"
    )
    with pytest.raises(ScenarioError, match="invalid model profile"):
        load_model_profile(bad)


def test_parse_tokens() -> None:
    assert parse_tokens("32K") == 32768 and parse_tokens("0.5k") == 512 and parse_tokens("30000") == 30000
    for bad in ("", "32M", "-1", "0"):
        with pytest.raises(ValueError):
            parse_tokens(bad)


def _cli(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    register(ap.add_subparsers())
    return ap.parse_args(["model", *argv])


def test_bandwidth_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        run(
            _cli(
                "--bandwidth",
                "--json",
                "--gpus",
                "1024",
                "--length",
                "32K",
                "--length",
                "20000",
                "--model",
                "ring-2.5-1t",
                "--model",
                str(MODEL_DIR / "minimax-m2.5.yaml"),
            )
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["instances"] == 128
    rows = {(r["model"], r["tokens"]): r for r in out["phi"]}
    assert set(rows) == {(m, n) for m in ("ring-2.5-1t", "minimax-m2.5") for n in (32768, 20000)}
    ring = rows[("ring-2.5-1t", 32768)]
    assert ring["paper_bps"] == 2.59e9 and ring["cluster_bps"] == pytest.approx(128 * ring["phi_bps"])
    assert rows[("ring-2.5-1t", 20000)]["paper_bps"] is None
    assert {c["key"] for c in out["claims"]} == {c.key for c in CLAIMS if c.model in ("ring-2.5-1t", "minimax-m2.5")}
    assert all(c["holds"] for c in out["claims"])
    dc = out["datacenter"]
    assert dc["assumptions"] and [r["model"] for r in dc["table3_readings_within_10pct"]] == ["ring-2.5-1t"]


def test_bandwidth_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_cli("--bandwidth")) == 0
    text = capsys.readouterr().out
    for needle in ("Table 3", "Section 2.3", "MiniMax-M2.5", "253,952", "3,835", "10,000-GPU figure assumes"):
        assert needle in text
    assert "NO" not in text.split()


@pytest.mark.parametrize("argv, message", [
    (("--bandwidth", "--scenario", "paper-prfaas"), "without --scenario"),
    (("--scenario", "paper-prfaas", "--gpus", "64"), "--gpus need --bandwidth"),
    ((), "--scenario NAME"),
    (("--bandwidth", "--length", "lots"), "not a token count"),
    (("--bandwidth", "--model", "no-such-model"), "not found"),
    (("--bandwidth", "--gpus", "0"), "gpus must be > 0"),
])  # fmt: skip
def test_bandwidth_argument_errors(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str) -> None:
    assert main(["model", *argv]) == 2  # printed by the command itself, or as the CLI's UserError
    assert message in capsys.readouterr().err
