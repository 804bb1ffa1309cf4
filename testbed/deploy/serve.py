"""`testbed serve ROLE`: run one service of a deployment (what every backend starts)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

SHUTDOWN_GRACE_S = 2.0


def cmd_serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from testbed.deploy.inproc import make_service_app
    from testbed.live.common import http_server_args
    from testbed.live.deployment import Deployment

    dep = Deployment.read(Path(args.deployment))
    routes = list(args.route)
    if args.discover:
        from testbed.deploy.discovery import discover

        dep, found = discover(dep, args.id, args.discover)
        routes += found
    ep = dep.router if args.id == "router" else dep.nodes[args.id].http
    if routes:
        from testbed.net.routes import add_routes

        add_routes(routes)
    if args.id == "router" and dep.scenario.router.kind != "testbed":
        from testbed.deploy.foreign_router import exec_router

        exec_router(dep)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {args.id} %(name)s %(levelname)s %(message)s", force=True
    )
    app = make_service_app(dep, args.id)
    if args.serve_files and dep.run_dir:
        from testbed.deploy.discovery import add_file_routes

        add_file_routes(app, Path(dep.run_dir))
    # SIGTERM stops the service: requests still held get SHUTDOWN_GRACE_S, not aiohttp's 60 s.
    # handler_cancellation: a client that leaves cancels its request here (and, through the
    # router's cleanup, at every node it reached).
    web.run_app(
        app,
        host=dep.http_binds(args.id),
        port=ep.port,
        print=None,
        access_log=None,
        shutdown_timeout=SHUTDOWN_GRACE_S,
        handler_cancellation=True,
        **http_server_args(dep.scenario.serving.idle_timeout_s),
    )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("serve", help="run one service of a deployment (used by the deploy backends)")
    s.add_argument("role", choices=["router", "prefill", "decode"], help="which service this process is")
    s.add_argument(
        "--deployment", required=True, help="the deployment file the backend wrote (every service reads the same)"
    )
    s.add_argument("--id", required=True, help="this instance's id in the deployment file")
    s.add_argument(
        "--route",
        action="append",
        default=[],
        metavar="CIDR=GATEWAY",
        help="add a route first (containers: other datacenters via the WAN router)",
    )
    s.add_argument(
        "--discover",
        metavar="URL",
        help="register this service's address with the registry at URL and wait for every other "
        "service's (swarm: the WAN router), then route the other datacenters through it",
    )
    s.add_argument(
        "--serve-files",
        action="store_true",
        help="also answer GET /testbed/files[/PATH] with the files written under the run directory",
    )
    s.set_defaults(func=cmd_serve)
