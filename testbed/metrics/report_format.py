"""Number formatting for the reports' tables and plot labels: paper units, "n/a" for what is missing."""

from __future__ import annotations

import math

NA = "n/a"

# ---------------------------------------------------------------- formatting


def fmt(x: float | int | None, unit: str = "") -> str:
    """3 significant figures, thousands separated, no exponent between 1e-4 and 1e15."""
    if x is None or isinstance(x, bool):
        return NA
    if isinstance(x, int):
        return f"{x:,}{unit}"
    if not math.isfinite(x):
        return NA
    if x == 0:
        return f"0{unit}"
    x = float(f"{x:.3g}")  # round first, so 9.9996 prints as 10.0, not 10.00
    mag = math.floor(math.log10(abs(x)))
    if mag >= 15 or mag < -4:
        s = f"{x:.2e}"
    elif mag >= 2:
        s = f"{x:,.0f}"
    else:
        s = f"{x:.{2 - mag}f}"
    return s + unit


def fmt_bytes(x: float | None) -> str:
    """Decimal units (kB = 1000 B), like link rates."""
    if x is None or not math.isfinite(x):
        return NA
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(x) < 999.5:
            return fmt(x, f" {unit}")
        x /= 1000
    return fmt(x, " PB")


def fmt_rate(bytes_per_s: float | None) -> str:
    if bytes_per_s is None or not math.isfinite(bytes_per_s):
        return NA
    x = bytes_per_s * 8
    for unit in ("bit/s", "kbit/s", "Mbit/s", "Gbit/s"):
        if abs(x) < 999.5:
            return fmt(x, f" {unit}")
        x /= 1000
    return fmt(x, " Tbit/s")


def fmt_factor(x: float) -> str:
    """Scale factors print exactly: 4, 256, 0.5."""
    return f"{x:g}"


def fmt_pct(ratio: float | None) -> str:
    return NA if ratio is None else fmt(ratio * 100, "%")


def fmt_ms(seconds: float | None) -> str:
    return NA if seconds is None else fmt(seconds * 1000, " ms")


def fmt_change(value: float | None, base: float | None) -> str:
    """Relative change, signed: "-48%", "+3.2%"."""
    if value is None or not base:
        return NA
    pct = (value / base - 1) * 100
    return f"{pct:+.0f}%" if abs(pct) >= 10 else f"{pct:+.1f}%"
