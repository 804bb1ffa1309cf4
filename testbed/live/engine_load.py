"""GET /get_load as SGLang serves it, which both routers' power_of_two policies poll (recorded
from sglang-router 0.3.2 and vllm-router 0.1.17): one entry per data-parallel rank."""

from __future__ import annotations

from aiohttp import web

from testbed.live import decode_node, prefill_node


def add_load_route(app: web.Application, role: str) -> None:
    async def load(request: web.Request) -> web.Response:
        if role == "prefill":
            st = request.app[prefill_node.STATE]
            waiting = st.loop.queue.depth
            reqs = waiting + len(st.running)
        else:
            b = request.app[decode_node.STATE].batch
            waiting = len(b.waiting)
            reqs = waiting + len(b.running)
        return web.json_response([{"dp_rank": 0, "num_reqs": reqs, "num_waiting_reqs": waiting, "num_tokens": 0}])

    app.router.add_get("/get_load", load)
