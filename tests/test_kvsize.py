"""KV sizes with sliding-window layers: state that stops growing at the window (pure)."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from testbed.config.scenarios import load_scenario
from testbed.core.engine.kvsize import KVModel
from testbed.core.routing.prefix_cache import HybridPrefixCache
from testbed.core.schema.scenario import ModelSpec
from testbed.model.analytical import kv_bytes

pytestmark = pytest.mark.pure

# Two full layers at 10 B/token, two sliding-window layers at 100 B/token over a 128-token window.
SWA = ModelSpec(
    name="swa",
    layers=4,
    layer_pattern=["linear", "full"],
    linear_state_bytes=0,
    full_attention_bytes_per_token=20,
    window_tokens=128,
    window_bytes_per_token=200,
)


def test_window_state_grows_then_stops() -> None:
    kv = KVModel.from_spec(SWA)
    assert kv.state(0) == 0 and kv.state(64) == 64 * 200 and kv.state(128) == kv.state(10**6) == 128 * 200
    assert kv.max_state_bytes == 128 * 200
    assert kv.total(64) == 64 * 200 + 64 * 20
    assert kv.total(1000) == 128 * 200 + 1000 * 20
    # A prefill with a cached prefix ships the new full blocks and the whole window again.
    assert kv.incremental(1000, 900) == 128 * 200 + 100 * 20


def test_window_layer_bytes_split_exactly() -> None:
    kv = KVModel.from_spec(SWA)
    parts = kv.layer_bytes(1000, cached=200, byte_scale=4)
    assert sum(parts) == round(128 * 200 / 4) + round(800 * 20 / 4)
    assert parts[0] == parts[2] == 128 * 200 / 4 / 2 and parts[1] == parts[3] == 800 * 20 / 4 / 2


def test_analytical_sizes_match_kv_model() -> None:
    kv = KVModel.from_spec(SWA)
    lengths = np.array([1.0, 64.0, 128.0, 129.0, 32768.0])
    assert list(kv_bytes(kv, lengths)) == [kv.total(int(n)) for n in lengths]


def test_prefix_cache_keeps_the_whole_window_as_state() -> None:
    pool = HybridPrefixCache.for_model(KVModel.from_spec(SWA), 512, 1 << 30)
    assert pool.state_bytes == 128 * 200 and pool.block_bytes == 512 * 20


def test_models_without_a_window_are_unchanged() -> None:
    kv = KVModel.from_spec(load_scenario("paper-prfaas").model)
    assert kv.window_tokens == 0 and kv.max_state_bytes == kv.linear_state_bytes == kv.state(10**6)
    assert kv.total(30000) == kv.linear_state_bytes + round(kv.full_bytes_per_token * 30000)
    # Positional construction (as before the window fields) still works.
    assert KVModel(5, 1.0, ("linear", "full")).total(10) == 15


@pytest.mark.parametrize("fields, message", [
    ({"window_tokens": 128}, "both be set"),
    ({"window_bytes_per_token": 10.0}, "both be set"),
    ({"window_tokens": 128, "window_bytes_per_token": 10.0, "layer_pattern": ["full"]}, "needs 'linear' layers"),
])  # fmt: skip
def test_window_fields_validated(fields: dict[str, object], message: str) -> None:
    base = {
        "name": "m",
        "layers": 2,
        "layer_pattern": ["linear", "full"],
        "linear_state_bytes": 0,
        "full_attention_bytes_per_token": 1.0,
    }
    with pytest.raises(ValidationError, match=message):
        ModelSpec.model_validate({**base, **fields})
