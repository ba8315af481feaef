"""HTTP surface of lw-proxy: routes, auth, body limits, metrics bookkeeping, lifecycle.

Run the app with ``handler_cancellation=True`` (``server.start`` does): a client that disconnects then
cancels its handler, which closes the upstream connection, which makes vLLM abort the request.

Auth: with an API key, generation and admin endpoints and ``/metrics`` need ``Authorization: Bearer
<key>`` (the scheme in any case), and metaserver calls need their parent's token; ``/healthcheck``
answers everyone (load balancers probe it), but only a caller with the key gets the backends' URLs and
loads, the others the bare status and counts. Without a key, the admin endpoint
(``/reset_prefix_cache``) is refused unless ``allow_unauthenticated_admin``.

Metaserver calls are judged by their header before their body is read (``ParentRegistry.token_refusal``):
a bearer token that is no open parent's (nor the key) is refused at once, and so is a call without one
when the proxy has a key; the refusal closes the connection when the body has not fully arrived. Their
body must then arrive whole within ``METASERVER_BODY_TIMEOUT`` (a decoder sends its ~100 bytes with the
headers), so no caller holds a connection by dribbling it. Past ``--max-client-connections`` (the
decoders' reserve on the client port) only calls carrying a valid token are served, with or without a
key: a connection without one never uses the reserve.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp
import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from lw_core.wire import (
    METASERVER_PATH,
    BackendFailure,
    BackendState,
    HealthcheckResponse,
    ResetPrefixCacheResponse,
    decode_metaserver_request,
)

from .auth import bearer, same_secret
from .backends import probe_loop
from .config import ProxyConfig
from .errors import ProxyError
from .passthrough import PASSTHROUGH, forward
from .proxy import Proxy
from .upstream import CHAT, COMPLETIONS, UPSTREAM_ERRORS
from .validate import ClientRequest, parse_chat, parse_completion

PROXY_KEY = web.AppKey("proxy", Proxy)
_MAX_METASERVER_BODY = 64 << 10
METASERVER_BODY_TIMEOUT = 5.0  # whole metaserver body, from the end of the headers (or --client-body-timeout if shorter)
_KNOWN = {COMPLETIONS: "POST", CHAT: "POST", "/v1/metaserver": "POST", "/healthcheck": "GET",
          "/reset_prefix_cache": "POST", "/metrics": "GET", **PASSTHROUGH}
_MAX_PASSTHROUGH_BODY = 4 << 20  # /tokenize of a long prompt; /v1/models has no body


async def read_body(request: web.Request, limit: int, idle: float, total: float | None = None) -> bytes:
    """The whole body, however it arrives (segments, chunked, after ``Expect: 100-continue``).

    413 past ``limit`` bytes; 400 when the client sends nothing for ``idle`` seconds before the body
    is complete, when the whole body takes longer than ``total`` seconds (None: no such bound), or when
    the client ends it early (fewer bytes than its Content-Length, a broken chunked encoding)."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise ProxyError(413, f"request body of {declared} bytes exceeds the limit of {limit} (--max-body-bytes)")
    buf = bytearray()
    content = request.content
    loop = asyncio.get_running_loop()
    end = None if total is None else loop.time() + total
    try:
        while True:
            async with asyncio.timeout(idle if end is None else min(idle, end - loop.time())):
                chunk = await content.readany()
            if not chunk:
                break
            buf += chunk
            if len(buf) > limit:
                raise ProxyError(413, f"request body exceeds the limit of {limit} bytes (--max-body-bytes)")
    except TimeoutError:
        want = f" of the {declared} announced" if declared is not None else ""
        if end is not None and loop.time() >= end:
            raise ProxyError(400, f"request body incomplete: {len(buf)} bytes{want} arrived in {total:g} s, the "
                             "deadline for this endpoint's whole body") from None
        raise ProxyError(400, f"request body incomplete: {len(buf)} bytes{want} arrived, then nothing for "
                         f"{idle:g} s (--client-body-timeout)") from None
    except (aiohttp.ClientPayloadError, asyncio.IncompleteReadError, HttpProcessingError, ValueError) as e:
        want = f" of the {declared} announced" if declared is not None else ""
        raise ProxyError(400, f"request body incomplete: the client ended it after {len(buf)} bytes{want} "
                         f"({e})") from None
    return bytes(buf)


