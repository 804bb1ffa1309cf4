"""Address discovery where addresses are not static (Docker Swarm), and file export over HTTP.

A swarm gives each task an address of its own choosing, and a task resolves the names of
services only on networks it is attached to, and only once they are healthy. A node cannot
become healthy before it knows where the others are, so names are no way to find them. Instead
every service registers its own address with the WAN router, the one service attached to every
datacenter network, and waits until all have:

    POST /testbed/register {"id", "address"}   the service's address on its DC network (its source
                                               address towards the WAN router)
    GET  /testbed/addresses -> 503 {"missing"} until all have registered, then 200
         {"hosts": {id: ip}, "gateways": {dc: the WAN router's ip there}, "subnets": {dc: cidr}}

then rewrites its deployment's endpoints and routes the other datacenters' subnets through the
WAN router's address on its own network. `Deployment.extra["discovery"]` carries who belongs to
which DC and the DC subnets (fixed by the stack file's network `ipam`).

Files: with no shared file system across hosts, each service answers GET /testbed/files (the
files under its run directory) and GET /testbed/files/PATH, so the host pulls them at the end.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict
from urllib.parse import urlsplit

from aiohttp import web

from testbed.core.json_types import JSONObject, JSONValue
from testbed.live.deployment import Deployment, Endpoint

REGISTER = "/testbed/register"
ADDRESSES = "/testbed/addresses"
FILES = "/testbed/files"
EXTRA_KEY = "discovery"
POLL_S = 0.5


class Addresses(TypedDict):
    """GET /testbed/addresses once every service has registered."""

    hosts: dict[str, str]  # service id -> its address
    gateways: dict[str, str]  # datacenter -> the WAN router's address on it
    subnets: dict[str, str]  # datacenter -> CIDR


@dataclass
class Registry:
    """Who is expected where, and who has registered which address (the WAN router's state)."""

    members: dict[str, str]  # service id -> datacenter
    subnets: dict[str, str]  # datacenter -> CIDR
    gateways: dict[str, str]  # datacenter -> the WAN router's address on it
    hosts: dict[str, str] = field(default_factory=dict)

    def register(self, sid: str, address: str) -> None:
        """Record sid's address; ValueError naming what is wrong (unknown id, foreign subnet)."""
        dc = self.members.get(sid)
        if dc is None:
            raise ValueError(f"unknown service {sid!r}")
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            raise ValueError(f"{sid}: {address!r} is not an IP address") from None
        if ip not in ipaddress.ip_network(self.subnets[dc]):
            raise ValueError(f"{sid}: {address} is outside {dc}'s subnet {self.subnets[dc]}")
        self.hosts[sid] = address

    def missing(self) -> list[str]:
        return sorted(s for s in self.members if s not in self.hosts)

    def view(self) -> Addresses:
        return {"hosts": dict(self.hosts), "gateways": dict(self.gateways), "subnets": dict(self.subnets)}


def add_registry_routes(app: web.Application, reg: Registry) -> None:
    async def register(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            reg.register(str(body["id"]), str(body["address"]))
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response({"ok": True, "missing": reg.missing()})

    async def addresses(request: web.Request) -> web.Response:
        missing = reg.missing()
        if missing:
            return web.json_response({"missing": missing}, status=503)
        return web.json_response(reg.view())

    app.router.add_post(REGISTER, register)
    app.router.add_get(ADDRESSES, addresses)


def _complete_lines(data: bytes) -> bytes:
    # Series are appended line by line while the service runs: never hand out half a line.
    return data[: data.rfind(b"\n") + 1] if data and not data.endswith(b"\n") else data


def add_file_routes(app: web.Application, root: Path) -> None:
    """GET /testbed/files: every regular file under root (relative paths); GET /testbed/files/PATH:
    one of them, up to its last complete line."""
    base = root.resolve()

    async def listing(request: web.Request) -> web.Response:
        files = sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file()) if base.is_dir() else []
        return web.json_response({"files": files})

    async def one(request: web.Request) -> web.Response:
        p = (base / request.match_info["path"]).resolve()
        if not p.is_relative_to(base) or not p.is_file():
            raise web.HTTPNotFound(text=f"no file {request.match_info['path']!r}")
        return web.Response(body=_complete_lines(p.read_bytes()), content_type="application/octet-stream")

    app.router.add_get(FILES, listing)
    app.router.add_get(FILES + "/{path:.+}", one)


# -- the service side ---------------------------------------------------------------------------


def with_hosts(dep: Deployment, hosts: dict[str, str]) -> Deployment:
    """The deployment with every listed service's endpoints moved to its host (ports kept)."""

    def moved(ep: Endpoint, sid: str) -> Endpoint:
        return Endpoint(hosts.get(sid, ep.host), ep.port)

    nodes = {
        k: dataclasses.replace(n, http=moved(n.http, k), kv=None if n.kv is None else moved(n.kv, k))
        for k, n in dep.nodes.items()
    }
    return dataclasses.replace(dep, router=moved(dep.router, "router"), nodes=nodes)


def routes_via_wan(dc: str, subnets: dict[str, str], gateways: dict[str, str]) -> list[str]:
    """`CIDR=GATEWAY` routes for every other datacenter through the WAN router's address in dc."""
    return [f"{net}={gateways[dc]}" for other, net in subnets.items() if other != dc]


def source_address(host: str, port: int) -> str:
    """The address this namespace sends from towards host (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def _http(method: str, url: str, body: JSONObject | None = None) -> tuple[int, JSONObject]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, _object(json.loads(r.read() or b"{}"), url)
    except urllib.error.HTTPError as e:
        return e.code, _object(json.loads(e.read() or b"{}"), url)


def _object(value: JSONValue, url: str) -> JSONObject:
    if not isinstance(value, dict):
        raise ValueError(f"{url}: reply is not a JSON object")
    return value


def _names(value: JSONValue, what: str) -> dict[str, str]:
    """`value` as a map of names to names (`what` says where it came from in an error)."""
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError(f"{what} is not a map of names to names: {value!r}")
    return {k: str(v) for k, v in value.items()}


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def discover(
    dep: Deployment, sid: str, url: str, timeout: float = 600.0, log: Callable[[str], None] = _stderr
) -> tuple[Deployment, list[str]]:
    """Register sid with the registry at url, wait for every other service; returns the resolved
    deployment and the routes to add. Retries while the registry is unreachable (its name
    resolves only once it is healthy)."""
    info = dep.extra.get(EXTRA_KEY)
    if not info:
        raise ValueError(f"the deployment has no extra[{EXTRA_KEY!r}]: it was not written for discovery")
    members = _names(info.get("members") if isinstance(info, dict) else None, f"extra[{EXTRA_KEY!r}]['members']")
    if sid not in members:
        raise ValueError(f"service {sid!r} is not in the deployment (members: {', '.join(sorted(members))})")
    dc = members[sid]
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 80
    deadline = time.monotonic() + timeout
    registered = False
    said = ""
    while True:
        try:
            if not registered:
                address = source_address(socket.gethostbyname(host), port)
                status, reply = _http("POST", url + REGISTER, {"id": sid, "address": address})
                if status != 200:
                    raise RuntimeError(f"registry at {url} refused {sid} at {address}: {reply.get('error', status)}")
                registered = True
                log(f"discovery: registered {sid} at {address} ({dc})")
            status, reply = _http("GET", url + ADDRESSES)
            if status == 200:
                break
            missing = reply.get("missing", [])
            note = f"waiting for {', '.join(str(m) for m in (missing if isinstance(missing, list) else []))}"
        except (OSError, urllib.error.URLError) as e:
            note = f"registry {url} not reachable yet ({e})"
        if note != said:
            log(f"discovery: {note}")
            said = note
        if time.monotonic() > deadline:
            raise TimeoutError(f"discovery: gave up after {timeout:g} s: {note}")
        time.sleep(POLL_S)
    where = f"{url}{ADDRESSES}"
    routes = routes_via_wan(
        dc, _names(reply.get("subnets"), f"{where} subnets"), _names(reply.get("gateways"), f"{where} gateways")
    )
    return with_hosts(dep, _names(reply.get("hosts"), f"{where} hosts")), routes
