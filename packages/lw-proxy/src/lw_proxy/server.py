"""Listeners of lw-proxy: a connection cap per listener, header and half-close handling, and the
optional dedicated metaserver listener.

aiohttp's own protection against a client that never finishes its headers is its keep-alive timer,
which also runs from the moment a connection is accepted: ``client_header_timeout`` sets it. What
aiohttp lacks is a cap on connections (one host could take every file descriptor) and an answer to a
client that half-closes mid-body (aiohttp closes the connection, so the client sees no status):
``_Handler`` adds both, and lets a refusal given before the body was in close without draining it.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import signal
import socket
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import ContentLengthError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from .errors import ProxyError

log = logging.getLogger("lw_proxy")


def _refusal(listener: str, cap: int) -> bytes:
    body = ProxyError(503, f"lw-proxy has {cap} open connections on its {listener} listener, its limit "
                      "(--max-client-connections (+ --metaserver-reserved-connections) / "
                      "--max-metaserver-connections); retry later").body()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Retry-After: 1\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class _Handler(RequestHandler):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        srv = self._manager
        assert isinstance(srv, CappedServer)
        if len(srv._connections) >= srv.cap:
            # Answer without parsing anything and close: the descriptor is freed at once.
            srv.refused()
            self._manager = None  # connection_lost then does nothing
            transport.write(srv.refusal)  # type: ignore[attr-defined]
            transport.close()
            return
        super().connection_made(transport)

    _last_payload = None

    def drop_unread_body(self) -> None:
        """After the response being made, close at once instead of reading (up to aiohttp's 10 s
        lingering time) what is left of the request body: for refusals given before the body was in."""
        self._lingering_time = 0.0

    def over_soft_cap(self) -> bool:
        """More connections are open than clients may use: the rest are kept for metaserver callbacks."""
        srv = self._manager
        return isinstance(srv, CappedServer) and len(srv._connections) > srv.soft_cap

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._messages:
            self._last_payload = self._messages[-1][1]

    def eof_received(self) -> bool:  # type: ignore[override]  # asyncio lets it return True; aiohttp types None
        # The client shut down its sending side. Mid-body: the body is incomplete; fail the read so the
        # handler answers 400, and keep the socket open to send it. Otherwise it is a client that went
        # away: close, as aiohttp does, which cancels the handler and so aborts the upstream request.
        payload = self._last_payload  # the body being received, if any (its handler may not run yet)
        if payload is None or payload.is_eof():
            return False
        payload.set_exception(ContentLengthError("the client closed its side before the body was complete"))
        self._lingering_time = 0.0  # nothing more will come: do not wait for the rest of the body
        self.close()  # no further request on this connection
        return True


class CappedServer(Server):
    def __init__(self, *args: Any, cap: int, soft_cap: int, listener: str, on_refuse: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cap = cap
        self.soft_cap = soft_cap
        self.refusal = _refusal(listener, cap)
        self.refused = on_refuse

    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class ProxyRunner(web.AppRunner):
    """An AppRunner whose server caps connections (``cap``) and answers half-closed bodies."""

    def __init__(self, app: web.Application, *, cap: int, listener: str, on_refuse: Any,
                 soft_cap: int | None = None, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._cap, self._listener, self._on_refuse = cap, listener, on_refuse
        self._soft_cap = cap if soft_cap is None else soft_cap

    async def _make_server(self) -> Server:
        srv = await super()._make_server()
        capped = CappedServer(srv.request_handler, request_factory=srv.request_factory,
                              handler_cancellation=srv.handler_cancellation, loop=srv._loop, cap=self._cap,
                              soft_cap=self._soft_cap,
                              listener=self._listener, on_refuse=self._on_refuse, **srv._kwargs)
        return capped


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    return s


async def start(cfg: Any, sock: socket.socket | None = None, metaserver_sock: socket.socket | None = None,
                *, access_log: logging.Logger | None = None, shutdown_timeout: float = 5.0) -> list[web.AppRunner]:
    """Start the client listener (and the metaserver one when ``cfg.metaserver_port`` is set); returns
    the runners, the client one first. Cleanup them in reverse order."""
    from .app import PROXY_KEY, create_app, create_metaserver_app

    app = create_app(cfg)
    proxy = app[PROXY_KEY]
    kw = dict(handler_cancellation=True, access_log=access_log, shutdown_timeout=shutdown_timeout,
              keepalive_timeout=cfg.client_header_timeout)
    refused = proxy.m.connections_refused
    runners: list[web.AppRunner] = []
    try:
        # Without a dedicated metaserver listener, the client port admits a reserve of connections
        # beyond the clients' cap that only metaserver callbacks may use (see app.over_cap).
        reserve = cfg.metaserver_reserved_connections if cfg.metaserver_port is None else 0
        r = ProxyRunner(app, cap=cfg.max_client_connections + reserve, soft_cap=cfg.max_client_connections,
                        listener="client", on_refuse=refused.labels("client").inc, **kw)
        await r.setup()
        runners.append(r)
        await web.SockSite(r, sock or _bind(cfg.host, cfg.port)).start()
        if cfg.metaserver_port is not None:
            mr = ProxyRunner(create_metaserver_app(proxy), cap=cfg.max_metaserver_connections,
                             listener="metaserver", on_refuse=refused.labels("metaserver").inc, **kw)
            await mr.setup()
            runners.append(mr)
            await web.SockSite(mr, metaserver_sock or _bind(cfg.host, cfg.metaserver_port)).start()
    except BaseException:
        for runner in reversed(runners):
            await runner.cleanup()
        raise
    return runners


def raise_fd_limit(cfg: Any) -> None:
    """Every client, metaserver and backend connection is a descriptor: raise the soft limit to what
    the caps need (as far as the hard limit allows), and warn when that is not enough."""
    need = cfg.max_client_connections + cfg.max_connections + 256
    need += cfg.max_metaserver_connections if cfg.metaserver_port is not None else cfg.metaserver_reserved_connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
        if soft < need:
            log.warning("file descriptor limit %d is below the %d the connection caps need; lower "
                        "--max-client-connections or raise ulimit -n", soft, need)


async def serve_forever(cfg: Any, *, access_log: logging.Logger | None = None) -> None:
    runners = await start(cfg, access_log=access_log)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for r in reversed(runners):
            await r.cleanup()
