"""The bounds of one replayable request, in one place: the router refuses requests outside them
and trace validation checks every row against them, so a trace that validates replays."""

from __future__ import annotations

# The router takes prompts and outputs of at least one token (`testbed.input_tokens`, `max_tokens`).
MIN_TOKENS = 1
# An overall ceiling on a prompt (no scenario model has a longer context).
MAX_INPUT_TOKENS = 1 << 20
# The largest `max_tokens` the router accepts.
MAX_OUTPUT_TOKENS = 1 << 20
# Prefix block hashes are 63-bit, as the router's own (`openai_api.block_hashes`) are: they fit an int64.
MAX_HASH_ID = (1 << 63) - 1
# Trace timestamps: up to 2^53 ms (285,000 years), where a float still holds whole milliseconds.
MAX_TIMESTAMP_MS = 1 << 53
MAX_TIMESTAMP_S = MAX_TIMESTAMP_MS / 1000
