"""Asyncio/aiohttp drivers of the core: the router, prefill and decode node services, the TCP KV
transport, the replayer client. May import core, config, model, traces and metrics; never
deploy, studies or cli."""
