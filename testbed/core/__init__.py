"""The I/O-free core, by topic: the scenario schema (`schema`), one instance's mechanics (`engine`),
routing policies and what they read (`routing`), the control loops (`control`), what the router
does per request (`router`), the KV wire protocol (`kv`); beside them the request's lifecycle and
record and the fault timeline. Takes `now` as an argument; imports nothing of the package outside
`core` and never asyncio, socket, time or aiohttp."""
