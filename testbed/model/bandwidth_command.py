"""`testbed model --bandwidth`: Table 3 and the section 2.3 claims from the model profiles."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from testbed.model.bandwidth import BandwidthReport, ModelCurve, report
from testbed.model.paper_bandwidth import DATACENTER_ASSUMPTIONS, MODEL_NAMES, TABLE3_GBPS, TABLE3_TOKENS
from testbed.config.scenarios import ScenarioError, load_model_profile, model_profiles

DEFAULT_GPUS = 512
MIB = 1024 * 1024


def parse_tokens(text: str) -> int:
    """'32K' -> 32768 (K = 1024, as in Table 3's lengths), '30000' -> 30000."""
    t = text.strip().lower()
    try:
        n = round(float(t[:-1]) * 1024) if t.endswith("k") else int(t)
    except ValueError:
        raise ValueError(f"length {text!r} is not a token count like 32K or 30000") from None
    if n <= 0:
        raise ValueError(f"length {text!r} must be > 0 tokens")
    return n


def default_models() -> list[str]:
    """The paper's six in Table 3's column order, then any other shipped profile."""
    shipped = model_profiles()
    return [m for m in TABLE3_GBPS if m in shipped] + [m for m in shipped if m not in TABLE3_GBPS]


def load_curves(names: list[str]) -> list[ModelCurve]:
    out = []
    for name in names:
        prof = load_model_profile(name)
        label = name if name in model_profiles() else Path(name).stem
        out.append(ModelCurve.from_profile(label, prof))
    return out


def _tok(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _gbps(v: float) -> str:
    g = v / 1e9
    return f"{g:,.0f}" if g >= 1000 else f"{g:.1f}" if g >= 100 else f"{g:.2f}"


def _pct(v: float | None) -> str:
    if v is None:
        return "-"
    return "0.0%" if abs(v) < 0.0005 else f"{v:+.1%}"


def _label(model: str) -> str:
    return MODEL_NAMES.get(model, model)


def _mib(b: float) -> str:
    return f"{b / MIB:,.0f}" if b >= 1000 * MIB else f"{b / MIB:.1f}"


def _table(title: str, cols: tuple[str, ...]) -> Table:
    tab = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for i, col in enumerate(cols):
        tab.add_column(col, justify="left" if i == 0 else "right", no_wrap=True)
    return tab


def _phi_table(rep: BandwidthReport) -> Table:
    tab = _table(f"Phi_kv = S_kv / T_prefill of one 8xH200 instance (paper Table 3); "
                 f"B_out of {rep.gpus:g} GPUs ({rep.instances:g} instances) all prefilling",
                 ("model", "len", "S_kv MiB", "T s", "Phi Gbps", "paper", "diff", "B_out Gbps"))
    rows = rep.phi
    for i, r in enumerate(rows):
        first = i == 0 or rows[i - 1].model != r.model
        tab.add_row(_label(r.model) if first else "", _tok(r.tokens), _mib(r.kv_bytes), f"{r.prefill_s:.3f}",
                    f"{r.phi_bps / 1e9:.2f}", "-" if r.paper_bps is None else f"{r.paper_bps / 1e9:.2f}",
                    _pct(r.diff), _gbps(r.cluster_bps),
                    end_section=i + 1 < len(rows) and rows[i + 1].model != r.model)
    return tab


def _kv_table(rep: BandwidthReport) -> Table:
    tab = _table("KV derived from each architecture (scenarios/models/*.yaml); layers = full + state-holding",
                 ("model", "layers", "bytes/token", "state MiB", "paper", "diff"))
    for r in rep.kv:
        paper = "-" if r.paper_bytes_per_token is None else f"{r.paper_bytes_per_token:,}"
        tab.add_row(_label(r.model), f"{r.full_layers} + {r.state_layers}", f"{r.bytes_per_token:,.0f}",
                    _mib(r.state_bytes), paper, _pct(r.diff))
    return tab


def _claims_table(rep: BandwidthReport) -> Table:
    tab = _table("Section 2.3 claims at the paper's cluster sizes: B_out = (N/8) * Phi_kv(L_avg)",
                 ("claim", "model", "L_avg", "GPUs", "paper Gbps", "ours", "diff", "holds"))
    for r in rep.claims:
        c = r.claim
        paper = ("<" if c.bound == "below" else "~") + f"{c.paper_bps / 1e9:,.4g}"
        tab.add_row(c.label, _label(c.model), _tok(c.tokens), f"{c.gpus:,}", paper, _gbps(r.ours_bps), _pct(r.diff),
                    "yes" if r.holds() else "NO")
    return tab


def _notes(rep: BandwidthReport) -> str:
    fits = ", ".join(f"{_label(m)} at {_tok(n)} ({_gbps(b)} Gbps)" for m, n, b in rep.datacenter_candidates) or "none"
    items = [*DATACENTER_ASSUMPTIONS, f"of all Table 3 entries only {fits} lands within 10% of 1.8 Tbps "
             "on 10,000 all-prefill GPUs"]
    lines = ["The 10,000-GPU figure assumes:"]
    lines += [textwrap.fill(a, 78, initial_indent="  - ", subsequent_indent="    ") for a in items]
    lines.append(textwrap.fill(
        "Phi_kv ours = S_kv(l) / T(l): S_kv derived from the architecture, T fitted to Table 3 at "
        "1K/8K/32K/128K and interpolated linearly between them (extrapolated outside). "
        "'holds': within 10% of '~X', or below 'under X'.", 78))
    return "\n".join(lines)


def run_bandwidth(args: argparse.Namespace) -> int:
    try:
        lengths = [parse_tokens(x) for x in args.length] if args.length else list(TABLE3_TOKENS)
        gpus = float(args.gpus) if args.gpus is not None else float(DEFAULT_GPUS)
        curves = load_curves(args.model or default_models())
        rep = report(curves, lengths, gpus)
    except (ScenarioError, ValueError) as e:
        print(f"model: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2))
        return 0
    con = Console()
    con.print(_phi_table(rep))
    con.print(_kv_table(rep))
    if rep.claims:
        con.print(_claims_table(rep))
        con.print(_notes(rep))
    return 0
