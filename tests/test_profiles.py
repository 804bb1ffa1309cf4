"""Profile sources (pure): the prefill model's fixed overhead and cached-attention terms, the
provenance block, the sampler of a timing source (against closed forms), aiconfigurator's
refusals as one-line errors, and the sources side by side in `model --bandwidth` and
`feasibility`. The tests that query aiconfigurator itself are in test_profiles_aic.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import yaml

from testbed.cli import main
from testbed.config.scenarios import (
    MODEL_DIR,
    PROFILE_SOURCES,
    ScenarioError,
    load_model_profile,
    model_profiles,
    profile_sources,
)
from testbed.core.engine.kvsize import KVModel
from testbed.core.engine.servicetime import PrefillTime
from testbed.core.schema.hardware import PolynomialPrefill, TablePrefill
from testbed.hardware import aiconfigurator as aic
from testbed.hardware.calibrate import (
    CalibrationError,
    PrefillPoint,
    fit_prefill_polynomial,
    fit_prefill_table,
    split_overhead,
)
from testbed.hardware.profile_sample import (
    SampleError,
    SampleSettings,
    choose_bs_max,
    fit_cached_terms,
    prefill_table,
    sample_profile,
    start_knots,
)
from testbed.model.analytical import prefill_seconds
from testbed.model.feasibility import compare_sources, compute_map, load_deployments
from testbed.model.paper_bandwidth import TABLE3_GBPS
from testbed.studies.feasibility.feasibility_report import source_lines, source_rows

pytestmark = pytest.mark.pure

AIC_MODELS = ("minimax-m2.5", "mimo-v2-flash", "qwen3.5-397b", "qwen3-235b")


def _rc(argv: list[str]) -> int:
    """The CLI's exit code, whether the command or argparse (a bad flag value) refused."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


# ---- the prefill model's terms ------------------------------------------------------------------


def test_every_term_of_the_prefill_model() -> None:
    spec = TablePrefill(
        kind="table", points=[(1000, 0.1), (3000, 0.5)], overhead_s=0.25, cached_token_s=1e-6, cached_attention_s=2e-10
    )
    t = PrefillTime.from_spec(spec)
    assert t.length_time(2000) == pytest.approx(0.3)
    assert t.uncached_time(2000) == pytest.approx(0.55)
    assert t(2000, 0) == pytest.approx(0.55)
    # cached: per cached token, and per cached x uncached token (attention over the prefix)
    assert t(2000, 4000) == pytest.approx(0.55 + 4000 * (1e-6 + 2e-10 * 2000))
    # T at 0 tokens: the overhead plus the first segment's intercept (0.1 - 0.2 * 1000 / 1000 ... = -0.1)
    assert t.fixed_time() == pytest.approx(0.25 - 0.1)
    poly = PrefillTime.from_spec(PolynomialPrefill(kind="polynomial", coefficients=[0.05, 1e-5], overhead_s=0.3))
    assert poly.uncached_time(1000) == pytest.approx(0.3 + 0.05 + 0.01)
    assert poly.fixed_time() == pytest.approx(0.35)


def test_the_vectorised_curve_includes_the_overhead() -> None:
    for spec in (
        TablePrefill(kind="table", points=[(1024, 0.04), (8192, 0.32)], overhead_s=0.4),
        PolynomialPrefill(kind="polynomial", coefficients=[0.0, 1.3e-4, 3e-10], overhead_s=0.47),
    ):
        t = PrefillTime.from_spec(spec)
        v = np.array([1.0, 500.0, 4096.0, 50000.0])
        assert prefill_seconds(t, v) == pytest.approx([t.uncached_time(x) for x in v])


def test_defaults_leave_every_existing_curve_as_it_was() -> None:
    spec = TablePrefill(kind="table", points=[(1024, 0.44), (8192, 0.72)])
    assert (spec.overhead_s, spec.cached_attention_s) == (0.0, 0.0)
    t = PrefillTime.from_spec(spec)
    assert t(4096, 1000) == t.length_time(4096)


# ---- the profile format and its provenance ------------------------------------------------------


