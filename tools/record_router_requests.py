"""Record what a real PD router sends its workers: two stand-in workers on loopback (answering
as vLLM's NixlConnector or SGLang would, just enough for the router to go on) log every request;
the router under test is started against them, sent a completion and a chat completion, and the
recorded requests are written as JSON (tests/fixtures/routers/<router>.json). Run it again when
a router's version changes: `python tools/record_router_requests.py vllm-router|sglang-router`
with the routers extra installed."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web

POLICY = os.environ.get("ROUTER_POLICY", "round_robin")
FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "routers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(role: str, log: list[dict[str, object]], kv_port: int) -> web.Application:
    async def any_route(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        hdrs = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        log.append({"worker": role, "method": request.method, "path": request.path, "headers": hdrs, "body": body})
        p = request.path
        if p == "/health":
            return web.Response(text="")
        if p == "/metrics":
            return web.Response(text="vllm:num_requests_running 0\n")
        if p in ("/server_info", "/get_server_info"):
            return web.json_response({"disaggregation_mode": role, "model_path": "mock"})
        if p in ("/model_info", "/get_model_info"):
            return web.json_response({"model_path": "mock", "is_generation": True})
        if p == "/get_load":
            return web.json_response([{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}])
        if p == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "mock", "object": "model"}]})
        assert isinstance(body, dict)
        ktp = None
        if role == "prefill" and isinstance(body.get("kv_transfer_params"), dict):
            ktp = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": "p0",
                "remote_block_ids": [0],
                "remote_request_id": "r",
                "remote_host": "127.0.0.1",
                "remote_port": kv_port,
                "tp_size": 1,
            }
        chat = p.endswith("/chat/completions")
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            ch = {"delta": {"content": "x"}} if chat else {"text": "x"}
            obj = "chat.completion.chunk" if chat else "text_completion"
            for fin in (None, "length"):
                ev = {
                    "id": "c",
                    "object": obj,
                    "created": 0,
                    "model": "mock",
                    "choices": [{"index": 0, **ch, "finish_reason": fin}],
                }
                await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if p == "/generate":
            return web.json_response(
                {
                    "text": "x",
                    "meta_info": {
                        "id": "c",
                        "finish_reason": {"type": "length"},
                        "prompt_tokens": 1,
                        "completion_tokens": 1,
                    },
                }
            )
        choice = {"index": 0, "finish_reason": "length"}
        choice |= {"message": {"role": "assistant", "content": "x"}} if chat else {"text": "x"}
        out: dict[str, object] = {
            "id": "c",
            "object": "chat.completion" if chat else "text_completion",
            "created": 0,
            "model": "mock",
            "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        if ktp is not None:
            out["kv_transfer_params"] = ktp
        return web.json_response(out)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_route)
    return app


async def record(router: str) -> list[dict[str, object]]:
    log: list[dict[str, object]] = []
    runners = []
    ports = {}
    for role in ("prefill", "decode"):
        r = web.AppRunner(worker(role, log, 17777))
        await r.setup()
        ports[role] = free_port()
        await web.TCPSite(r, "127.0.0.1", ports[role]).start()
        runners.append(r)
    rport, prom = free_port(), free_port()
    P, D = f"http://127.0.0.1:{ports['prefill']}", f"http://127.0.0.1:{ports['decode']}"
    venv_bin = Path(os.environ.get("ROUTERS_BIN", Path(sys.executable).parent))
    if router == "vllm-router":
        exe = shutil.which("vllm-router", path=str(venv_bin)) or "vllm-router"
        argv = [
            exe,
            "--vllm-pd-disaggregation",
            "--prefill",
            P,
            "--decode",
            D,
            "--policy",
            POLICY,
            "--host",
            "127.0.0.1",
            "--port",
            str(rport),
            "--prometheus-port",
            str(prom),
            "--prometheus-host",
            "127.0.0.1",
            "--api-key",
            "KEY",
        ]
    else:
        argv = [
            str(venv_bin / "python"),
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            "--prefill",
            P,
            "8998",
            "--decode",
            D,
            "--policy",
            POLICY,
            "--host",
            "127.0.0.1",
            "--port",
            str(rport),
            "--prometheus-port",
            str(prom),
            "--prometheus-host",
            "127.0.0.1",
            "--api-key",
            "KEY",
        ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{rport}"
    try:
        async with aiohttp.ClientSession() as s:
            deadline = time.monotonic() + 60
            while True:
                try:
                    async with s.get(f"{url}/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit(f"{router} did not come up")
                await asyncio.sleep(0.3)
            startup = len(log)
            h = {"Authorization": "Bearer KEY"}
            reqs = [
                ("/v1/completions", {"model": "mock", "prompt": "hello world", "max_tokens": 4, "stream": True}),
                ("/v1/completions", {"model": "mock", "prompt": "hello world", "max_tokens": 4}),
                (
                    "/v1/chat/completions",
                    {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
                ),
            ]
            if router == "sglang-router":
                reqs.append(("/generate", {"text": "hello world", "sampling_params": {"max_new_tokens": 4}}))
            answers = []
            for path, body in reqs:
                async with s.post(url + path, json=body, headers=h) as r:
                    answers.append({"path": path, "status": r.status, "body": (await r.read()).decode()[:400]})
    finally:
        proc.terminate()
        proc.wait(10)
        for r in runners:
            await r.cleanup()
    out = [dict(e, phase="startup" if i < startup else "request") for i, e in enumerate(log)]
    return out + [{"phase": "client", "answers": answers}]


def main() -> None:
    router = sys.argv[1]
    rec = asyncio.run(record(router))
    FIXTURES.mkdir(parents=True, exist_ok=True)
    path = FIXTURES / (f"{router}.json" if POLICY == "round_robin" else f"{router}-{POLICY}.json")
    path.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"{path}: {len(rec) - 1} requests recorded")


if __name__ == "__main__":
    main()
