"""All services in the current event loop (tests and quick runs): same apps, same wire protocol,
no processes to manage."""

from __future__ import annotations

from types import TracebackType

from aiohttp import web

from testbed.live import decode_node, prefill_node, router, sglang_pd, vllm_pd
from testbed.live.common import ServiceConfig, http_server_args
from testbed.live.deployment import Deployment


def make_service_app(dep: Deployment, node_id: str) -> web.Application:
    cfg = ServiceConfig(dep, node_id)
    if node_id == "router":
        return router.make_app(cfg)
    role = dep.nodes[node_id].role
    if dep.scenario.node_protocol == "vllm":
        return vllm_pd.make_prefill_app(cfg) if role == "prefill" else vllm_pd.make_decode_app(cfg)
    if dep.scenario.node_protocol == "sglang":
        return sglang_pd.make_prefill_app(cfg) if role == "prefill" else sglang_pd.make_decode_app(cfg)
    return prefill_node.make_app(cfg) if role == "prefill" else decode_node.make_app(cfg)


class InProcessBackend:
    def __init__(self, dep: Deployment, skip: frozenset[str] = frozenset()) -> None:
        self.dep = dep
        self.skip = skip  # services left down on purpose (failure tests)
        self._runners: list[web.AppRunner] = []
        self._by_id: dict[str, web.AppRunner] = {}

    async def __aenter__(self) -> Deployment:
        try:
            # Decode nodes first (they own the KV ports), the router last.
            order = sorted(self.dep.nodes, key=lambda n: self.dep.nodes[n].role != "decode") + ["router"]
            for nid in order:
                if nid in self.skip:
                    continue
                ep = self.dep.router if nid == "router" else self.dep.nodes[nid].http
                runner = web.AppRunner(
                    make_service_app(self.dep, nid),
                    access_log=None,
                    handler_cancellation=True,
                    **http_server_args(self.dep.scenario.serving.idle_timeout_s),
                )
                await runner.setup()
                self._runners.append(runner)
                self._by_id[nid] = runner
                for host in self.dep.http_binds(nid):
                    await web.TCPSite(runner, host, ep.port).start()
        except BaseException:
            await self.close()
            raise
        return self.dep

    async def stop_service(self, node_id: str) -> None:
        """Stop one service as a crash looks from outside (tests): every connection it holds is
        reset at once, nothing is answered any more."""
        runner = self._by_id.pop(node_id)
        self._runners.remove(runner)
        server = runner.server
        for conn in list(server.connections) if server is not None else []:
            if conn.transport is not None:
                conn.transport.abort()
        await runner.cleanup()

    async def close(self) -> None:
        while self._runners:
            await self._runners.pop().cleanup()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
