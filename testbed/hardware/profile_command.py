"""`testbed profile`: a model profile (scenarios/models format) whose hardware curves come from a
measured-kernel source rather than from the paper's tables.

One source today, NVIDIA's aiconfigurator (`--aiconfigurator MODEL`, the optional `profiles`
extra). A command of its own, not a `calibrate` flag: calibrate fits curves to measurements it
is given and writes a hardware block over a base scenario; this one queries a predictor where
it chooses, for a model profile (the model's KV block and its hardware curves) with the source's
provenance in the file, and has the source's own settings (system, backend, parallelism).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import yaml

from testbed.config.cli_args import StoreOnce, out_file
from testbed.config.scenarios import MODEL_DIR, ScenarioError, load_model_profile
from testbed.core.engine.kvsize import KVModel
from testbed.core.engine.servicetime import DecodeStepTime, PrefillTime
from testbed.core.errors import UserError
from testbed.core.schema.scenario import ModelProfile, ModelSpec, size_bytes
from testbed.hardware import aiconfigurator as aic
from testbed.hardware.calibrate_command import _g, _write_atomic
from testbed.hardware.profile_sample import ProfileSample, SampleError, SampleSettings, sample_profile
from testbed.model.bandwidth_command import parse_tokens
from testbed.model.errors import ModelError

# Lengths the summary prints the prefill time at (the paper's Table 3).
SUMMARY_TOKENS = (1024, 8192, 32768, 131072)


class ProfileCommandError(UserError, ValueError):
    """A bad combination of `testbed profile` flags."""


def _tokens(text: str) -> int:
    try:
        return parse_tokens(text)
    except ModelError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: need >= 1")
    return n


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: need a finite number of seconds >= 0")
    return v


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "profile",
        help="write a model profile whose prefill and decode curves come from measured GPU kernels (aiconfigurator)",
        description="Query a measured-kernel source for one serving instance of a model and write a model profile "
        "(the scenarios/models format: the model's KV block and hardware.NAME with a prefill table over "
        "uncached tokens, cached-prefix terms, a decode step model, and the source's provenance). "
        "The source: NVIDIA's aiconfigurator (pip install 'prfaas-testbed[profiles]'). Its times are "
        "kernel times: --overhead adds a fixed time per prefill. See docs/guides/profiles.md.",
    )
    src = p.add_argument_group("source")
    src.add_argument(
        "--aiconfigurator",
        action=StoreOnce,
        metavar="MODEL",
        help="the model: a testbed profile name (" + ", ".join(aic.MODEL_IDS) + ") or aiconfigurator's "
        "id (e.g. MiniMaxAI/MiniMax-M2.5; --list prints them)",
    )
    src.add_argument("--system", default="h200_sxm", help="aiconfigurator's GPU system (default h200_sxm)")
    src.add_argument("--backend", default="sglang", help="serving backend: sglang, trtllm or vllm (default sglang)")
    src.add_argument(
        "--backend-version",
        default="current",
        help="a version of the backend's database, or current / previous / next (default current)",
    )
    src.add_argument(
        "--database-mode",
        default="SILICON",
        type=str.upper,
        choices=aic.DATABASE_MODES,
        help="SILICON: measured data only (default); HYBRID: measured, else speed-of-light x an "
        "empirical factor; EMPIRICAL; SOL",
    )
    par = p.add_argument_group("parallelism of one instance")
    par.add_argument("--tp", type=_positive_int, default=8, help="attention tensor parallelism (default 8)")
    par.add_argument("--pp", type=_positive_int, default=1, help="pipeline parallelism (default 1)")
    par.add_argument("--attention-dp", type=_positive_int, default=1, help="attention data parallelism (default 1)")
    par.add_argument("--moe-tp", type=_positive_int, default=1, help="MoE tensor parallelism (default 1)")
    par.add_argument("--ep", type=_positive_int, help="MoE expert parallelism (default: tp x attention-dp / moe-tp)")
    q = p.add_argument_group("quantization (default: the model's own, except the KV cache)")
    q.add_argument(
        "--kv-cache-quant",
        default="bfloat16",
        choices=sorted(aic.KV_DTYPE_BYTES),
        help="KV cache dtype (default bfloat16, what the model profiles count; fp8/int8 halve the "
        "profile's per-token KV bytes)",
    )
    q.add_argument("--attention-quant", help="attention (FMHA) dtype (default: the KV cache's)")
    q.add_argument("--weights-quant", help="GEMM weights dtype, e.g. bfloat16, fp8_block")
    q.add_argument("--moe-quant", help="MoE weights dtype")
    out = p.add_argument_group("profile")
    out.add_argument(
        "--kv-from",
        metavar="PROFILE",
        help="model profile whose model block (KV bytes, layers) to use (default: the shipped "
        "profile of the same model)",
    )
    out.add_argument("--hardware", help="hardware name to write (default: the system's first word, e.g. h200)")
    out.add_argument(
        "--overhead",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="fixed time per prefill added to the kernels' (overhead_s; default 0)",
    )
    out.add_argument("--min-tokens", type=_tokens, default=1, help="shortest prompt in the table (default 1)")
    out.add_argument(
        "--max-tokens",
        type=_tokens,
        default=131072,
        help="longest prompt in the table (default 128K, Table 3's longest; longer extrapolates)",
    )
    out.add_argument(
        "--tolerance",
        type=float,
        default=0.005,
        help="the table's largest relative error against the source between points (default 0.005)",
    )
    out.add_argument(
        "--tpot",
        type=float,
        default=0.025,
        help="TPOT target that sets BS_max, s (default 0.025, the paper's 40 tokens/s)",
    )
    out.add_argument(
        "--decode-context",
        type=_tokens,
        default=28672,
        help="tokens a sequence holds when BS_max is chosen (default 28K)",
    )
    out.add_argument("--bs-max", type=_positive_int, help="decode BS_max (default: the largest batch meeting --tpot)")
    out.add_argument(
        "--kv-capacity", metavar="SIZE", help="decode KV memory, e.g. 600GiB (default: enough that BS_max binds)"
    )
    p.add_argument("--out", action=StoreOnce, type=out_file, metavar="FILE", help="write the profile here")
    p.add_argument("--list", action="store_true", help="print the systems and models aiconfigurator knows, and exit")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=cmd_profile)


def request_of(args: argparse.Namespace) -> aic.EngineRequest:
    if args.aiconfigurator is None:
        raise ProfileCommandError("give the source: --aiconfigurator MODEL (--list prints the models)")
    ep = args.ep if args.ep is not None else max(1, args.tp * args.attention_dp // args.moe_tp)
    quant = {"kvcache": args.kv_cache_quant, "fmha": args.attention_quant or args.kv_cache_quant}
    if args.weights_quant:
        quant["gemm"] = args.weights_quant
    if args.moe_quant:
        quant["moe"] = args.moe_quant
    return aic.EngineRequest(
        aic.model_id(args.aiconfigurator),
        args.system,
        args.backend,
        args.backend_version,
        tp=args.tp,
        pp=args.pp,
        moe_tp=args.moe_tp,
        moe_ep=ep,
        attention_dp=args.attention_dp,
        database_mode=args.database_mode,
        quant=quant,
    )


def _kv_source(args: argparse.Namespace) -> str:
    if args.kv_from is not None:
        return str(args.kv_from)
    name: str = args.aiconfigurator
    by_id = {v: k for k, v in aic.MODEL_IDS.items()}
    name = by_id.get(name, name)
    if name not in aic.MODEL_IDS:
        raise ProfileCommandError(
            f"no shipped profile of {args.aiconfigurator!r} to take the model's KV block from: "
            "give --kv-from PROFILE (a model profile of the same model)"
        )
    return name


def model_block(spec: ModelSpec, kv_dtype: str) -> tuple[dict[str, object], str | None]:
    """The profile's model block, per-token KV bytes scaled from bf16 (what the shipped profiles
    count) to the KV cache's dtype; (block, a note when they were scaled)."""
    d = {k: _g(v) if isinstance(v, float) else v for k, v in spec.model_dump(mode="json").items()}
    width = aic.KV_DTYPE_BYTES[kv_dtype]
    if width == 2:
        return d, None
    for k in ("full_attention_bytes_per_token", "window_bytes_per_token"):
        d[k] = _g(d[k] * width / 2)
    return d, f"KV cache in {kv_dtype}: per-token KV bytes of the bf16 model block x {width}/2"


