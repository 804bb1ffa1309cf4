"""Routing policies and what they read: the policy registry, load-aware routing, the load
tracker, the cache book and the hybrid prefix cache."""