RESET_FLAGS = ("reset_running_requests", "reset_external")  # vLLM's /reset_prefix_cache query


def reset_query(request: web.Request) -> dict[str, str]:
    """The flags of vLLM's ``/reset_prefix_cache`` the client gave (``reset_external=true`` also
    clears each engine's connector cache: the pool's objects of its model), passed on to every
    engine; anything else is a 400 naming it."""
    out = {}
    for key, value in request.query.items():
        if key not in RESET_FLAGS or value.lower() not in ("true", "false"):
            raise ProxyError(400, f"/reset_prefix_cache: query {key}={value!r} is not accepted; accepted: "
                             f"{' and '.join(RESET_FLAGS)}, each true or false")
        out[key] = value.lower()
    return out


def said_no(text: str) -> bool:
    """Whether an engine's 200 answer to ``/reset_prefix_cache`` says it did not reset (vLLM answers
    ``{"success": false}`` while blocks are held, or when its connector could not reset)."""
    try:
        body = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return False
    return isinstance(body, dict) and body.get("success") is False


def close_unread(request: web.Request, resp: web.StreamResponse) -> None:
    """``resp`` refuses ``request`` before its body was all in (a metaserver call's token or body
    deadline, the connection cap): close the connection after it rather than drain the rest, which a
    slow sender could make last while holding a slot. (Other endpoints keep aiohttp's lingering
    read, so a client still uploading sees its answer rather than a reset.)"""
    resp.force_close()
    drop = getattr(request.protocol, "drop_unread_body", None)  # lw_proxy.server's connections
    if drop is not None:
        drop()


