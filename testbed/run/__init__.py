"""The run base every study stands on: one replay run (`runner`), the `replay`/`up` commands, a
deployment held for outside clients, the shared run flags, scenarios as studies load them, the
speedup choice and the stop-at-Ctrl-C guard. May import every layer below studies; nothing below
imports it."""