def _profile(tmp_path: Path, prefill: dict[str, object], provenance: dict[str, object] | None = None) -> Path:
    doc = yaml.safe_load((MODEL_DIR / "minimax-m2.5.yaml").read_text())
    doc["hardware"]["h200"]["prefill"] = prefill
    if provenance is None:
        doc["hardware"]["h200"].pop("provenance", None)
    else:
        doc["hardware"]["h200"]["provenance"] = provenance
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(doc))
    return f


def test_provenance_is_read_back_with_its_fields(tmp_path: Path) -> None:
    prov = {
        "source": "aiconfigurator",
        "tool": "aiconfigurator-core 0.12.0",
        "system": "h200_sxm",
        "backend": "sglang",
        "backend_version": "0.5.14",
        "database_mode": "SILICON",
        "parallel": {"tp": 8, "moe_ep": 8},
        "quantization": {"kv_cache": "bfloat16"},
        "fit": {"prefill_points": 12, "cached_max_rel_error": 0.04},
        "notes": ["a note"],
    }
    f = _profile(tmp_path, {"kind": "table", "points": [[1, 0.01], [2, 0.02]]}, prov)
    p = load_model_profile(f).hardware["h200"].provenance
    assert p is not None and p.source == "aiconfigurator" and p.parallel == {"tp": 8, "moe_ep": 8}
    assert p.fit["prefill_points"] == 12 and p.notes == ["a note"]


@pytest.mark.parametrize("prefill, provenance, field", [
    ({"kind": "table", "points": [[1, 0.01], [2, 0.02]], "overhead_s": -0.1}, None, "overhead_s"),
    ({"kind": "table", "points": [[1, 0.01], [2, 0.02]], "cached_attention_s": -1e-9}, None, "cached_attention_s"),
    ({"kind": "polynomial", "coefficients": [0.1], "overhead_s": "lots"}, None, "overhead_s"),
    ({"kind": "table", "points": [[1, 0.01], [2, 0.02]]}, {"tool": "x"}, "source"),
    ({"kind": "table", "points": [[1, 0.01], [2, 0.02]]}, {"source": "x", "version": "1"}, "version"),
    ({"kind": "table", "points": [[1, 0.01], [2, 0.02]]}, {"source": "x", "parallel": {"tp": "eight"}}, "parallel"),
])  # fmt: skip
def test_bad_terms_and_provenance_name_the_file_and_field(
    tmp_path: Path, prefill: dict[str, object], provenance: dict[str, object] | None, field: str
) -> None:
    f = _profile(tmp_path, prefill, provenance)
    with pytest.raises(ScenarioError) as e:
        load_model_profile(f)
    assert str(f) in str(e.value) and field in str(e.value)


@pytest.mark.parametrize("model", sorted(TABLE3_GBPS))
def test_paper_profiles_name_their_fixed_time(model: str) -> None:
    """The overhead is the 1K-8K segment of Table 3's times extrapolated to 0 tokens, so the
    table left over starts at (about) nothing, and the source says where the times come from."""
    hw = load_model_profile(model).hardware["h200"]
    spec = hw.prefill
    assert isinstance(spec, TablePrefill) and 0.25 < spec.overhead_s < 0.5
    assert PrefillTime.from_spec(spec).fixed_time() == pytest.approx(spec.overhead_s, abs=2e-4)
    assert hw.provenance is not None and hw.provenance.source == "paper"


def test_sources_and_their_profiles() -> None:
    assert list(PROFILE_SOURCES) == ["paper", "aiconfigurator"]
    assert model_profiles("aiconfigurator") == sorted(AIC_MODELS)
    assert profile_sources("minimax-m2.5") == ["paper", "aiconfigurator"]
    assert profile_sources("ring-2.5-1t") == ["paper"]
    with pytest.raises(ScenarioError, match="profile source 'nope' is not one of: paper, aiconfigurator"):
        model_profiles("nope")
    with pytest.raises(ScenarioError, match="of the aiconfigurator profiles: mimo-v2-flash"):
        load_model_profile("ring-2.5-1t", "aiconfigurator")


