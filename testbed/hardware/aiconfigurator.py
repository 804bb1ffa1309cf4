"""NVIDIA's aiconfigurator as a timing source (`testbed.hardware.profile_sample.Predictor`).

aiconfigurator-core (PyPI, Apache-2.0) predicts prefill and decode latencies of a model on a
GPU system and serving backend from measured kernel tables, offline on a CPU. It is an optional
extra (`pip install 'prfaas-testbed[profiles]'`): nothing else imports this module, and it
imports the package only when asked.

The engine is compiled as `aiconfigurator_core.sdk.engine.compile_engine` compiles it, from the
package's own building blocks, so that the configuration it was compiled with (the literal
backend version, the database mode, the quantization it inferred) can be recorded: the same
answers as `EngineHandle.compile(...)` (a test checks it), with their provenance.

Refusals of the package become one-line errors that say what was refused and what to try
(`explain`); they are matched on the package's own messages, which name the cause.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, NotRequired, TypedDict

from testbed.core.errors import UserError

PACKAGE = "aiconfigurator-core"
SUPPORTED = "0.12"
INSTALL_HINT = "pip install 'prfaas-testbed[profiles]' (or: pip install 'aiconfigurator-core==0.12.*')"

# The testbed's model profiles (scenarios/models/NAME.yaml) -> the model ids aiconfigurator ships.
MODEL_IDS: dict[str, str] = {
    "minimax-m2.5": "MiniMaxAI/MiniMax-M2.5",
    "mimo-v2-flash": "XiaomiMiMo/MiMo-V2-Flash",
    "qwen3.5-397b": "Qwen/Qwen3.5-397B-A17B",
    "qwen3-235b": "Qwen/Qwen3-235B-A22B",
}
DATABASE_MODES = ("SILICON", "HYBRID", "EMPIRICAL", "SOL")
QUANT_KEYS = ("gemm", "moe", "kvcache", "fmha")
KV_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}


class AiconfiguratorError(UserError, ValueError):
    """aiconfigurator is missing or refused the configuration: one line saying which."""


def version() -> str | None:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def require(importer: Callable[[str], ModuleType] = importlib.import_module) -> ModuleType:
    """The package, or a one-line error saying how to install it."""
    try:
        return importer("aiconfigurator_core")
    except ImportError:
        raise AiconfiguratorError(
            f"measured-kernel profiles need {PACKAGE}, which is not installed: {INSTALL_HINT}"
        ) from None


def _root(mod: ModuleType) -> Path:
    return Path(mod.__file__ or ".").parent


def shipped_systems(mod: ModuleType) -> list[str]:
    return sorted(p.name for p in (_root(mod) / "systems" / "data").iterdir() if p.is_dir())


def shipped_models(mod: ModuleType) -> list[str]:
    """Model ids with a config.json in the package (the only ones it knows offline)."""
    names = (p.name[: -len("_config.json")] for p in (_root(mod) / "model_configs").glob("*_config.json"))
    return sorted(n.replace("--", "/", 1) for n in names)


@dataclass(frozen=True)
class EngineRequest:
    """What to compile: a model (aiconfigurator's id), a system, a backend, the parallelism
    of one instance and, where given, the quantization (None: the model's default)."""

    model: str
    system: str
    backend: str
    backend_version: str = "current"
    tp: int = 8
    pp: int = 1
    moe_tp: int = 1
    moe_ep: int = 8
    attention_dp: int = 1
    database_mode: str = "SILICON"
    quant: dict[str, str] = field(default_factory=dict)  # keys of QUANT_KEYS

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.attention_dp

    def parallel(self) -> dict[str, int]:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "moe_tp": self.moe_tp,
            "moe_ep": self.moe_ep,
            "attention_dp": self.attention_dp,
        }

    def describe(self) -> str:
        p = self.parallel()
        return (
            f"{self.model} on {self.system} with {self.backend} {self.backend_version} ("
            + ", ".join(f"{k} {v}" for k, v in p.items() if v != 1 or k == "tp")
            + ")"
        )


def model_id(name: str) -> str:
    """A testbed profile name (minimax-m2.5) or aiconfigurator's own id (MiniMaxAI/MiniMax-M2.5)."""
    return MODEL_IDS.get(name, name)


# ---- refusals ---------------------------------------------------------------------------------

_PATH = re.compile(r"\s+at\s+/\S+")


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return _PATH.sub("", line).rstrip(" .")


def explain(exc: BaseException, req: EngineRequest) -> str:
    """One line for a refusal of aiconfigurator: what it refused, why, and what to try."""
    msg = str(exc)
    what = req.describe()
    name = type(exc).__name__
    if "Invalid quantized MoE configuration" in msg:
        m = re.search(r"moe_intermediate_size=(\d+) / moe_tp_size=(\d+)\) % weight_block_size=(\d+)", msg)
        detail = (
            f"each expert's {m.group(1)}-wide intermediate split {m.group(2)} ways is not a whole number of "
            f"{m.group(3)}-wide quantization blocks"
            if m
            else _first_line(msg)
        )
        return (
            f"aiconfigurator refuses {what}: MoE tensor parallelism {req.moe_tp} breaks the FP8 block "
            f"quantization ({detail}); use expert parallelism instead (--ep {req.gpus} --moe-tp 1)"
        )
    if name == "PerfDataNotAvailableError" or "perf database error" in msg or "data missing" in msg:
        detail = _first_line(msg).removeprefix("perf database error: ")
        return (
            f"aiconfigurator has no measured data for {what}: {detail} (try another --backend, "
            "--backend-version or quantization)"
        )
    if "HuggingFaceDownload" in name or "Failed to download" in msg:
        return (
            f"aiconfigurator has no config for model {req.model!r} offline (it ships configs for the ids "
            "`testbed profile --list-models` prints)"
        )
    if "old-style raw version query" in msg or "has no 'current' version" in msg or "slot" in msg:
        slots = re.search(r"(\{[^}]*\})", msg)
        return f"aiconfigurator has no {req.backend} version {req.backend_version!r} for {req.system}" + (
            f" (its versions: {slots.group(1)}; or current / previous / next)" if slots else ""
        )
    if "unknown backend" in msg:
        return f"aiconfigurator knows no backend {req.backend!r} (trtllm, sglang or vllm)"
    return f"aiconfigurator refuses {what}: {_first_line(msg) or name}"


def check_request(req: EngineRequest, systems: list[str], models: list[str]) -> None:
    """Refuse, before compiling, what the package cannot have: an unknown system (there is no
    H20 in its database), a model without a shipped config, a bad mode or parallelism."""
    if req.system not in systems:
        hint = " (it has no H20; the paper's H20 curves stay paper-derived)" if "h20" in req.system.lower() else ""
        raise AiconfiguratorError(f"aiconfigurator has no system {req.system!r}{hint}; it has: {', '.join(systems)}")
    if req.model not in models:
        near = [m for m in models if req.model.split("/")[-1].lower()[:6] in m.lower()]
        raise AiconfiguratorError(
            f"aiconfigurator ships no config for model {req.model!r}"
            + (f" (did you mean: {', '.join(near[:4])}?)" if near else "")
            + f"; a testbed profile name also works: {', '.join(MODEL_IDS)}"
        )
    if req.database_mode not in DATABASE_MODES:
        raise AiconfiguratorError(f"database mode {req.database_mode!r} is not one of {', '.join(DATABASE_MODES)}")
    bad = [f"{k} {v}" for k, v in req.parallel().items() if v < 1]
    if bad:
        raise AiconfiguratorError(f"parallelism must be >= 1: {', '.join(bad)}")
    if req.moe_tp * req.moe_ep != req.tp * req.attention_dp:
        raise AiconfiguratorError(
            f"MoE TP {req.moe_tp} x EP {req.moe_ep} must equal the attention's TP {req.tp} x "
            f"DP {req.attention_dp}: the experts are spread over the same GPUs"
        )
    unknown = sorted(set(req.quant) - set(QUANT_KEYS))
    if unknown:
        raise AiconfiguratorError(f"unknown quantization key(s) {unknown}: one of {', '.join(QUANT_KEYS)}")


# ---- the engine -------------------------------------------------------------------------------


class AicProvenance(TypedDict):
    """A profile's `provenance` block: where its figures came from; the profile command adds how
    it was run (`command`), how closely the fit follows the source (`fit`) and its `notes`."""

    source: str
    tool: str
    model: str
    system: str
    backend: str
    backend_version: str
    database_mode: str
    parallel: dict[str, int]
    quantization: dict[str, str]
    command: NotRequired[str]
    fit: NotRequired[dict[str, float]]
    notes: NotRequired[list[str]]


@dataclass
class AicPredictor:
    """A compiled engine: prefill and decode-step times in seconds, and what they came from."""

    handle: Any
    request: EngineRequest
    engine_config: dict[str, object]
    log: list[str] = field(default_factory=list)  # what the package warned of while loading
    queries: int = 0
    non_silicon: int = 0  # answers the package marks as not from measured data alone

    def _count(self) -> None:
        self.queries += 1
        if self.handle.last_provenance() is not None:
            self.non_silicon += 1

    def prefill_s(self, uncached: int, cached: int) -> float:
        v = float(self.handle.predict_prefill_latency(1, int(uncached + cached), int(cached))) / 1e3
        self._count()
        return v

    def prefill_batch_s(self, batch: int, tokens: int) -> float:
        v = float(self.handle.predict_prefill_latency(int(batch), int(tokens), 0)) / 1e3
        self._count()
        return v

    def decode_step_s(self, batch: int, context: int) -> float:
        # (osl - 1) steps of the batch at `isl` tokens each: osl 2 is one step.
        v = float(self.handle.predict_decode_latency(int(batch), int(context), 2)) / 1e3
        self._count()
        return v

    def quantization(self) -> dict[str, str]:
        e = self.engine_config
        keys = (
            ("weights", "weight_dtype"),
            ("moe", "moe_dtype"),
            ("attention", "activation_dtype"),
            ("kv_cache", "kv_cache_dtype"),
        )
        return {k: str(e[src]) for k, src in keys if e.get(src) is not None}

    def provenance(self) -> AicProvenance:
        e = self.engine_config
        return {
            "source": "aiconfigurator",
            "tool": f"{PACKAGE} {version()}",
            "model": self.request.model,
            "system": self.request.system,
            "backend": self.request.backend,
            "backend_version": str(e.get("backend_version") or self.request.backend_version),
            "database_mode": str(e.get("database_mode") or self.request.database_mode),
            "parallel": self.request.parallel(),
            "quantization": self.quantization(),
        }


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = _first_line(_PATH_ANY.sub("<package>", record.getMessage()))
        if line not in self.lines:
            self.lines.append(line)


_PATH_ANY = re.compile(r"/\S*/aiconfigurator_core")


def compile_engine(req: EngineRequest) -> AicPredictor:
    """Compile, with the package's warnings kept for the provenance rather than printed."""
    mod = require()
    check_request(req, shipped_systems(mod), shipped_models(mod))
    pkg_log = logging.getLogger("aiconfigurator_core")
    collect = _Collect()
    pkg_log.addHandler(collect)
    propagate, pkg_log.propagate = pkg_log.propagate, False
    try:
        pred = _compile(mod, req)
    finally:
        pkg_log.removeHandler(collect)
        pkg_log.propagate = propagate
    pred.log = collect.lines
    return pred


def _compile(mod: ModuleType, req: EngineRequest) -> AicPredictor:
    q = {f"{k}_quant_mode": v for k, v in req.quant.items()}
    try:
        from aiconfigurator_core.sdk import perf_database
        from aiconfigurator_core.sdk.config_builders import apply_nextn, build_model_config
        from aiconfigurator_core.sdk.engine import EngineHandle, build_engine_spec_json
        from aiconfigurator_core.sdk.models import get_model

        cfg = build_model_config(
            tp_size=req.tp,
            pp_size=req.pp,
            attention_dp_size=req.attention_dp,
            moe_tp_size=req.moe_tp,
            moe_ep_size=req.moe_ep,
            gemm_quant_mode=q.get("gemm_quant_mode"),
            kvcache_quant_mode=q.get("kvcache_quant_mode"),
            fmha_quant_mode=q.get("fmha_quant_mode"),
            moe_quant_mode=q.get("moe_quant_mode"),
            comm_quant_mode=None,
        )
        apply_nextn(cfg, 0)
        model = get_model(req.model, cfg, req.backend)
        literal = perf_database.resolve_query_version(req.system, req.backend, req.backend_version)
        database = perf_database.get_database_view(req.system, req.backend, literal, database_mode=req.database_mode)
        if database is None:
            raise AiconfiguratorError(f"aiconfigurator has no {req.backend} {literal} database for {req.system}")
        spec_json = build_engine_spec_json(
            model,
            model_path=req.model,
            system=req.system,
            backend=req.backend,
            backend_version=literal,
            kv_block_size=None,
            systems_path=None,
            nextn=cfg.nextn,
            database=database,
        )
        handle = EngineHandle(bytes(mod.engine_spec_bincode_from_json(spec_json)))
        pred = AicPredictor(handle, req, json.loads(spec_json)["engine"])
        pred.prefill_s(1024, 0)  # the first query loads the tables: refusals surface here
        pred.decode_step_s(1, 1024)
    except AiconfiguratorError:
        raise
    except Exception as e:  # the package raises ValueError, RuntimeError and its own errors alike
        raise AiconfiguratorError(explain(e, req)) from None
    return pred
