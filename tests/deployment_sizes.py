"""Deployment sizes for tests that start services.

`ONE_PER_ROLE` keeps one instance of every kind: the PrfaaS cluster's prefill, the local
cluster's prefill and decode, with the router and the WAN router beside them. Teardown, signal
and client tests exercise every kind of service and the WAN crossing with it at about half the
start-up and teardown time of the paper's 4P + 3P/5D (a container or process start is mostly
its interpreter's imports, one CPU-second each); the replay tests keep the full deployment and
check its size."""

from __future__ import annotations

ONE_PER_ROLE = ["--set", "clusters.0.prefill=1", "--set", "clusters.1.prefill=1", "--set", "clusters.1.decode=1"]
SERVICES_ONE_PER_ROLE = 3 + 2  # instances, the router and the WAN router
