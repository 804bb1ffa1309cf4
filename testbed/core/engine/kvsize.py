"""KV cache size of a request, whole and per layer, in paper bytes."""

from __future__ import annotations

from dataclasses import dataclass

from testbed.core.schema.scenario import ModelSpec


@dataclass(frozen=True)
class KVModel:
    linear_state_bytes: int
    full_bytes_per_token: float
    kinds: tuple[str, ...]
    # Sliding-window layers (kind "linear"): per-token bytes held for the last window_tokens tokens.
    window_tokens: int = 0
    window_bytes_per_token: float = 0.0

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> KVModel:
        return cls(
            spec.linear_state_bytes,
            spec.full_attention_bytes_per_token,
            tuple(spec.layer_kinds()),
            spec.window_tokens,
            spec.window_bytes_per_token,
        )

    @property
    def layers(self) -> int:
        return len(self.kinds)

    def state(self, tokens: int) -> int:
        """Request-level state after `tokens` tokens: the fixed linear state plus the sliding
        window's KV, which stops growing once the prompt fills the window."""
        return self.linear_state_bytes + round(self.window_bytes_per_token * min(tokens, self.window_tokens))

    @property
    def max_state_bytes(self) -> int:
        """The largest request-level state (any prompt at least one window long)."""
        return self.state(self.window_tokens)

    def total(self, tokens: int) -> int:
        """KV bytes of a prefix of `tokens` tokens (linear state is per request, fixed)."""
        return self.state(tokens) + round(self.full_bytes_per_token * tokens)

    def incremental(self, tokens: int, cached: int) -> int:
        """Bytes a prefill of `tokens` total with `cached` cached must ship: the new full-attention
        blocks plus the whole linear state (it is rewritten for the new length)."""
        return self.state(tokens) + round(self.full_bytes_per_token * max(tokens - cached, 0))

    def per_layer(self, total_linear: int, total_full: int) -> list[int]:
        """Split linear-state and full-attention bytes evenly over the layers of each kind;
        the remainder goes to the last layer of that kind so the sum is exact."""
        n_lin = self.kinds.count("linear")
        n_full = self.kinds.count("full")
        out: list[int] = []
        seen = {"linear": 0, "full": 0}
        for kind in self.kinds:
            seen[kind] += 1
            if kind == "linear":
                share, last = divmod(total_linear, n_lin) if n_lin else (0, 0)
                out.append(share + (last if seen[kind] == n_lin else 0))
            else:
                share, last = divmod(total_full, n_full) if n_full else (0, 0)
                out.append(share + (last if seen[kind] == n_full else 0))
        return out

    def layer_bytes(self, tokens: int, cached: int = 0, byte_scale: float = 1.0) -> list[int]:
        """Per-layer bytes to ship for a prefill, divided by byte_scale (wire bytes when > 1)."""
        lin = round(self.state(tokens) / byte_scale) if self.kinds.count("linear") else 0
        full = (
            round(self.full_bytes_per_token * max(tokens - cached, 0) / byte_scale) if self.kinds.count("full") else 0
        )
        return self.per_layer(lin, full)

    def shipped(self, tokens: int, cached: int = 0, byte_scale: float = 1.0) -> tuple[int, int]:
        """(total, last layer) of `layer_bytes(tokens, cached, byte_scale)`, without the list."""
        n_lin = self.kinds.count("linear")
        n_full = self.layers - n_lin
        lin = round(self.state(tokens) / byte_scale) if n_lin else 0
        full = round(self.full_bytes_per_token * max(tokens - cached, 0) / byte_scale) if n_full else 0
        # The last layer of a kind takes its share plus the remainder (see `per_layer`).
        if self.kinds[-1] == "linear":
            return lin + full, lin - (lin // n_lin) * (n_lin - 1)
        return lin + full, full - (full // n_full) * (n_full - 1)