def _command(args: argparse.Namespace, req: aic.EngineRequest) -> str:
    parts = [
        "testbed",
        "profile",
        "--aiconfigurator",
        args.aiconfigurator,
        "--system",
        req.system,
        "--backend",
        req.backend,
        "--backend-version",
        req.backend_version,
        "--tp",
        str(req.tp),
        "--ep",
        str(req.moe_ep),
        "--moe-tp",
        str(req.moe_tp),
    ]
    for flag, v, default in (
        ("--pp", req.pp, 1),
        ("--attention-dp", req.attention_dp, 1),
        ("--database-mode", req.database_mode, "SILICON"),
        ("--kv-cache-quant", args.kv_cache_quant, "bfloat16"),
        ("--attention-quant", args.attention_quant, None),
        ("--weights-quant", args.weights_quant, None),
        ("--moe-quant", args.moe_quant, None),
        ("--kv-from", args.kv_from, None),
        ("--overhead", args.overhead, 0.0),
        ("--min-tokens", args.min_tokens, 1),
        ("--max-tokens", args.max_tokens, 131072),
        ("--tolerance", args.tolerance, 0.005),
        ("--tpot", args.tpot, 0.025),
        ("--decode-context", args.decode_context, 28672),
        ("--bs-max", args.bs_max, None),
        ("--kv-capacity", args.kv_capacity, None),
    ):
        if v is not None and v != default:
            parts += [flag, f"{v:g}" if isinstance(v, float) else str(v)]
    return shlex.join(parts)


