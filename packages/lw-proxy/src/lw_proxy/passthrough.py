"""Endpoints that any backend answers the same way (the model list, the tokenizer), passed through
as-is so that clients such as vLLM's benchmark client (``python -m vllm.benchmarks.serve``) can
align their prompts through the proxy. Decoders are asked first (they serve the client's answers),
then prefillers; a backend that cannot be reached or answers 502/503/504 is skipped."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from .errors import ProxyError
from .proxy import Proxy
from .upstream import RETRY_STATUSES, UPSTREAM_ERRORS

# path -> method, as vLLM's OpenAI server serves them
PASSTHROUGH = {"/v1/models": "GET", "/tokenize": "POST", "/detokenize": "POST"}
# Copied from the backend's answer; hop-by-hop and length headers are aiohttp's to set.
_KEEP_HEADERS = ("Content-Type",)


async def forward(proxy: Proxy, request: web.Request, body: bytes | None) -> web.Response:
    timeout = aiohttp.ClientTimeout(total=proxy.cfg.connect_timeout + 30, sock_connect=proxy.cfg.connect_timeout)
    backends = [b for pool in (proxy.decoders, proxy.prefillers) for b in pool.backends]
    backends.sort(key=lambda b: not b.healthy)  # healthy ones first, decoders before prefillers
    last = "no backend configured"
    for b in backends:
        try:
            async with proxy.client().request(request.method, b.url + request.path, data=body,
                                               headers=proxy.headers, timeout=timeout) as r:
                data = await r.read()
                if r.status in RETRY_STATUSES:
                    last = f"{b.url}: HTTP {r.status}"
                    continue
                headers = {k: r.headers[k] for k in _KEEP_HEADERS if k in r.headers}
                return web.Response(status=r.status, body=data, headers=headers)
        except UPSTREAM_ERRORS as e:
            last = f"{b.url}: {e!r}"
    raise ProxyError(502, f"no backend answered {request.method} {request.path}; last error: {last}",
                     kind="upstream")