@pytest.mark.parametrize("model", AIC_MODELS)
def test_shipped_measured_profiles_keep_the_paper_model_block(model: str) -> None:
    ours, paper = load_model_profile(model, "aiconfigurator"), load_model_profile(model)
    assert ours.model == paper.model
    hw = ours.hardware["h200"]
    p = hw.provenance
    assert p is not None and p.source == "aiconfigurator" and p.tool == "aiconfigurator-core 0.12.0"
    assert (p.system, p.backend, p.database_mode) == ("h200_sxm", "sglang", "SILICON")
    assert p.backend_version == "0.5.14" and p.parallel["tp"] == 8 and p.quantization["kv_cache"] == "bfloat16"
    assert p.command is not None and p.command.startswith(f"testbed profile --aiconfigurator {model}")
    assert hw.prefill.overhead_s == 0 and hw.decode is not None
    # What the file claims of itself: the table between its points within 0.5% (+ rounding) of
    # the source, every answer measured (SILICON).
    assert float(p.fit["prefill_interpolation_max_rel_error"]) < 0.0065
    assert p.fit["non_silicon_answers"] == 0


# ---- calibrate: the overhead named or given -------------------------------------------------------


def test_split_overhead_keeps_every_total() -> None:
    tab = TablePrefill(kind="table", points=[(1024, 0.44), (8192, 0.72), (32768, 1.84)])
    named, note = split_overhead(tab)
    assert note is None and named.overhead_s == pytest.approx(0.40)
    a, b = PrefillTime.from_spec(tab), PrefillTime.from_spec(named)
    for x in (1, 1024, 5000, 32768, 90000):
        assert b(x, 100) == pytest.approx(a(x, 100))
    poly = PolynomialPrefill(kind="polynomial", coefficients=[0.4678, 1.3e-4, 3e-10])
    named_p, _ = split_overhead(poly)
    assert named_p.overhead_s == 0.4678 and isinstance(named_p, PolynomialPrefill)
    assert named_p.coefficients[0] == 0
    # Nothing to name: an intercept at or below 0.
    flat = TablePrefill(kind="table", points=[(1024, 0.01), (8192, 0.5)])
    assert split_overhead(flat)[0] == flat and "no fixed overhead" in (split_overhead(flat)[1] or "")


def test_a_known_overhead_is_kept_and_the_curve_fits_the_rest() -> None:
    true = PrefillTime.from_spec(PolynomialPrefill(kind="polynomial", coefficients=[0.0, 2e-5, 1e-10], overhead_s=0.3))
    pts = [PrefillPoint(float(n), 0.0, true(n)) for n in range(1000, 120000, 6000)]
    fit = fit_prefill_polynomial(pts, 2, 0, overhead=0.3)
    assert fit.spec.overhead_s == 0.3 and fit.spec.coefficients[0] == pytest.approx(0.0, abs=1e-9)
    assert fit.train.max_abs < 1e-9
    tab = fit_prefill_table(pts, 8, 0, overhead=0.3)
    assert tab.spec.overhead_s == 0.3 and all(y > 0 for _, y in tab.spec.points)
    with pytest.raises(
        CalibrationError, match=r"a measured prefill of 0\.3201 s is not above the fixed overhead of 0\.5 s"
    ):
        fit_prefill_table(pts, 8, 0, overhead=0.5)


def test_the_cached_attention_term_is_fitted_when_it_is_there() -> None:
    true = PrefillTime.from_spec(
        PolynomialPrefill(kind="polynomial", coefficients=[0.0, 2e-5], overhead_s=0.1, cached_attention_s=3e-10)
    )
    pts = [PrefillPoint(float(u), float(c), true(u, c)) for u in (1000, 4000, 16000, 64000) for c in (0, 2048, 32768)]
    fit = fit_prefill_polynomial(pts, 1, 0)
    assert fit.spec.cached_attention_s == pytest.approx(3e-10, rel=1e-6)
    assert fit.spec.cached_token_s == pytest.approx(0.0, abs=1e-12)
    assert fit.spec.overhead_s == pytest.approx(0.1)