def settings_of(args: argparse.Namespace) -> SampleSettings:
    kv: int | None = None
    if args.kv_capacity is not None:
        v = size_bytes(args.kv_capacity)
        if not isinstance(v, int) or v <= 0:
            raise ProfileCommandError(f"--kv-capacity {args.kv_capacity!r} is not a size like 600GiB")
        kv = v
    s = SampleSettings(
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        tolerance=args.tolerance,
        overhead_s=args.overhead,
        decode_context=args.decode_context,
        tpot_s=args.tpot,
        bs_max=args.bs_max,
        kv_capacity_bytes=kv,
    )
    s.check()
    return s


def profile_document(
    sample: ProfileSample, model: dict[str, object], hardware: str, provenance: aic.AicProvenance
) -> dict[str, object]:
    pre = sample.prefill
    prefill = {
        "kind": "table",
        "overhead_s": _g(pre.overhead_s),
        "cached_token_s": _g(pre.cached_token_s),
        "cached_attention_s": _g(pre.cached_attention_s),
        "points": [[_g(x), _g(y)] for x, y in pre.points],
    }
    if pre.pass_tokens is not None:
        prefill["pass_tokens"] = [[_g(x), _g(y)] for x, y in pre.pass_tokens]
    d = sample.decode
    decode = {
        "base_s": _g(d.base_s),
        "per_seq_s": _g(d.per_seq_s),
        "per_context_token_s": _g(d.per_context_token_s),
        "bs_max": d.bs_max,
        "kv_capacity_bytes": d.kv_capacity_bytes,
    }
    return {"model": model, "hardware": {hardware: {"prefill": prefill, "decode": decode, "provenance": provenance}}}


def header(sample: ProfileSample, prov: aic.AicProvenance, kv_from: str) -> list[str]:
    f = sample.fit_record()
    par = ", ".join(f"{k} {v}" for k, v in prov["parallel"].items())
    quant = ", ".join(f"{k} {v}" for k, v in prov["quantization"].items())
    pre = sample.prefill
    return [
        f"{prov['model']} on {prov['system']}, measured kernels: {prov['tool']}, {prov['backend']} "
        f"{prov['backend_version']}, database {prov['database_mode']}",
        f"parallelism: {par}; quantization: {quant}",
        f"written by: {prov['command']}",
        f"model block: from the {kv_from} profile (KV derived from the architecture)",
        f"prefill: {len(pre.points)} points, the source's own times; between them within "
        f"{100 * f['prefill_interpolation_max_rel_error']:.2f}% of it (scored at the segments' odd eighths)",
        f"  fixed overhead_s {pre.overhead_s:g} s per prefill "
        + ("(given by --overhead; the table is kernel time)" if pre.overhead_s else "(none: kernel time only)"),
        f"  cached prefix: cached_token_s {pre.cached_token_s:.4g}, cached_attention_s {pre.cached_attention_s:.4g}: "
        f"{f['cached_probes']} probes, mean {100 * f['cached_mean_rel_error']:.2f}%, max "
        f"{100 * f['cached_max_rel_error']:.2f}%",
        f"decode: step = base_s + per_seq_s x batch + per_context_token_s x tokens held: {f['decode_probes']} probes, "
        f"mean {100 * f['decode_mean_rel_error']:.2f}%, max {100 * f['decode_max_rel_error']:.2f}%",
        *(f"note: {n}" for n in prov.get("notes", [])),
    ]


