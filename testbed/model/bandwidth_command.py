"""`testbed model --bandwidth`: Table 3 and the section 2.3 claims from the model profiles."""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from testbed.config.scenarios import PROFILE_SOURCES, load_model_profile, model_profiles, profile_sources
from testbed.model.bandwidth import BandwidthReport, ModelCurve, report
from testbed.model.errors import ModelError
from testbed.model.paper_bandwidth import DATACENTER_ASSUMPTIONS, MODEL_NAMES, TABLE3_GBPS, TABLE3_TOKENS

# Column tags of the profile sources (config.PROFILE_SOURCES), short enough for a table header.
SOURCE_TAGS = {"paper": "paper", "aiconfigurator": "aic"}
SOURCE_NOTE = (
    "paper = back-solved from Table 3 (scenarios/models); aic = aiconfigurator's measured kernels "
    "(scenarios/models/aiconfigurator, `testbed profile`)"
)

DEFAULT_GPUS = 512
MIB = 1024 * 1024


def parse_tokens(text: str) -> int:
    """'32K' -> 32768 (K = 1024, as in Table 3's lengths), '30000' -> 30000."""
    t = text.strip().lower()
    try:
        n = round(float(t[:-1]) * 1024) if t.endswith("k") else int(t)
    except ValueError:
        raise ModelError(f"length {text!r} is not a token count like 32K or 30000") from None
    if n <= 0:
        raise ModelError(f"length {text!r} must be > 0 tokens")
    return n


def default_models() -> list[str]:
    """The paper's six in Table 3's column order, then any other shipped profile."""
    shipped = model_profiles()
    return [m for m in TABLE3_GBPS if m in shipped] + [m for m in shipped if m not in TABLE3_GBPS]


def load_curves(names: list[str]) -> list[ModelCurve]:
    """The paper-derived profiles (or files) of `names`."""
    return load_sourced(names, ["paper"])["paper"]


def load_sourced(names: list[str], sources: list[str]) -> dict[str, list[ModelCurve]]:
    """Curves by source: each name's profile from every source in `sources` that ships one; a
    path is its own, under the source its provenance names (else 'file')."""
    out: dict[str, list[ModelCurve]] = {s: [] for s in sources}
    for name in names:
        if Path(name).exists():
            prof = load_model_profile(name)
            hw = prof.hardware.get("h200")
            src = hw.provenance.source if hw is not None and hw.provenance is not None else "file"
            out.setdefault(src, []).append(ModelCurve.from_profile(Path(name).stem, prof))
            continue
        have = profile_sources(name)
        if not have:
            load_model_profile(name)  # raises, naming the shipped profiles
        for src in sources:
            if src in have:
                out[src].append(ModelCurve.from_profile(name, load_model_profile(name, src)))
    return {s: c for s, c in out.items() if c}


def tag(source: str) -> str:
    return SOURCE_TAGS.get(source, source)


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


def _phi_table(reps: dict[str, BandwidthReport]) -> Table:
    """Phi_kv and B_out of every model at every length, a column per source."""
    first = next(iter(reps.values()))
    srcs = list(reps)
    one = len(srcs) == 1
    cols = ["model", "len", "S_kv MiB"]
    cols += ["T s"] if one else [f"T s\n{tag(s)}" for s in srcs]
    cols += ["Phi Gbps"] if one else [f"Phi Gbps\n{tag(s)}" for s in srcs]
    cols += ["paper", "diff"] if one else ["Table 3\nGbps"]
    cols += ["B_out Gbps"] if one else [f"B_out Gbps\n{tag(s)}" for s in srcs]
    tab = _table(
        f"Phi_kv = S_kv / T_prefill of one 8xH200 instance (paper Table 3); "
        f"B_out of {first.gpus:g} GPUs ({first.instances:g} instances) all prefilling"
        + ("" if one else f"\n{SOURCE_NOTE}"),
        tuple(cols),
    )
    by = {s: {(r.model, r.tokens): r for r in rep.phi} for s, rep in reps.items()}
    keys = list(dict.fromkeys((r.model, r.tokens) for rep in reps.values() for r in rep.phi))
    for i, k in enumerate(keys):
        rows = [by[s].get(k) for s in srcs]
        r0 = next(r for r in rows if r is not None)
        first_row = i == 0 or keys[i - 1][0] != k[0]
        cells = [_label(k[0]) if first_row else "", _tok(k[1]), _mib(r0.kv_bytes)]
        cells += ["-" if r is None else f"{r.prefill_s:.3f}" for r in rows]
        cells += ["-" if r is None else f"{r.phi_bps / 1e9:.2f}" for r in rows]
        cells += ["-" if r0.paper_bps is None else f"{r0.paper_bps / 1e9:.2f}"]
        if one:
            cells += [_pct(r0.diff)]
        cells += ["-" if r is None else _gbps(r.cluster_bps) for r in rows]
        tab.add_row(*cells, end_section=i + 1 < len(keys) and keys[i + 1][0] != k[0])
    return tab


