"""What a deployment's services trust: the API key its router asks of clients and the run secret
its own parts (the router, the runner) show the nodes' and the router's control routes.

Both are made per deployment (`Credentials.new`); a key the user gives (`--api-key`, which sets
TESTBED_API_KEY, or that variable itself) is used instead of a made one. They reach the services
a backend starts through the environment (`env()`, read back by `from_env()`): never on a command
line, where `ps` shows them to every user, and never in the run directory's shared files.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from testbed.core.errors import UserError

API_KEY_ENV = "TESTBED_API_KEY"
RUN_SECRET_ENV = "TESTBED_RUN_SECRET"
SECRET_HEADER = "X-Testbed-Secret"
API_KEY_FILE = "api-key"  # a held deployment's key, in its run directory (mode 0600)


@dataclass(frozen=True)
class Credentials:
    api_key: str
    run_secret: str

    def __repr__(self) -> str:  # never in a log or a traceback
        return "Credentials(...)"

    @classmethod
    def new(cls, api_key: str | None = None) -> Credentials:
        """A fresh run secret; the API key given, else TESTBED_API_KEY, else a fresh one."""
        import secrets  # here: a simulated replay imports this module for its checks alone

        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or "tb-" + secrets.token_urlsafe(24)
        check_api_key(key)
        return cls(key, secrets.token_urlsafe(32))

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Credentials:
        """What a deploy backend gave a service (`testbed serve`)."""
        missing = [v for v in (API_KEY_ENV, RUN_SECRET_ENV) if not env.get(v)]
        if missing:
            raise UserError(
                f"{' and '.join(missing)} not set: a service takes its deployment's API key and run "
                "secret from the environment its deploy backend gives it (export both to start one "
                "by hand)"
            )
        check_api_key(env[API_KEY_ENV])
        return cls(env[API_KEY_ENV], env[RUN_SECRET_ENV])

    def env(self) -> dict[str, str]:
        """The environment variables that carry these to a service."""
        return {API_KEY_ENV: self.api_key, RUN_SECRET_ENV: self.run_secret}

    def client_headers(self) -> dict[str, str]:
        """What an OpenAI client sends (the `openai` package: `Authorization: Bearer KEY`)."""
        return {"Authorization": f"Bearer {self.api_key}"}

    def runner_headers(self) -> dict[str, str]:
        """What the deployment's own parts send to a control route."""
        return {SECRET_HEADER: self.run_secret}


def check_api_key(key: str) -> None:
    """An API key must fit in an HTTP header as a Bearer token: printable ASCII, no spaces."""
    if not key or len(key) > 256 or not all(33 <= ord(c) < 127 for c in key):
        raise UserError(
            f"API key: give 1-256 printable ASCII characters without spaces (from --api-key or {API_KEY_ENV})"
        )
