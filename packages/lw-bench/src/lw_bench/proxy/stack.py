"""The processes ``lw-bench proxy`` and its soak start: mock vLLM servers (aiohttp, in a child
process that lives until its pipe closes) and ``lw-proxy`` itself, served in its own process
through lw-proxy's public entry (``lw_proxy.cli.serve``), plus the wait for it to answer."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import unused_port

from lw_proxy.config import ProxyConfig

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def serve_mocks(handlers: Sequence[Handler]) -> tuple[list[int], list[web.AppRunner]]:
    """One mock vLLM server per handler on 127.0.0.1 (free ports): POST /v1/completions, GET /health."""

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    ports, runners = [], []
    for handler in handlers:
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        ports.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        runners.append(runner)
    return ports, runners


def wait_closed(conn: Any) -> None:
    """Block until the other end of ``conn`` (a multiprocessing pipe) closes."""
    with contextlib.suppress(EOFError, OSError):
        conn.recv()


def stop_stack(parent_end: Any, procs: Sequence[Any]) -> None:
    """Close the mocks' control pipe and stop the proxy and mock processes (``None``: not started)."""
    parent_end.close()
    for p in procs:
        if p is not None:
            p.terminate()
            p.join(5)


def proxy_main(cfg: ProxyConfig, event_loop: str = "auto") -> None:
    """A child process's target: serve ``cfg`` until terminated."""
    import logging

    from lw_proxy.cli import serve

    logging.basicConfig(level="WARNING")
    serve(cfg, event_loop=event_loop)


def free_port() -> int:
    return unused_port()


async def wait_ready(url: str, deadline_s: float = 30.0) -> None:
    """Poll ``url`` until it answers (200, 404 or 405); RuntimeError after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status in (200, 404, 405):
                        return
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"{url} did not come up within {deadline_s:g} s")
            await asyncio.sleep(0.1)
