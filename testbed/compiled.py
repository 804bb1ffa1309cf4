"""The simulator's hot modules compiled to C by mypyc, where built (`make install`).

The modules in `MODULES` are plain typed Python; `tools/build_compiled.py` compiles them, as one
extension group, into extension modules beside their sources, which Python then imports in their
place. The sources stay the reference: the same code, run faster, and what runs where nothing is
built, where `TESTBED_COMPILED=0` is set, or where a source has changed since the build. A stale
build is never run: the build records each source's size and modification time (what Python's
own bytecode cache checks), and a mismatch loads every module of the group from source, as one
compiled module calls another's compiled code directly.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

ENV = "TESTBED_COMPILED"  # "0": the sources, even where the compiled modules are built
GROUP = "testbed._compiled"  # the group's shared library is `testbed._compiled__mypyc`
STAMP_FILE = "_compiled.stamp"  # beside this file: the signature of the sources built

# Those the simulator spends its time in, per request (profiles of the one-hour surrogate and of a
# million-request trace), and what they call on the way. Not those that live services read values
# of other types than annotated into (`testbed.core.record`, `testbed.metrics.series_format`: a
# compiled module converts or refuses them where the source keeps them as they are), nor one whose
# classes the live router subclasses (`testbed.core.router.router_books`).
MODULES: tuple[str, ...] = (
    "testbed.sim.simulator",
    "testbed.sim.router",
    "testbed.sim.prefill",
    "testbed.sim.decode",
    "testbed.sim.request",
    "testbed.sim.transfer",
    "testbed.sim.reach",
    "testbed.sim.events",
    "testbed.core.lifecycle",
    "testbed.core.engine.prefill_loop",
    "testbed.core.engine.prefill_queue",
    "testbed.core.engine.decode_loop",
    "testbed.core.engine.servicetime",
    "testbed.core.engine.kvsize",
    "testbed.core.routing.policy",
    "testbed.core.routing.load_tracker",
    "testbed.core.routing.cache_book",
    "testbed.core.routing.placement",
    "testbed.core.router.route_step",
    "testbed.core.control.short_term",
    "testbed.metrics.series_batch",
    "testbed.metrics.decision_columns",
)

_PACKAGE = Path(__file__).resolve().parent


def source_path(module: str) -> Path:
    return _PACKAGE.parent.joinpath(*module.split(".")).with_suffix(".py")


def signature(modules: Sequence[str] = MODULES) -> str:
    """The sources' sizes and modification times, as the build records them."""
    out = []
    for m in modules:
        st = source_path(m).stat()
        out.append(f"{m} {st.st_size} {st.st_mtime_ns}")
    return "\n".join(out)


def _built_signature() -> str | None:
    try:
        return (_PACKAGE / STAMP_FILE).read_text().strip()
    except OSError:
        return None


def _built(module: str) -> bool:
    src = source_path(module)
    return any(src.with_name(src.stem + s).exists() for s in importlib.machinery.EXTENSION_SUFFIXES)


class _Sources:
    """A meta path finder of the compiled modules' sources, ahead of the extension modules beside
    them (not an `importlib.abc.MetaPathFinder` subclass: that module alone costs 7 ms to import)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _SET:
            return None
        import importlib.util  # only where the sources stand in

        return importlib.util.spec_from_file_location(fullname, source_path(fullname))


_SET = frozenset(MODULES)
STALE = "python (stale build)"
STALE_NOTE = (
    "note: the simulator's compiled modules are older than their sources, so they run as Python "
    "(the same results, more slowly); `make install` compiles them again"
)
_STATE: list[str] = []  # what `install` decided: "compiled", "python" or STALE


def decide(built: str | None, complete: bool, env: str | None, current: Callable[[], str]) -> str:
    """What the hot modules run as: `built`, the signature the build recorded (None: no build);
    `complete`, every module's extension is there; `env`, `TESTBED_COMPILED`; `current`, the
    sources' signature now (read only where it decides)."""
    if built is None or not complete or env == "0":
        return "python"
    return "compiled" if built == current() else STALE


def install() -> None:
    """Called once as the package is imported: where the build is missing, turned off or stale,
    the sources are what the compiled modules' names import."""
    if _STATE:
        return
    built = _built_signature()
    complete = built is not None and all(_built(m) for m in MODULES)
    _STATE.append(decide(built, complete, os.environ.get(ENV), signature))
    if _STATE[0] != "compiled":  # even beside a part of a build (one that failed half-way)
        sys.meta_path.insert(0, _Sources())


def implementation() -> str:
    """How the hot modules run: "compiled", "python", or "python (stale build)" (a source changed
    since `make install` compiled it)."""
    install()
    return _STATE[0]
