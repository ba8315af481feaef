"""Slow, half-open and too many clients: header timeout, a connection cap answered
with a quick 503, decoders' metaserver callbacks served on their own listener while clients
overload the client one, and repeated log lines collapsed."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from raw_http import head, read_response

from lw_dev.proxy_mocks import METASERVER_OK, generate, harness, run
from lw_proxy.logfilter import RepeatFilter


async def _connect(url: str):
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


def test_client_dribbling_its_headers_is_cut_off():
    async def body():
        async with harness(client_header_timeout=0.3) as h:
            reader, writer = await _connect(h.url)
            t0 = time.monotonic()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            closed_after = None
            for _ in range(60):  # one header byte every 50 ms, never finishing: a slowloris
                try:
                    writer.write(b"X")
                    await writer.drain()
                    if await asyncio.wait_for(reader.read(1024), 0.05) == b"":
                        closed_after = time.monotonic() - t0
                        break
                except TimeoutError:
                    continue
                except ConnectionError:
                    closed_after = time.monotonic() - t0
                    break
            writer.close()
            assert closed_after is not None and closed_after < 2, closed_after

    run(body())


def test_connection_cap_refuses_quickly_and_metaserver_listener_keeps_serving():
    async def body():
        async with harness(continue_after_prefill=False, max_client_connections=2, client_header_timeout=10, dedicated_metaserver=True) as h:
            assert h.metaserver_url != h.url + "/v1/metaserver"
            idle = [await _connect(h.url) for _ in range(2)]  # two clients sit on the cap, sending nothing
            await asyncio.sleep(0.05)
            reader, writer = await _connect(h.url)
            t0 = time.monotonic()  # the refusal comes at accept, before any request is sent
            status, out = await asyncio.wait_for(read_response(reader), 2)
            assert status == 503 and "--max-client-connections" in out["error"]["message"]
            assert time.monotonic() - t0 < 1
            writer.close()

            # a request already in (one idle client left): its decoder calls back on the metaserver
            # listener, which the full client listener does not starve
            _, w0 = idle.pop()
            w0.close()
            await asyncio.sleep(0.05)
            status, out = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 2})
            assert status == 200 and out["choices"][0]["text"] == "".join(generate("p", 2))
            (dbody,) = h.decoders[0].bodies
            assert dbody["kv_transfer_params"]["metaserver"] == h.metaserver_url
            assert h.decoders[0].metaserver_results == [METASERVER_OK]
            assert 'lw_proxy_connections_refused_total{listener="client"} 1.0' in h.proxy.m.render()[0].decode()
            for _, w in idle:
                w.close()

    run(body())


def test_shared_port_keeps_a_reserve_for_metaserver_callbacks():
    # No --metaserver-port: past --max-client-connections the client port still admits
    # --metaserver-reserved-connections, for callbacks only; clients there get a quick 503.
    async def body():
        async with harness(continue_after_prefill=False, max_client_connections=1, metaserver_reserved_connections=4,
                           client_header_timeout=10) as h:
            h.decoders[0].knobs.delay = 0.3
            conn = aiohttp.TCPConnector(force_close=True)  # one connection per request, none idle in a pool
            async with aiohttp.ClientSession(connector=conn) as s:
                async def client(prompt):
                    async with s.post(h.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}) as r:
                        return r.status, await r.json()

                first = asyncio.ensure_future(client("p"))
                await asyncio.sleep(0.1)  # the first request holds the one client connection
                status, out = await client("q")
                assert status == 503 and "--max-client-connections" in out["error"]["message"]
                status, out = await first
            assert status == 200 and out["choices"][0]["text"] == "".join(generate("p", 2))
            assert h.decoders[0].metaserver_results == [METASERVER_OK]  # served from the reserve
            assert len(h.decoders[0].bodies) == 1

        async with harness(continue_after_prefill=False, max_client_connections=1, metaserver_reserved_connections=0,
                           client_header_timeout=10) as h:  # no reserve: the callback is refused
            status, _ = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 2})
            assert status == 200  # the decoder recomputed
            ((ms, _),) = h.decoders[0].metaserver_results
            assert ms in (503, None)  # the 503, or a reset when the refusal meets the unread request

    run(body())


async def _dribble(url: str, path: str, auth: bytes = b"", every: float = 0.25, for_s: float = 4.0):
    """POST ``path`` announcing a 200-byte body and send one byte of it every ``every`` s, for at most
    ``for_s`` s; returns (seconds until the answer, status), or None when none came."""
    reader, writer = await _connect(url.removesuffix(path))
    t0 = time.monotonic()
    writer.write(head(path, length=200)[:-2] + auth + b"\r\n")
    try:
        while time.monotonic() - t0 < for_s:
            try:
                writer.write(b" ")
                await writer.drain()
                status, _ = await asyncio.wait_for(read_response(reader), every)
                return time.monotonic() - t0, status
            except TimeoutError:
                continue
            except ConnectionError:
                return time.monotonic() - t0, None
        return None
    finally:
        writer.close()


def test_unauthenticated_metaserver_dribblers_cannot_hold_the_slots():
    # Six connections POST /v1/metaserver without a token and dribble a body, one byte at a time,
    # on a client port with one client slot and a reserve of five.
    async def body():
        auth = {"Authorization": "Bearer k"}
        async with harness(continue_after_prefill=False, api_key="k", max_client_connections=1, metaserver_reserved_connections=5,
                           client_header_timeout=10) as h:
            dribblers = [asyncio.ensure_future(_dribble(h.url, "/v1/metaserver")) for _ in range(6)]
            # Refused on the header (401: no token; 503: no token, so no reserve), before the body:
            # none holds a slot past that (waiting for the refusals, not a fixed pause, so a loaded
            # machine's slower refusals cannot still hold the one client slot when the request comes).
            got = await asyncio.gather(*dribblers)
            assert all(g is not None and g[0] < 1 and g[1] in (401, 503, None) for g in got), got
            status, out = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 2}, headers=auth)
            assert status == 200 and out["choices"][0]["text"] == "".join(generate("p", 2))
            assert h.decoders[0].metaserver_results == [METASERVER_OK]

        async with harness(continue_after_prefill=False, max_client_connections=1, metaserver_reserved_connections=5, client_header_timeout=10,
                           client_body_timeout=1.0) as h:
            dribblers = [asyncio.ensure_future(_dribble(h.url, "/v1/metaserver"))]
            await asyncio.sleep(0.1)  # the first one is in, within the client cap
            dribblers += [asyncio.ensure_future(_dribble(h.url, "/v1/metaserver")) for _ in range(5)]
            got = sorted(await asyncio.gather(*dribblers), key=lambda g: (g is None, g and g[0]))
            # no key: no token, so no reserve (503 at once); the one within the client cap has its
            # whole body cut at the metaserver deadline (here --client-body-timeout, 1 s, is shorter)
            assert all(g is not None for g in got), got
            assert [g[1] for g in got[:5]] == [503] * 5 and all(g[0] < 0.5 for g in got[:5]), got
            assert got[5][1] == 400 and 0.9 < got[5][0] < 2, got
            status, _ = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 2})
            assert status == 200

    run(body())


def test_metaserver_listener_judges_the_token_before_the_body_and_bounds_the_body():
    async def body():
        async with harness(api_key="k", dedicated_metaserver=True, client_body_timeout=1.0) as h:
            got = await _dribble(h.metaserver_url, "/v1/metaserver")
            assert got is not None and got[0] < 0.5 and got[1] in (401, None), got
            got = await _dribble(h.metaserver_url, "/v1/metaserver", b"Authorization: Bearer not-a-token\r\n")
            assert got is not None and got[0] < 0.5 and got[1] in (401, None), got
            parent = h.proxy.registry.open(1, None)
            try:  # a token the proxy issued still may not dribble its body past the deadline
                got = await _dribble(h.metaserver_url, "/v1/metaserver",
                                     f"Authorization: Bearer {parent.token}\r\n".encode())
                assert got is not None and got[1] == 400 and 0.9 < got[0] < 2, got
            finally:
                h.proxy.registry.close(parent)

    run(body())


def test_repeated_log_lines_are_collapsed_with_a_count():
    now = [0.0]
    f = RepeatFilter(10.0, clock=lambda: now[0])
    logger = logging.getLogger("lw_proxy.test_repeat")
    got: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record.getMessage())

    h = Keep()
    h.addFilter(f)
    logger.addHandler(h)
    logger.propagate = False
    try:
        for i in range(1000):  # a flood: one line per peer
            logger.warning("client %s sent garbage", f"10.0.0.{i % 250}")
        logger.error("something else")
        now[0] = 11.0
        logger.warning("client %s sent garbage", "10.0.0.7")
    finally:
        logger.removeHandler(h)
    assert got[0] == "client 10.0.0.0 sent garbage" and got[1] == "something else"
    assert got[2].startswith("client 10.0.0.7 sent garbage [and 999 more like this in the previous 10 s")
    assert len(got) == 3


def test_fd_limit_is_raised_to_what_the_caps_need(monkeypatch, caplog):
    from lw_proxy import server
    from lw_proxy.config import ProxyConfig

    calls = []
    monkeypatch.setattr(server.resource, "getrlimit", lambda _r: (1024, 4096))
    monkeypatch.setattr(server.resource, "setrlimit", lambda _r, lim: calls.append(lim))
    server.raise_fd_limit(ProxyConfig(max_client_connections=2000, max_connections=500))
    assert calls == [(3012, 4096)]  # 2000 + 256 reserved + 500 + 256 spare, within the hard limit
    assert "below" not in caplog.text
    calls.clear()
    with caplog.at_level(logging.WARNING, logger="lw_proxy"):
        server.raise_fd_limit(ProxyConfig(max_client_connections=100_000))
    assert calls == [(4096, 4096)] and "--max-client-connections" in caplog.text