def _fixed_table(reps: dict[str, BandwidthReport], lengths: list[int]) -> Table:
    """The fixed time per prefill of each source and how the rest of T compares."""
    srcs = list(reps)
    base = srcs[0]
    cols = ["model", *(f"fixed s\n{tag(s)}" for s in srcs), *(f"overhead_s\n{tag(s)}" for s in srcs)]
    cols += [f"{_tok(n)}\n{tag(s)}/{tag(base)}" for n in lengths for s in srcs[1:]]
    tab = _table(
        "Fixed time per prefill (T at 0 tokens: overhead_s + the curve's intercept), and the rest "
        "T(l) - fixed of each source over the first's",
        tuple(cols),
    )
    by = {s: {r.model: r for r in rep.fixed} for s, rep in reps.items()}
    for model in dict.fromkeys(r.model for rep in reps.values() for r in rep.fixed):
        rows = [by[s].get(model) for s in srcs]
        b = rows[0]
        cells = [
            _label(model),
            *("-" if r is None else f"{r.fixed_s:.3f}" for r in rows),
            *("-" if r is None else f"{r.overhead_s:.3f}" for r in rows),
        ]
        for n in lengths:
            for r in rows[1:]:
                ok = r is not None and b is not None and b.length_s[n] > 0
                cells.append(f"{r.length_s[n] / b.length_s[n]:.2f}x" if ok and r is not None and b is not None else "-")
        tab.add_row(*cells)
    return tab


def _kv_table(rep: BandwidthReport) -> Table:
    tab = _table(
        "KV derived from each architecture (scenarios/models/*.yaml); layers = full + state-holding",
        ("model", "layers", "bytes/token", "state MiB", "paper", "diff"),
    )
    for r in rep.kv:
        paper = "-" if r.paper_bytes_per_token is None else f"{r.paper_bytes_per_token:,}"
        tab.add_row(
            _label(r.model),
            f"{r.full_layers} + {r.state_layers}",
            f"{r.bytes_per_token:,.0f}",
            _mib(r.state_bytes),
            paper,
            _pct(r.diff),
        )
    return tab


def _claims_table(reps: dict[str, BandwidthReport]) -> Table:
    srcs = list(reps)
    first = reps[srcs[0]]
    cols = [
        "claim",
        "model",
        "L_avg",
        "GPUs",
        "paper Gbps",
        "ours" if len(srcs) == 1 else f"ours\n{tag(srcs[0])}",
        "diff",
        "holds",
    ]
    for s in srcs[1:]:
        cols += [f"ours\n{tag(s)}", "diff"]
    tab = _table("Section 2.3 claims at the paper's cluster sizes: B_out = (N/8) * Phi_kv(L_avg)", tuple(cols))
    others = [{r.claim.key: r for r in reps[s].claims} for s in srcs[1:]]
    for r in first.claims:
        c = r.claim
        paper = ("<" if c.bound == "below" else "~") + f"{c.paper_bps / 1e9:,.4g}"
        cells = [
            c.label,
            _label(c.model),
            _tok(c.tokens),
            f"{c.gpus:,}",
            paper,
            _gbps(r.ours_bps),
            _pct(r.diff),
            "yes" if r.holds() else "NO",
        ]
        for o in others:
            x = o.get(c.key)
            cells += ["-", "-"] if x is None else [_gbps(x.ours_bps), _pct(x.diff)]
        tab.add_row(*cells)
    return tab


def _notes(rep: BandwidthReport) -> str:
    fits = ", ".join(f"{_label(m)} at {_tok(n)} ({_gbps(b)} Gbps)" for m, n, b in rep.datacenter_candidates) or "none"
    items = [
        *DATACENTER_ASSUMPTIONS,
        f"of all Table 3 entries only {fits} lands within 10% of 1.8 Tbps on 10,000 all-prefill GPUs",
    ]
    lines = ["The 10,000-GPU figure assumes:"]
    lines += [textwrap.fill(a, 78, initial_indent="  - ", subsequent_indent="    ") for a in items]
    lines.append(
        textwrap.fill(
            "Phi_kv ours = S_kv(l) / T(l): S_kv derived from the architecture, T fitted to Table 3 at "
            "1K/8K/32K/128K and interpolated linearly between them (extrapolated outside). "
            "'holds': within 10% of '~X', or below 'under X'.",
            78,
        )
    )
    return "\n".join(lines)


def run_bandwidth(args: argparse.Namespace) -> int:
    lengths = [parse_tokens(x) for x in args.length] if args.length else list(TABLE3_TOKENS)
    gpus = float(args.gpus) if args.gpus is not None else float(DEFAULT_GPUS)
    sources = list(dict.fromkeys(args.source or PROFILE_SOURCES))
    curves = load_sourced(args.model or default_models(), sources)
    if not curves:
        raise ModelError(f"no profile of {', '.join(args.model or default_models())} from {', '.join(sources)}")
    reps = {s: report(c, lengths, gpus) for s, c in curves.items()}
    if args.json:
        first = next(iter(reps.values()))
        print(
            json.dumps(
                {**first.to_dict(), "source": next(iter(reps)), "sources": {s: r.to_dict() for s, r in reps.items()}},
                indent=2,
            )
        )
        return 0
    con = Console()
    if not con.is_terminal:
        # Piped or captured: no width to fit, and a cell cut to '…' loses the figure.
        con = Console(width=200)
    con.print(_phi_table(reps))
    con.print(_fixed_table(reps, lengths))
    first = next(iter(reps.values()))
    con.print(_kv_table(first))
    if first.claims:
        con.print(_claims_table(reps))
        con.print(_notes(first))
    return 0
