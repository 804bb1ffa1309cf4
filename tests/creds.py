"""Headers a test client sends to a deployment: the API key the router asks of OpenAI clients,
and the run secret the nodes' routes and the router's control routes ask of the deployment's
own parts (a test stands in for both)."""

from __future__ import annotations

from testbed.live.deployment import Deployment


def headers(dep: Deployment) -> dict[str, str]:
    return {**dep.credentials.client_headers(), **dep.credentials.runner_headers()}
