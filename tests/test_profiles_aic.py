"""A profile written by `testbed profile --aiconfigurator` against direct calls of aiconfigurator
(the profiles extra; skipped without it). Each compile takes ~1.5 s of CPU, each call 0.1 ms."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from testbed.cli import main
from testbed.config.scenarios import PROFILE_SOURCES, load_model_profile
from testbed.core.engine.servicetime import DecodeStepTime, PrefillTime
from testbed.hardware import aiconfigurator as aic

pytestmark = pytest.mark.profiles

pytest.importorskip(
    "aiconfigurator_core",
    reason="aiconfigurator-core is not installed (the profiles extra: pip install 'prfaas-testbed[profiles]')",
)
from aiconfigurator_core.sdk.engine import EngineHandle  # noqa: E402

MODEL = "MiniMaxAI/MiniMax-M2.5"
PARALLEL = {"tp_size": 8, "moe_tp_size": 1, "moe_ep_size": 8}
BF16 = {"kvcache_quant_mode": "bfloat16", "fmha_quant_mode": "bfloat16"}


@pytest.fixture(scope="module")
def direct() -> Any:
    """The package's own entry point, as its documentation calls it."""
    return EngineHandle.compile(MODEL, "h200_sxm", "sglang", **PARALLEL, **BF16)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("aic") / "minimax.yaml"
    assert (
        main(
            [
                "profile",
                "--aiconfigurator",
                "minimax-m2.5",
                "--system",
                "h200_sxm",
                "--backend",
                "sglang",
                "--tp",
                "8",
                "--ep",
                "8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    return out


def test_the_written_profile_follows_direct_calls_within_one_percent(written: Path, direct: Any) -> None:
    hw = load_model_profile(written).hardware["h200"]
    t = PrefillTime.from_spec(hw.prefill)
    # At the table's points and between them: every length from 1 to 128K, geometrically.
    lengths = np.unique(np.round(np.geomspace(1, 131072, 600)).astype(int))
    errors = [t(int(n)) / (direct.predict_prefill_latency(bs=1, isl=int(n), prefix=0) / 1e3) - 1 for n in lengths]
    assert max(abs(e) for e in errors) < 0.01, max(errors, key=abs)
    for n in (1024, 8192, 32768, 131072):  # Table 3's lengths: points of the table
        assert t(n) == pytest.approx(direct.predict_prefill_latency(bs=1, isl=n, prefix=0) / 1e3, rel=1e-5)
    # Decode and the cached prefix are fitted terms: the file states how closely they follow the
    # source, and the statement is what direct calls give.
    prov = hw.provenance
    assert prov is not None
    step = DecodeStepTime.from_spec(hw.decode) if hw.decode is not None else None
    assert step is not None
    dec = [
        step(b, b * c) / (direct.predict_decode_latency(bs=b, isl=c, osl=2) / 1e3) - 1
        for b in (1, 8, 16, 32, hw.decode.bs_max)
        for c in (1024, 16384, 131072)
    ]
    assert max(abs(e) for e in dec) <= float(prov.fit["decode_max_rel_error"]) * 1.01 + 1e-4
    cached = [
        t(u, c) / (direct.predict_prefill_latency(bs=1, isl=u + c, prefix=c) / 1e3) - 1
        for u in (1024, 16384)
        for c in (2048, 32768)
    ]
    assert max(abs(e) for e in cached) <= float(prov.fit["cached_max_rel_error"]) * 1.01 + 1e-4
    # BS_max meets the TPOT target by the source's own step time.
    assert direct.predict_decode_latency(bs=hw.decode.bs_max, isl=28672, osl=2) / 1e3 <= 0.025
    # A batched pass: the profile's pass_tokens split against the source's own batched times,
    # within what the file states, and far closer than the single-prompt curve alone prices it.
    assert hw.prefill.pass_tokens is not None
    curve = PrefillTime.from_spec(hw.prefill.model_copy(update={"pass_tokens": None}))
    batched = [
        (
            t.pass_time([(0, n, 0)] * b),
            curve.pass_time([(0, n, 0)] * b),
            direct.predict_prefill_latency(bs=b, isl=n, prefix=0) / 1e3,
        )
        for b in (3, 6)
        for n in (1024, 4096)
    ]
    split_err = max(abs(a / ref - 1) for a, _, ref in batched)
    assert split_err <= max(float(prov.fit["batch_max_rel_error"]) * 1.5, 0.02), split_err
    assert max(abs(c / ref - 1) for _, c, ref in batched) > 3 * split_err


def test_provenance_says_what_was_compiled(written: Path) -> None:
    prov = load_model_profile(written).hardware["h200"].provenance
    assert prov is not None and prov.source == "aiconfigurator"
    assert prov.tool == f"aiconfigurator-core {importlib.metadata.version('aiconfigurator-core')}"
    assert (prov.model, prov.system, prov.backend, prov.database_mode) == (MODEL, "h200_sxm", "sglang", "SILICON")
    assert prov.backend_version and prov.backend_version[0].isdigit()  # the literal version, not "current"
    assert prov.parallel == {"tp": 8, "pp": 1, "moe_tp": 1, "moe_ep": 8, "attention_dp": 1}
    assert prov.quantization["kv_cache"] == "bfloat16" and prov.quantization["weights"]


def test_the_engine_answers_as_the_package_entry_point(direct: Any) -> None:
    pred = aic.compile_engine(
        aic.EngineRequest(MODEL, "h200_sxm", "sglang", quant={"kvcache": "bfloat16", "fmha": "bfloat16"})
    )
    for n, c in ((100, 0), (5000, 0), (70000, 0), (4096, 8192)):
        assert pred.prefill_s(n, c) == direct.predict_prefill_latency(bs=1, isl=n + c, prefix=c) / 1e3
    for b, c in ((1, 1024), (20, 28672), (64, 131072)):
        assert pred.decode_step_s(b, c) == direct.predict_decode_latency(bs=b, isl=c, osl=2) / 1e3


@pytest.mark.skipif(
    importlib.metadata.version("aiconfigurator-core") != "0.12.0",
    reason="the shipped profiles were written with aiconfigurator-core 0.12.0",
)
def test_the_shipped_profile_is_what_the_command_writes(written: Path) -> None:
    shipped = PROFILE_SOURCES["aiconfigurator"] / "minimax-m2.5.yaml"
    strip = lambda text: [ln for ln in text.splitlines() if not ln.startswith("# note: aiconfigurator-core:")]  # noqa: E731
    assert strip(written.read_text()) == strip(shipped.read_text())


@pytest.mark.parametrize("argv, message", [
    (("--aiconfigurator", "minimax-m2.5", "--moe-tp", "8", "--ep", "1"),
     "MoE tensor parallelism 8 breaks the FP8 block quantization"),
    (("--aiconfigurator", "deepseek-ai/DeepSeek-V3", "--kv-from", "minimax-m2.5", "--kv-cache-quant", "fp8"),
     "has no measured data for deepseek-ai/DeepSeek-V3 on h200_sxm with sglang current (tp 8, moe_ep 8): context MLA "
     "data missing"),
    (("--aiconfigurator", "minimax-m2.5", "--system", "h20"), "aiconfigurator has no system 'h20'"),
    (("--aiconfigurator", "minimax-m2.5", "--backend-version", "9.9"), "has no sglang version '9.9' for h200_sxm"),
    (("--aiconfigurator", "Nope/Model", "--kv-from", "minimax-m2.5"), "ships no config for model 'Nope/Model'"),
])  # fmt: skip
def test_refusals_of_the_real_package(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str) -> None:
    assert main(["profile", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_list_names_systems_and_models(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--list"]) == 0
    out = capsys.readouterr().out
    assert "h200_sxm" in out and "h20," not in out and MODEL in out and "minimax-m2.5 = MiniMaxAI/MiniMax-M2.5" in out
