"""The routing outcome "no instance can take the request", apart from the policies: a subclass of a
built-in exception other than `Exception` cannot be a compiled class (`testbed.compiled`), and the
policies are compiled."""

from __future__ import annotations


class NoCapacity(RuntimeError):
    """No instance can take the request (e.g. a cluster with zero instances)."""
