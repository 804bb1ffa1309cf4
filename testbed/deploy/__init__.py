"""Backends that start a scenario's services: local processes, in-process, network namespaces,
Docker Compose and Swarm; `testbed serve` and cleanup of what a killed run left. May import
every layer below; never studies or cli."""
