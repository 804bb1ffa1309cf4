"""The I/O-free core: request lifecycle, service-time and KV models, queues and batching, the
hybrid prefix cache, routing policies and the bandwidth controller, the KV frame codec and
transfer state machines, the scenario schema. Takes `now` as an argument; imports nothing of
the package outside `core` and never asyncio, socket, time or aiohttp."""
