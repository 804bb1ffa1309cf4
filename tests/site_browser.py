"""The built documentation site in headless Chromium, from file:// (or any URL): a sidebar link
opens its page (not a directory listing) and search answers a query offline. Prints one line per
check and exits 1 when one fails. Not a pytest test (CI has no browser); `make docs-check` runs it.

    python tests/site_browser.py [--site build/site] [--query mooncake --expect guides/traces.html]

Chromium is driven over the DevTools protocol (aiohttp's websocket client; no extra package)."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Page:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws, self.seq = ws, 0

    async def call(self, method: str, **params: Any) -> Any:
        self.seq += 1
        await self.ws.send_json({"id": self.seq, "method": method, "params": params})
        while True:
            msg = json.loads((await self.ws.receive()).data)
            if msg.get("id") == self.seq:
                return msg.get("result", {})

    async def js(self, expr: str) -> Any:
        r = await self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        return r.get("result", {}).get("value")

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'")

    async def wait_for(self, expr: str, timeout: float = 20.0) -> Any:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            v = await self.js(expr)
            if v:
                return v
            await asyncio.sleep(0.2)
        return None


RESULTS = (
    "Array.from(document.querySelectorAll('.md-search-result__item > a'))"
    ".map(a => new URL(a.href).pathname + ' | ' + (a.querySelector('h1') || a).textContent.trim())"
)


async def check(base: str, query: str, expect: str, link: str) -> list[tuple[bool, str]]:
    chrome = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chrome is None:
        return [(False, "no chromium on PATH (apt-get install chromium)")]
    port, profile = _free_port(), tempfile.mkdtemp(prefix="site-browser-")
    proc = subprocess.Popen(
        [
            chrome,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--user-data-dir={profile}",
            f"--remote-debugging-port={port}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    out: list[tuple[bool, str]] = []
    try:
        async with aiohttp.ClientSession() as http:
            targets: list[dict[str, Any]] = []
            for _ in range(100):
                try:
                    async with http.get(f"http://127.0.0.1:{port}/json") as r:
                        targets = [t for t in await r.json() if t["type"] == "page"]
                    if targets:
                        break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
            async with http.ws_connect(targets[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                page = Page(ws)
                await page.call("Page.enable")
                await page.goto(f"{base}/index.html")
                href = await page.js(f"(document.querySelector('nav.md-nav a[href$=\"{link}\"]') || {{}}).href || ''")
                if not href:
                    out.append((False, f"sidebar: no link to {link} on index.html"))
                else:
                    await page.goto(href)
                    title = await page.js("document.title")
                    listing = await page.js(
                        "document.title.startsWith('Index of') || !document.querySelector('.md-content')"
                    )
                    out.append(
                        (
                            not listing and bool(title),
                            f"sidebar link {link} opens {await page.js('location.href')}: {title!r}",
                        )
                    )
                await page.goto(f"{base}/index.html?q={query}")
                got = await page.wait_for(f"(() => {{ const r = {RESULTS}; return r.length ? r : null; }})()")
                results: list[str] = got or []
                first = results[0] if results else "(no results)"
                out.append(
                    (
                        bool(results) and results[0].split(" | ")[0].endswith(expect),
                        f"search {query!r}: {len(results)} results, first {first}",
                    )
                )
                for i, r in enumerate(results[:5], 1):
                    print(f"  {i}. {r}")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(profile, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--site", default="build/site", help="the built site's directory (default build/site)")
    ap.add_argument("--url", help="a base URL to test instead of file://SITE (e.g. http://127.0.0.1:8000)")
    ap.add_argument("--query", default="mooncake", help="the search query (default mooncake)")
    ap.add_argument("--expect", default="guides/traces.html", help="the page search must rank first")
    ap.add_argument("--link", default="guides/traces.html", help="the sidebar link to open")
    a = ap.parse_args()
    base = a.url.rstrip("/") if a.url else Path(a.site).resolve().as_uri()
    results = asyncio.run(check(base, a.query, a.expect, a.link))
    for ok, line in results:
        print(("ok    " if ok else "FAIL  ") + line)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
