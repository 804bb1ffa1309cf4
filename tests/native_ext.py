"""The compiled twins for their tests (`testbed.core.native`): the extension, or the test module
skipped where it is not built -- unless TESTBED_REQUIRE_NATIVE=1 (CI sets it), where a missing
build is a failure, not a skip."""

from __future__ import annotations

import os
from types import ModuleType

import pytest

from testbed.core import native


def required() -> ModuleType:
    ext = native.module()
    if ext is None:
        if os.environ.get("TESTBED_REQUIRE_NATIVE") == "1":
            raise RuntimeError(
                "TESTBED_REQUIRE_NATIVE=1 but testbed_native is not built (make install builds it "
                "where cargo is on PATH)"
            )
        pytest.skip(
            "testbed_native is not built here (needs a Rust toolchain; `make install` builds it)",
            allow_module_level=True,
        )
    return ext
