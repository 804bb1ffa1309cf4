"""What every plot of a run shares: a title naming the run (and saying INVALID when the testbed
marked it so, in red), and line styles that stay distinct past matplotlib's ten default colours."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_DASHES = ("-", "--", ":", "-.")


def stamp(fig: Figure, title: str) -> None:
    """The figure's title: the run's name, with INVALID in red when the title says so."""
    if title:
        fig.suptitle(title, fontsize="medium", color="tab:red" if "INVALID" in title else "black")


def run_title(name: str, valid: bool, what: str = "") -> str:
    """`name: what`, and `INVALID RUN` ahead of it when its timing was not faithful."""
    head = f"INVALID RUN {name} (timing not faithful)" if not valid else name
    return f"{head}: {what}" if what else head


def line_styles(n: int) -> list[tuple[tuple[float, float, float, float], str]]:
    """`n` (colour, line style) pairs, no two alike: tab20's twenty colours, then the same
    colours dashed, dotted, dash-dotted."""
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    order = [*range(0, 20, 2), *range(1, 20, 2)]  # the dark shades first, then the light ones
    return [(cmap(order[i % 20]), _DASHES[(i // 20) % len(_DASHES)]) for i in range(n)]