def test_calibrate_writes_the_overhead_and_provenance(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "prefill.csv"
    t = PrefillTime.from_spec(TablePrefill(kind="table", points=[(1024, 0.44), (8192, 0.72), (32768, 1.84)]))
    f.write_text("prompt_tokens,prefill_s\n" + "".join(f"{n},{t(n):.6f}\n" for n in range(1024, 32769, 1024)))
    assert main(["calibrate", "--prefill-csv", str(f), "--holdout-every", "0", "--json"]) == 0
    block = json.loads(capsys.readouterr().out)["block"]
    assert block["prefill"]["overhead_s"] == pytest.approx(0.40, rel=1e-4)
    assert block["provenance"]["source"] == "calibrate" and block["provenance"]["fit"]["prefill_points"] == 32
    assert main(["calibrate", "--prefill-csv", str(f), "--overhead", "0.2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["block"]["prefill"]["overhead_s"] == 0.2
    assert _rc(["calibrate", "--prefill-csv", str(f), "--overhead", "-1"]) == 2
    assert "the overhead must be a finite number of seconds >= 0" in capsys.readouterr().err


# ---- the sampler, against closed forms -------------------------------------------------------------


class Closed:
    """A timing source with a step: prefill = 5 ms + 20 us/token + 1.2e-9/token^2, 3% more above 2048
    tokens (a kernel table's step, as aiconfigurator has just past a collected length), and the
    prefix's attention at 3e-10 s per cached x uncached token; decode exactly the testbed's form."""

    base, per_seq, per_ctx = 0.006, 1.5e-4, 8e-9

    def __init__(self) -> None:
        self.calls = 0

    def prefill_s(self, uncached: int, cached: int) -> float:
        self.calls += 1
        t = 0.005 + 2e-5 * uncached + 1.2e-9 * uncached**2
        return t * (1.03 if uncached > 2048 else 1.0) + 3e-10 * uncached * cached

    def decode_step_s(self, batch: int, context: int) -> float:
        return self.base + self.per_seq * batch + self.per_ctx * batch * context


def _kv() -> KVModel:
    return KVModel.from_spec(load_model_profile("minimax-m2.5").model)


def test_the_table_follows_the_source_between_its_points() -> None:
    src = Closed()
    pts, scores = prefill_table(lambda x: src.prefill_s(x, 0), 1, 131072, 0.005, 200)
    xs = [x for x, _ in pts]
    assert xs[0] == 1 and xs[-1] == 131072 and {2048, 2049} <= set(xs)  # the step is a knot pair
    assert all(y == src.prefill_s(x, 0) for x, y in pts)  # the source's own times
    t = PrefillTime(tuple(float(x) for x in xs), tuple(y for _, y in pts), (), 0.0)
    probe = np.unique(np.round(np.geomspace(1, 131072, 2000)).astype(int))
    worst = max(abs(t.length_time(float(x)) / src.prefill_s(int(x), 0) - 1) for x in probe)
    assert worst < 0.005 and scores.max_abs < 0.005 and scores.n > 0


def test_start_knots_bracket_every_power_of_two() -> None:
    assert start_knots(1, 20) == [1, 2, 3, 4, 5, 8, 9, 16, 17, 20]
    assert start_knots(100, 1000) == [100, 128, 129, 256, 257, 512, 513, 1000]


class ClosedBatch(Closed):
    """A batched pass: 20 ms, 10 us a token of the pass, and each prompt's attention 1e-10 s a token squared."""

    def prefill_s(self, uncached: int, cached: int) -> float:
        return self.prefill_batch_s(1, uncached) + 3e-10 * uncached * cached

    def prefill_batch_s(self, batch: int, tokens: int) -> float:
        return 0.02 + 1e-5 * batch * tokens + 1e-10 * batch * tokens**2


def test_a_batched_source_gives_the_pass_tokens_split_and_scores_it() -> None:
    sample = sample_profile(ClosedBatch(), _kv(), SampleSettings(max_tokens=32768))
    assert sample.prefill.pass_tokens is not None
    assert sample.batched is not None and sample.batched_curve_only is not None
    t = PrefillTime.from_spec(sample.prefill)
    src = ClosedBatch()
    for b, n in ((3, 700), (5, 3000)):
        assert t.pass_time([(0, n, 0)] * b) == pytest.approx(src.prefill_batch_s(b, n), rel=0.02)
    fit = sample.fit_record()
    # Nine probes less the one past max_tokens (8 prompts of 8,192).
    assert fit["batch_probes"] == 8 and float(fit["batch_max_rel_error"]) < 0.02
    assert float(fit["batch_curve_only_max_rel_error"]) > 5 * float(fit["batch_max_rel_error"])
    # A source without batched passes leaves the profile on the curve alone.
    assert sample_profile(Closed(), _kv(), SampleSettings(max_tokens=32768)).prefill.pass_tokens is None


def test_the_sampled_profile_recovers_the_closed_forms() -> None:
    s = sample_profile(Closed(), _kv(), SampleSettings(overhead_s=0.05))
    pre = s.prefill
    assert pre.overhead_s == 0.05
    assert pre.cached_attention_s == pytest.approx(3e-10, rel=1e-3) and pre.cached_token_s == pytest.approx(
        0, abs=1e-12
    )
    d = s.decode
    assert (d.base_s, d.per_seq_s, d.per_context_token_s) == pytest.approx(
        (Closed.base, Closed.per_seq, Closed.per_ctx)
    )
    # BS_max: the largest batch whose step at 28K tokens a sequence meets 25 ms.
    step = Closed().decode_step_s
    assert step(d.bs_max, 28672) <= 0.025 < step(d.bs_max + 1, 28672)
    assert s.decode_fit.max_abs < 1e-9 and s.cached.max_abs < 1e-3
    rec = s.fit_record()
    assert rec["prefill_points"] == len(pre.points) and rec["decode_step_at_bs_max_s"] <= 0.025


def test_bs_max_respects_the_kv_capacity() -> None:
    kv = _kv()
    cap = 10 * kv.total(28672)
    s = sample_profile(Closed(), kv, SampleSettings(kv_capacity_bytes=cap))
    assert s.decode.bs_max == 10 and s.decode.kv_capacity_bytes == cap
    assert choose_bs_max(lambda b: 0.001 * b, 0.0105, lambda b: True) == 10
    assert choose_bs_max(lambda b: 0.001, 0.01, lambda b: True) == 1024


@pytest.mark.parametrize("settings, message", [
    (SampleSettings(tpot_s=0.001), "one sequence alone takes 6.4 ms a step, over the TPOT target of 1.0 ms"),
    (SampleSettings(kv_capacity_bytes=1000), "one sequence's KV does not fit the KV capacity"),
    (SampleSettings(tolerance=1e-7, max_points=40), "needs more than 40 points to stay within"),
    (SampleSettings(min_tokens=10, max_tokens=10), "need 1 <= min < max"),
    (SampleSettings(overhead_s=math.inf), "need a finite number >= 0"),
])  # fmt: skip
def test_sampler_errors_say_what_to_change(settings: SampleSettings, message: str) -> None:
    with pytest.raises(SampleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        sample_profile(Closed(), _kv(), settings)


def test_a_source_answering_nonsense_is_refused() -> None:
    class Bad(Closed):
        def prefill_s(self, uncached: int, cached: int) -> float:
            return math.nan if uncached == 64 else super().prefill_s(uncached, cached)

    with pytest.raises(SampleError, match="the source gave nan s for a prefill of 64 tokens"):
        sample_profile(Bad(), _kv(), SampleSettings())


def test_cached_terms_stay_non_negative() -> None:
    # A source whose cached prefixes make prefill *faster* has no cached cost to fit.
    probes = [(u, c, 1.0 - 1e-6 * c) for u in (1000, 4000) for c in (1024, 8192)]
    a, b, scores = fit_cached_terms(lambda u: 1.0, probes)
    assert (a, b) == (0.0, 0.0) and scores.n == 4


# ---- aiconfigurator's refusals, one line each --------------------------------------------------------

REQ = aic.EngineRequest("MiniMaxAI/MiniMax-M2.5", "h200_sxm", "sglang", moe_tp=8, moe_ep=1)


class PerfDataNotAvailableError(RuntimeError):
    """Named as the package's own class is."""


class HuggingFaceDownloadError(RuntimeError):
    pass


@pytest.mark.parametrize("exc, expected", [
    # The package's messages, verbatim (0.12.0).
    (ValueError("Invalid quantized MoE configuration: (moe_intermediate_size=1536 / moe_tp_size=8) % "
                "weight_block_size=128 != 0. "),
     "MoE tensor parallelism 8 breaks the FP8 block quantization (each expert's 1536-wide intermediate split 8 "
     "ways is not a whole number of 128-wide quantization blocks); use expert parallelism instead (--ep 8 --moe-tp 1)"),
    (PerfDataNotAvailableError('perf database error: context MLA data missing for ContextKey { fmha_quant: "fp8", '
                               'kv_quant: "fp8" } at /x/site-packages/aiconfigurator_core/systems/data/h200_sxm/sglang'
                               '/0.5.14'),
     'has no measured data for MiniMaxAI/MiniMax-M2.5 on h200_sxm with sglang current (tp 8, moe_tp 8): context MLA '
     'data missing for ContextKey { fmha_quant: "fp8", kv_quant: "fp8" } (try another --backend'),
    (HuggingFaceDownloadError("Failed to download Nope/Model's config.json from HuggingFace: <urlopen error>"),
     "has no config for model 'MiniMaxAI/MiniMax-M2.5' offline"),
    (ValueError("sglang/'9.9' looks like an old-style raw version query; h200_sxm now resolves versions through "
                "queryable slots. New way: use an alias ('current'/'previous'/'next') or one of the slot versions "
                "{'current': '0.5.14', 'next': '0.5.16'}. Old way ..."),
     "has no sglang version 'current' for h200_sxm (its versions: {'current': '0.5.14', 'next': '0.5.16'}"),
    (ValueError('unknown backend for MoEDispatch: "foo" (expected trtllm/sglang/vllm)'),
     "knows no backend 'sglang'"),
    (RuntimeError("something new\nwith a traceback"), "refuses MiniMaxAI/MiniMax-M2.5 on h200_sxm"),
])  # fmt: skip
def test_refusals_become_one_line(exc: BaseException, expected: str) -> None:
    msg = aic.explain(exc, REQ)
    assert expected in msg and "\n" not in msg and "/site-packages" not in msg


SYSTEMS = ["b200_sxm", "h100_sxm", "h200_sxm"]
MODELS = ["MiniMaxAI/MiniMax-M2.5", "Qwen/Qwen3-235B-A22B"]


@pytest.mark.parametrize("req, message", [
    (aic.EngineRequest("MiniMaxAI/MiniMax-M2.5", "h20", "sglang"),
     "aiconfigurator has no system 'h20' (it has no H20; the paper's H20 curves stay paper-derived); it has: b200_sxm"),
    (aic.EngineRequest("Qwen/Qwen3-236B", "h200_sxm", "sglang"),
     "ships no config for model 'Qwen/Qwen3-236B' (did you mean: Qwen/Qwen3-235B-A22B?)"),
    (aic.EngineRequest("MiniMaxAI/MiniMax-M2.5", "h200_sxm", "sglang", tp=8, moe_ep=4),
     "MoE TP 1 x EP 4 must equal the attention's TP 8 x DP 1"),
    (aic.EngineRequest("MiniMaxAI/MiniMax-M2.5", "h200_sxm", "sglang", database_mode="FAST"),
     "database mode 'FAST' is not one of SILICON, HYBRID, EMPIRICAL, SOL"),
    (aic.EngineRequest("MiniMaxAI/MiniMax-M2.5", "h200_sxm", "sglang", quant={"weights": "fp8"}),
     "unknown quantization key(s) ['weights']"),
])  # fmt: skip
def test_requests_it_cannot_have_are_refused_before_compiling(req: aic.EngineRequest, message: str) -> None:
    with pytest.raises(aic.AiconfiguratorError) as e:
        aic.check_request(req, SYSTEMS, MODELS)
    assert message in str(e.value)


def test_a_missing_extra_is_one_line_naming_the_install() -> None:
    def importer(name: str) -> ModuleType:
        raise ModuleNotFoundError(f"No module named {name!r}")

    with pytest.raises(aic.AiconfiguratorError) as e:
        aic.require(importer)
    msg = str(e.value)
    assert "aiconfigurator-core, which is not installed" in msg and "pip install 'prfaas-testbed[profiles]'" in msg
    assert "\n" not in msg


def test_profile_names_map_to_the_package_ids() -> None:
    assert aic.model_id("minimax-m2.5") == "MiniMaxAI/MiniMax-M2.5"
    assert aic.model_id("Qwen/Qwen3-235B-A22B") == "Qwen/Qwen3-235B-A22B"
    assert set(aic.MODEL_IDS) == set(AIC_MODELS) and set(AIC_MODELS) <= set(model_profiles())


@pytest.mark.parametrize("argv, message", [
    ((), "give the source: --aiconfigurator MODEL"),
    (("--aiconfigurator", "moonshotai/Kimi-K2.5"), "no shipped profile of 'moonshotai/Kimi-K2.5' to take the model's "
                                                   "KV block from: give --kv-from PROFILE"),
    (("--aiconfigurator", "minimax-m2.5", "--kv-capacity", "lots"), "--kv-capacity 'lots' is not a size"),
    (("--aiconfigurator", "minimax-m2.5", "--tolerance", "0.9"), "need 0 < tolerance < 0.5"),
    (("--aiconfigurator", "minimax-m2.5", "--tp", "0"), "argument --tp: '0': need >= 1"),
    (("--aiconfigurator", "minimax-m2.5", "--kv-cache-quant", "fp4"), "invalid choice: 'fp4'"),
])  # fmt: skip
def test_profile_command_errors(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str) -> None:
    assert _rc(["profile", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


# ---- the sources side by side ---------------------------------------------------------------------------


def test_bandwidth_json_has_every_source(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "--bandwidth", "--json", "--model", "minimax-m2.5", "--model", "ring-2.5-1t"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["source"] == "paper" and set(out["sources"]) == {"paper", "aiconfigurator"}
    aic_rows = {(r["model"], r["tokens"]): r for r in out["sources"]["aiconfigurator"]["phi"]}
    assert set(aic_rows) == {("minimax-m2.5", n) for n in (1024, 8192, 32768, 131072)}  # no Ring there
    prof = load_model_profile("minimax-m2.5", "aiconfigurator")
    t = PrefillTime.from_spec(prof.hardware["h200"].prefill)
    r = aic_rows[("minimax-m2.5", 32768)]
    assert r["prefill_s"] == pytest.approx(t(32768)) and r["phi_bps"] == pytest.approx(8 * r["kv_bytes"] / t(32768))
    fixed = {f["model"]: f for f in out["sources"]["paper"]["fixed"]}
    assert fixed["minimax-m2.5"]["fixed_s"] == pytest.approx(0.4089, abs=2e-4)
    assert {f["model"]: f for f in out["sources"]["aiconfigurator"]["fixed"]}["minimax-m2.5"]["fixed_s"] < 0.02


def test_bandwidth_table_puts_the_sources_in_columns(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "--bandwidth", "--model", "qwen3-235b"]) == 0
    text = capsys.readouterr().out
    for needle in ("T s", "paper", "aic", "Fixed time per prefill", "overhead_s", "32K", "aic/paper", "0.357"):
        assert needle in text, needle
    assert "…" not in text  # nothing cut when the output is not a terminal
    assert main(["model", "--bandwidth", "--model", "qwen3-235b", "--source", "paper"]) == 0
    assert "aic" not in capsys.readouterr().out


def test_feasibility_compares_the_sources_by_the_model() -> None:
    deps = [load_deployments("minimax-m2.5"), load_deployments("ring-2.5-1t")]
    mm = compute_map(deps, [100.0], [30.0], with_break_even=False)
    sm = compare_sources("paper", mm, ["minimax-m2.5", "ring-2.5-1t"], list(PROFILE_SOURCES), with_break_even=False)
    assert sm.sources() == ["paper", "aiconfigurator"] and sm.models() == ["minimax-m2.5", "ring-2.5-1t"]
    paper, kernels = sm.point("paper", "minimax-m2.5", 100.0, 30.0), sm.point("aiconfigurator", "minimax-m2.5", 100, 30)
    assert paper is not None and kernels is not None and sm.point("aiconfigurator", "ring-2.5-1t", 100, 30) is None
    # Without the fixed 0.4 s per prefill short requests cost little locally: the best threshold rises.
    assert kernels.threshold > paper.threshold
    direct = compute_map(
        [load_deployments("minimax-m2.5", source="aiconfigurator")], [100.0], [30.0], with_break_even=False
    )
    assert kernels.lambda_max == direct.points[0].lambda_max
    csv_rows = source_rows(sm)
    assert {(r["model"], r["source"]) for r in csv_rows} == {
        ("minimax-m2.5", "paper"),
        ("ring-2.5-1t", "paper"),
        ("minimax-m2.5", "aiconfigurator"),
    }
    text = "\n".join(source_lines(sm, 100.0))
    assert "## Profile sources side by side" in text and "| MiniMax-M2.5 | aic | 0.007 |" in text
    # One source: nothing to put side by side.
    assert source_lines(compare_sources("paper", mm, ["ring-2.5-1t"], ["paper"]), 100.0) == []
