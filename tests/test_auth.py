"""Who gets in: the router's OpenAI routes only with the deployment's API key (as the `openai`
package sends it), its hold route and the nodes' routes only with the run secret; /health and
/metrics open. The credentials reach a service through its environment, never its command line."""

from __future__ import annotations

import os
from pathlib import Path

import aiohttp
import pytest

from testbed.config.scenarios import load_scenario
from testbed.core.errors import UserError
from testbed.deploy.inproc import InProcessBackend
from testbed.deploy.plan import loopback_deployment
from testbed.live.credentials import (
    API_KEY_ENV,
    RUN_SECRET_ENV,
    SECRET_HEADER,
    Credentials,
)
from testbed.live.deployment import Deployment
from testbed.live.held import HOLD_KEY, HOLD_PATH
from testbed.run.load import resolve

BODY = {"model": "kimi-linear-1t", "prompt": "hello", "max_tokens": 2}


def _dep(tmp: Path | None = None) -> Deployment:
    sc = load_scenario("paper-prfaas", {"scale": {"speedup": 40, "byte_scale": 1024}})
    return loopback_deployment(resolve(sc), str(tmp) if tmp else None)


@pytest.mark.app
async def test_the_router_answers_401_without_the_key_and_200_with_it(tmp_path: Path) -> None:
    dep = _dep(tmp_path)
    dep.extra[HOLD_KEY] = {"records": "records.csv"}
    (tmp_path / "timeseries").mkdir()
    key = dep.credentials.api_key
    async with InProcessBackend(dep) as d, aiohttp.ClientSession() as s:
        url = d.router.url
        for headers, code in (
            ({}, None),
            ({"Authorization": "Bearer wrong"}, "invalid_api_key"),
            ({"Authorization": key}, None),  # no scheme
            ({"Authorization": f"Basic {key}"}, None),
            ({"Authorization": f"Bearer {key}x"}, "invalid_api_key"),
            ({"api-key": key}, None),
        ):  # Azure's header: not taken
            for method, path in (
                ("POST", "/v1/completions"),
                ("POST", "/v1/chat/completions"),
                ("GET", "/v1/models"),
                ("POST", "/v1/nope"),
            ):
                async with s.request(method, url + path, json=BODY, headers=headers) as r:
                    body = await r.json()
                    assert r.status == 401, (headers, path)
                    assert r.headers["WWW-Authenticate"].startswith("Bearer")
                    assert set(body["error"]) == {"message", "type", "param", "code"}
                    assert body["error"]["code"] == code and "Authorization: Bearer" in body["error"]["message"]
                    assert key not in body["error"]["message"]
        async with s.post(url + "/v1/completions", json=BODY, headers={"Authorization": f"bearer {key}"}) as r:
            assert r.status == 200, await r.text()
        for path in ("/health", "/metrics", "/version", "/testbed/info"):  # open, as on vLLM
            async with s.get(url + path) as r:
                assert r.status == 200, path
        # The hold's t0: the run secret, not the API key.
        for headers in ({}, d.credentials.client_headers(), {SECRET_HEADER: "guess"}):
            async with s.post(url + HOLD_PATH, json={"t0": 1.0}, headers=headers) as r:
                assert r.status == 403, headers
        async with s.post(url + HOLD_PATH, json={"t0": 1.0}, headers=d.credentials.runner_headers()) as r:
            assert r.status == 200


@pytest.mark.app
async def test_the_openai_package_gets_in_with_the_key_and_is_refused_without(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    dep = _dep()
    async with InProcessBackend(dep) as d:
        good = openai.AsyncOpenAI(base_url=f"{d.router.url}/v1", api_key=d.credentials.api_key, max_retries=0)
        bad = openai.AsyncOpenAI(base_url=f"{d.router.url}/v1", api_key="sk-not-this-one", max_retries=0)
        try:
            out = await good.completions.create(model="kimi-linear-1t", prompt="hi", max_tokens=3)
            assert out.usage is not None and out.usage.completion_tokens == 3
            with pytest.raises(openai.AuthenticationError) as e:
                await bad.completions.create(model="kimi-linear-1t", prompt="hi", max_tokens=3)
            assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        finally:
            await good.close()
            await bad.close()


@pytest.mark.pure
def test_credentials_come_from_the_environment_and_never_from_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    a, b = Credentials.new(), Credentials.new()
    assert a.api_key != b.api_key and a.run_secret != b.run_secret and len(a.run_secret) >= 32
    assert a.run_secret not in repr(a) and a.api_key not in repr(a)
    dep = _dep(tmp_path)
    text = dep.to_json()
    assert dep.credentials.api_key not in text and dep.credentials.run_secret not in text
    dep.write(tmp_path / "deployment.json")
    for var in (API_KEY_ENV, RUN_SECRET_ENV):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(UserError, match=f"{API_KEY_ENV} and {RUN_SECRET_ENV} not set"):
        Deployment.read(tmp_path / "deployment.json")
    for var, value in dep.credentials.env().items():
        monkeypatch.setenv(var, value)
    assert Deployment.read(tmp_path / "deployment.json").credentials == dep.credentials
    monkeypatch.setenv(API_KEY_ENV, "my key")
    with pytest.raises(UserError, match="printable ASCII"):
        Credentials.new()
    monkeypatch.setenv(API_KEY_ENV, "sk-given")
    assert Credentials.new().api_key == "sk-given"


@pytest.mark.app
async def test_local_services_get_the_credentials_by_environment_not_argv(tmp_path: Path) -> None:
    """What `ps` shows every user of the host: no key or secret on a service's command line."""
    from testbed.deploy.local import LocalBackend

    dep = _dep(tmp_path)
    (tmp_path / "timeseries").mkdir()
    async with LocalBackend(dep, tmp_path) as d, aiohttp.ClientSession() as s:
        c = d.credentials
        for key, p in service_pids(d, tmp_path).items():
            argv = Path(f"/proc/{p}/cmdline").read_bytes().decode()
            assert c.api_key not in argv and c.run_secret not in argv, key
            environ = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
            assert f"{RUN_SECRET_ENV}={c.run_secret}".encode() in environ
            assert os.stat(f"/proc/{p}/environ").st_mode & 0o004 == 0  # not world-readable
        async with s.post(d.router.url + "/v1/completions", json=BODY, headers=c.client_headers()) as r:
            assert r.status == 200, await r.text()
        async with s.post(d.router.url + "/v1/completions", json=BODY) as r:
            assert r.status == 401


def service_pids(dep: Deployment, run_dir: Path) -> dict[str, int]:
    """The service processes of a local run: those whose command line names its deployment file."""
    want = str(run_dir / "deployment.json").encode()
    out: dict[str, int] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if want in argv and b"--id" in argv:
            out[argv[argv.index(b"--id") + 1].decode()] = int(p.name)
    assert set(out) == {"router", *dep.nodes}, out
    return out
