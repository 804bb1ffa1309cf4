"""prfaas-testbed: cross-datacenter prefill/decode disaggregated serving, emulated and simulated."""

from testbed import compiled as _compiled

# Before any compiled module is imported: a missing, turned-off or stale build runs the sources.
_compiled.install()
