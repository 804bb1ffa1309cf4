"""The compiled twins of core mechanisms (`native/`: the `testbed_native` extension), where built.

`make install` builds the extension where a Rust toolchain is present. Without it, or with
`TESTBED_NATIVE=0` in the environment, every mechanism runs its pure-Python module, which stays
the reference: the differential tests (`tests/test_native_*.py`) hold each twin to it, decision
for decision. A build from other sources than these (its `ABI` differs) is not used.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from types import ModuleType

ABI = 12  # native/src/lib.rs's: the twins' behaviour and interface this code expects
ENV = "TESTBED_NATIVE"  # "0": the pure-Python modules, even where the extension is built

log = logging.getLogger(__name__)


@cache
def module() -> ModuleType | None:
    """The extension, or None where it is not built, is another build, or is turned off."""
    if os.environ.get(ENV, "1") == "0":
        return None
    try:
        import testbed_native
    except ImportError:
        return None
    if getattr(testbed_native, "ABI", None) != ABI:
        log.warning(
            "testbed_native is built from other sources (ABI %s, expected %s): using the pure-Python "
            "modules; `make install` rebuilds it",
            getattr(testbed_native, "ABI", None),
            ABI,
        )
        return None
    return testbed_native


def implementation() -> str:
    """What the run's mechanisms run as: "native" or "python" (recorded with the run)."""
    return "python" if module() is None else "native"