def _summary(sample: ProfileSample, predictor: aic.AicPredictor) -> list[str]:
    t = PrefillTime.from_spec(sample.prefill)
    step = DecodeStepTime.from_spec(sample.decode)
    lines = [
        "prefill s (profile / source): "
        + ", ".join(f"{n // 1024}K {t(n):.4g} / {predictor.prefill_s(n, 0):.4g}" for n in SUMMARY_TOKENS)
    ]
    if sample.batched is not None and sample.batched_curve_only is not None:
        lines.append(
            f"batched passes ({sample.batched.n} probes of 2-8 prompts): within {sample.batched.max_abs:.1%} of the "
            f"source by pass_tokens (on the single-prompt curve alone {sample.batched_curve_only.max_abs:.1%})"
        )
    b, c = 20, 28672
    lines.append(
        f"decode step at batch {b}, {c // 1024}K tokens each: {step(b, b * c) * 1e3:.2f} ms (source "
        f"{predictor.decode_step_s(b, c) * 1e3:.2f} ms); BS_max {sample.decode.bs_max}"
    )
    return lines


def cmd_profile(args: argparse.Namespace) -> int:
    if args.list:
        mod = aic.require()
        print("systems: " + ", ".join(aic.shipped_systems(mod)))
        print("models:  " + ", ".join(aic.shipped_models(mod)))
        print("testbed profile names: " + ", ".join(f"{k} = {v}" for k, v in aic.MODEL_IDS.items()))
        return 0
    req = request_of(args)
    settings = settings_of(args)
    kv_from = _kv_source(args)
    try:
        base = load_model_profile(kv_from)
    except ScenarioError as e:
        raise ProfileCommandError(f"--kv-from: {e}") from None
    model, kv_note = model_block(base.model, args.kv_cache_quant)
    predictor = aic.compile_engine(req)
    try:
        sample = sample_profile(predictor, KVModel.from_spec(ModelSpec.model_validate(model)), settings)
    except SampleError as e:
        raise ProfileCommandError(f"{req.describe()}: {e}") from None
    hardware = args.hardware or req.system.split("_")[0]
    prov = predictor.provenance()
    prov["command"] = _command(args, req)
    # Queries the package answered from more than measured data (HYBRID, EMPIRICAL or SOL rows).
    prov["fit"] = {
        **sample.fit_record(),
        "source_queries": predictor.queries,
        "non_silicon_answers": predictor.non_silicon,
    }
    prov["notes"] = [*([kv_note] if kv_note else []), *sample.notes, *(f"{aic.PACKAGE}: {ln}" for ln in predictor.log)]
    doc = profile_document(sample, model, hardware, prov)
    ModelProfile.model_validate(doc)  # what the loader will read back
    kv_label = (
        kv_from if Path(kv_from).exists() else str((MODEL_DIR / f"{kv_from}.yaml").relative_to(MODEL_DIR.parent.parent))
    )
    text = "".join(f"# {ln}\n" for ln in header(sample, prov, kv_label))
    text += yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=120)
    if args.json:
        print(json.dumps({"profile": doc, "out": None if args.out is None else str(args.out)}, indent=2))
    if args.out is not None:
        _write_atomic(args.out, text, _check_loads)
        if not args.json:
            print("\n".join(_summary(sample, predictor)))
            print(f"wrote {args.out}")
    elif not args.json:
        print("\n".join(_summary(sample, predictor)), file=sys.stderr)
        print(text, end="")
    return 0


def _check_loads(path: Path) -> None:
    try:
        load_model_profile(path)
    except ScenarioError as e:
        raise ProfileCommandError(f"the written profile does not load: {e}") from None