class _Handlers:
    def __init__(self, proxy: Proxy) -> None:
        self.p = proxy
        self.cfg = proxy.cfg
        self._key = self.cfg.api_key.encode() if self.cfg.api_key is not None else None
        m = proxy.m
        self._in_flight = {ep: m.in_flight.labels(ep) for ep in _KNOWN}
        self._seconds = {ep: m.request_seconds.labels(ep) for ep in _KNOWN}

    def _check_auth(self, request: web.Request) -> None:
        if self._key is None:
            return
        got = bearer(request)
        if got is None or not same_secret(got, self._key):
            raise ProxyError(401, "missing or wrong bearer token (header 'Authorization: Bearer <key>')",
                             kind="auth")

    def _check_admin(self, request: web.Request) -> None:
        if self._key is None and not self.cfg.allow_unauthenticated_admin:
            raise ProxyError(403, f"{request.path} is an admin endpoint and the proxy has no API key: set "
                             "LW_PROXY_API_KEY or --api-key-file (then send 'Authorization: Bearer <key>'), "
                             "or start with --allow-unauthenticated-admin", kind="forbidden")
        self._check_auth(request)

    async def _read(self, request: web.Request, limit: int) -> bytes:
        return await read_body(request, limit, self.cfg.client_body_timeout)

    async def _timed(self, endpoint: str, request: web.Request,
                     work: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        m = self.p.m
        t0 = time.perf_counter()
        gauge = self._in_flight[endpoint]
        gauge.inc()
        status = 499  # what is left when the client went away first (nginx's convention)
        try:
            try:
                resp = await work(request)
            except ProxyError as e:
                m.errors.labels(e.kind).inc()
                resp = e.response()
                if endpoint == METASERVER_PATH and not request.content.is_eof():
                    close_unread(request, resp)
            status = resp.status
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            m.errors.labels("client_disconnect").inc()
            raise
        finally:
            gauge.dec()
            m.requests.labels(endpoint, str(status)).inc()
            self._seconds[endpoint].observe(time.perf_counter() - t0)

    # ------------------------------------------------------------ generation endpoints
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._timed(COMPLETIONS, request, lambda r: self._generate(r, COMPLETIONS, parse_completion))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._timed(CHAT, request, lambda r: self._generate(r, CHAT, parse_chat))

    async def _generate(self, request: web.Request, path: str,
                        parse: Callable[[bytes], ClientRequest]) -> web.StreamResponse:
        self._check_auth(request)
        # One deadline for everything this request does; a stream enforces it itself once it started.
        deadline = asyncio.get_running_loop().time() + self.cfg.request_timeout
        try:
            async with asyncio.timeout_at(deadline):
                req = parse(await self._read(request, self.cfg.max_body_bytes))
                if not req.stream:
                    return await self.p.complete(req, path)
        except TimeoutError:
            raise self.p.deadline_error() from None
        return await self.p.stream(request, req, path, deadline)

    # ------------------------------------------------------------ metaserver
    async def metaserver(self, request: web.Request) -> web.StreamResponse:
        return await self._timed("/v1/metaserver", request, self._metaserver)

    async def _metaserver(self, request: web.Request) -> web.Response:
        token = bearer(request)
        refused = self.p.registry.token_refusal(token)
        if refused is not None:  # judged on the header alone, before any of the body is read
            raise refused
        raw = await read_body(request, _MAX_METASERVER_BODY, self.cfg.client_body_timeout,
                              total=min(METASERVER_BODY_TIMEOUT, self.cfg.client_body_timeout))
        try:
            msg = decode_metaserver_request(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ProxyError(400, f"metaserver request: {e}; expected {{\"lw_parent_id\": str, \"request_id\": str}}") from None
        # needs_prefill, forces_first: absent from an older decoder's body (and an older lw_core.wire)
        status, body = await self.p.registry.arrive(msg.lw_parent_id, msg.request_id, token,
                                                    getattr(msg, "needs_prefill", None),
                                                    getattr(msg, "forces_first", None))
        return web.Response(status=status, body=body, content_type="application/json")

    # ------------------------------------------------------------ model list and tokenizer
    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        return await self._timed(request.path, request, self._passthrough)

    async def _passthrough(self, request: web.Request) -> web.Response:
        self._check_auth(request)
        body = await self._read(request, _MAX_PASSTHROUGH_BODY) if request.method == "POST" else None
        return await forward(self.p, request, body)

    # ------------------------------------------------------------ operations
    async def healthcheck(self, request: web.Request) -> web.StreamResponse:
        return await self._timed("/healthcheck", request, self._healthcheck)

    def _authenticated(self, request: web.Request) -> bool:
        """Whether the caller may see details (backend URLs): always without a key."""
        if self._key is None:
            return True
        got = bearer(request)
        return got is not None and same_secret(got, self._key)

    async def _healthcheck(self, request: web.Request) -> web.Response:
        p = self.p
        hp, hd = p.prefillers.healthy_count(), p.decoders.healthy_count()
        # The backends' URLs are for callers with the key; a liveness probe gets status and counts.
        backends = [BackendState(url=b.url, role=b.role, healthy=b.healthy, in_flight=b.in_flight, load=b.load)
                    for pool in (p.prefillers, p.decoders) for b in pool.backends] if self._authenticated(request) else []
        body = HealthcheckResponse(
            status="ok" if hp and hd else "degraded",
            prefill_instances=len(p.prefillers.backends), decode_instances=len(p.decoders.backends),
            healthy_prefill_instances=hp, healthy_decode_instances=hd, backends=backends)
        # No decoder means no answers at all; no prefiller only means decoders recompute.
        return web.Response(status=200 if hd else 503, body=msgspec.json.encode(body),
                            content_type="application/json")

    async def reset_prefix_cache(self, request: web.Request) -> web.StreamResponse:
        return await self._timed("/reset_prefix_cache", request, self._reset_prefix_cache)

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        p = self.p
        timeout = aiohttp.ClientTimeout(total=self.cfg.connect_timeout + 30)
        query = reset_query(request)

        async def one(url: str) -> BackendFailure | None:
            try:
                async with p.client().post(url + "/reset_prefix_cache", params=query, headers=p.headers,
                                           timeout=timeout) as r:
                    text = await r.text(errors="replace")
                    if r.status == 200 and not said_no(text):
                        return None
                    return BackendFailure(url=url, status=r.status, message=text[:500])
            except UPSTREAM_ERRORS as e:
                return BackendFailure(url=url, status=None, message=repr(e))

        urls = [b.url for pool in (p.prefillers, p.decoders) for b in pool.backends]
        results = await asyncio.gather(*(one(u) for u in urls))
        failed = [r for r in results if r is not None]
        ok = [u for u, r in zip(urls, results) if r is None]
        body = ResetPrefixCacheResponse(status="partial" if failed else "ok", succeeded=ok, failed=failed)
        return web.Response(status=502 if failed else 200, body=msgspec.json.encode(body),
                            content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        try:
            self._check_auth(request)  # with a key: its labels name every backend's URL
        except ProxyError as e:
            self.p.m.errors.labels(e.kind).inc()
            return e.response()
        data, ctype = self.p.m.render()
        return web.Response(body=data, headers={"Content-Type": ctype})

    async def fallback(self, request: web.Request) -> web.Response:
        want = _KNOWN.get(request.path)
        if want is not None:
            e = ProxyError(405, f"{request.method} {request.path} is not allowed; use {want}")
        else:
            e = ProxyError(404, f"no route {request.method} {request.path}; routes: "
                           + ", ".join(f"{m} {p}" for p, m in _KNOWN.items()))
        return e.response()


@web.middleware
async def over_cap(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                   ) -> web.StreamResponse:
    """Past --max-client-connections only metaserver callbacks are served (the reserve is theirs):
    under a client flood decoders still learn that their prefill is done. A callback is one whose
    bearer token is an open parent's (or the key): without one, a request for the metaserver path
    is just another client's."""
    over = getattr(request.protocol, "over_soft_cap", None)
    if over is not None and over() and not (request.path == METASERVER_PATH and
                                             request.app[PROXY_KEY].registry.known_token(bearer(request))):
        proxy = request.app[PROXY_KEY]
        proxy.m.connections_refused.labels("client").inc()
        resp = ProxyError(503, f"lw-proxy is at its {proxy.cfg.max_client_connections} client connections "
                          "(--max-client-connections); retry later").response()
        close_unread(request, resp)
        return resp
    return await handler(request)


def create_metaserver_app(proxy: Proxy) -> web.Application:
    """The dedicated metaserver listener (``--metaserver-port``): only decoders' callbacks, so a flood
    of clients on the client port cannot starve them. The proxy's lifecycle stays with the client app."""
    app = web.Application(client_max_size=_MAX_METASERVER_BODY + 1)
    h = _Handlers(proxy)
    app.router.add_post("/v1/metaserver", h.metaserver)
    app.router.add_route("*", "/{tail:.*}", h.fallback)
    return app


def create_app(cfg: ProxyConfig) -> web.Application:
    proxy = Proxy(cfg)
    # The body limit is enforced by read_body with an OpenAI-shaped 413; aiohttp's own limit stays above it.
    app = web.Application(client_max_size=cfg.max_body_bytes + 1, middlewares=[over_cap])
    app[PROXY_KEY] = proxy
    h = _Handlers(proxy)
    app.router.add_post(COMPLETIONS, h.completions)
    app.router.add_post(CHAT, h.chat)
    app.router.add_post("/v1/metaserver", h.metaserver)
    app.router.add_get("/healthcheck", h.healthcheck)
    app.router.add_post("/reset_prefix_cache", h.reset_prefix_cache)
    app.router.add_get("/metrics", h.metrics)
    for path, method in PASSTHROUGH.items():
        app.router.add_route(method, path, h.passthrough)
    app.router.add_route("*", "/{tail:.*}", h.fallback)

    async def lifecycle(app: web.Application):
        await proxy.start()
        probe = asyncio.create_task(probe_loop([proxy.prefillers, proxy.decoders], proxy.client(),
                                               cfg.health_interval, proxy.headers))
        yield
        probe.cancel()
        await asyncio.gather(probe, return_exceptions=True)
        await proxy.close()

    app.cleanup_ctx.append(lifecycle)
    return app
