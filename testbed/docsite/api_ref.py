"""The HTTP reference: every route of the router and of the prefill and decode nodes, read from
the aiohttp applications their factories build (`make_app`) for the paper's PrfaaS scenario, with
each handler's docstring or, where it has none, the reference's own words."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from testbed.docsite.markdown import table

# Words for handlers without a docstring, keyed by (service, method, path).
ROUTE_NOTES: dict[tuple[str, str, str], str] = {
    ("router", "POST", "/v1/completions"): "OpenAI completions; `stream: true` answers with server-sent events.",
    ("router", "POST", "/v1/chat/completions"): "OpenAI chat completions; `stream: true` answers with server-sent "
    "events.",
    ("router", "POST", "/v1/responses"): "OpenAI Responses API; streaming sends its own events "
    "(`response.created` ... `response.completed`).",
    ("router", "GET", "/v1/models"): "The served model (the scenario's `model.name`).",
    ("*", "GET", "/health"): '`{"status": "ok"}` while the service runs: what the router\'s probes and the '
    "backends' health checks ask.",
    ("*", "GET", "/metrics"): "Prometheus exposition, vLLM v0.12's names, types, labels and buckets, plus "
    "`testbed_*` series.",
    ("prefill", "POST", "/prefill"): "Queue a prefill (the router's call): modelled compute, then the KV streamed "
    "layer by layer to the decode node.",
    ("prefill", "GET", "/status"): "Queue depth, running prefill, cache pool use.",
    ("decode", "POST", "/decode"): "Admit a request whose KV has arrived (or will) and stream its tokens back.",
    ("decode", "GET", "/status"): "Sequences running and waiting, BS_max, KV memory used and capacity (the "
    "long-term loop reads it).",
}


@dataclass(frozen=True)
class Route:
    service: str
    method: str
    path: str
    handler: str
    doc: str


def _doc(service: str, method: str, path: str, handler: Callable[..., object]) -> str:
    doc = inspect.getdoc(handler) or ""
    if doc:
        text = " ".join(doc.split("\n\n")[0].split())
        # "GET /path: what it does" -> "what it does"
        return re.sub(r"^(GET|POST|PUT|DELETE)\s+\S+:\s*", "", text)
    for key in ((service, method, path), ("*", method, path)):
        if key in ROUTE_NOTES:
            return ROUTE_NOTES[key]
    return ""


def _apps() -> list[tuple[str, web.Application]]:
    from testbed.config.scenarios import load_scenario
    from testbed.deploy.plan import loopback_deployment
    from testbed.live import decode_node, prefill_node
    from testbed.live.common import ServiceConfig
    from testbed.live.router.app import make_app
    from testbed.run.load import resolve

    dep = loopback_deployment(resolve(load_scenario("paper-prfaas")), None)
    return [
        ("router", make_app(ServiceConfig(dep, "router"))),
        ("prefill", prefill_node.make_app(ServiceConfig(dep, "pd-p0"))),
        ("decode", decode_node.make_app(ServiceConfig(dep, "pd-d0"))),
    ]


def routes() -> list[Route]:
    """Every route of every service, HEAD left out (aiohttp adds one to each GET)."""
    from testbed.live.held import HOLD_PATH, post_hold

    out: list[Route] = []
    for service, app in _apps():
        for r in app.router.routes():
            if r.method == "HEAD":
                continue
            path = r.resource.canonical if r.resource is not None else ""
            h = r.handler
            out.append(Route(service, r.method, path, f"{h.__module__}.{h.__name__}", _doc(service, r.method, path, h)))
    # Only a held deployment's router has it (`testbed up --hold`).
    out.append(
        Route(
            "router (held)",
            "POST",
            HOLD_PATH,
            f"{post_hold.__module__}.{post_hold.__name__}",
            _doc("router", "POST", HOLD_PATH, post_hold),
        )
    )
    return out


def page() -> str:
    rs = routes()
    out = [
        "# HTTP API",
        "",
        "Every route of the testbed's services, read from the aiohttp applications their factories build, "
        "so this list is complete for this version. Clients talk to the router; the nodes' routes are the "
        "router's own calls (and the fault injector's). What the OpenAI-style routes accept and answer, and "
        "how failures, limits and deadlines work: [The router's OpenAI API](../guides/openai-api.md). "
        "Who may call what: the router's `/v1/` routes need the deployment's API key "
        "(`Authorization: Bearer KEY`, else 401); every node route but `/health` and `/metrics`, and the "
        "router's `/testbed/hold`, need the run secret (header `X-Testbed-Secret`, else 403), which only "
        "the router and the runner hold ([API key](../guides/openai-api.md#api-key)).",
        "",
    ]
    for title, keep in (
        ("Router", lambda r: r.service.startswith("router")),
        ("Prefill and decode nodes", lambda r: not r.service.startswith("router")),
    ):
        out += [
            f"## {title}",
            "",
            table(
                ("service", "method", "path", "what it does", "handler"),
                [(r.service, r.method, f"`{r.path}`", r.doc, f"`{r.handler}`") for r in rs if keep(r)],
            ),
            "",
        ]
    return "\n".join(out) + "\n"
