"""``lw-bench proxy --soak N``: N requests through lw-proxy (its own process) against mock backends
that fail at random, checking every answer and watching the proxy's memory.

Mock decoders (two) call the metaserver like the real connector, then answer 503, an empty 200, or
``"echo: <prompt>"``; the mock prefiller fails with HTTP 500 at the same rate (decoders then
"recompute"). The load generator checks that every request gets its own answer or a clear error
(502/503/504 with a message), and reads the proxy's RSS after a warm-up and at the end.

The report is a ``lw_bench.proxy.result.SoakResult`` (its fields are the JSON's keys): ``requests``,
``concurrency``, ``fail_rate``, ``elapsed_s``, ``rps``, ``ok``, ``errors`` (by HTTP status),
``lost`` (no answer: connection error or client timeout), ``wrong_answer`` (someone else's text or
a malformed error), ``rss_start_mib``, ``rss_end_mib``, ``rss_growth_mib``.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import random
import time
from typing import Any

import aiohttp
import msgspec

from lw_bench.proxy.result import SoakResult, as_json_object, checked
from lw_bench.proxy.stack import free_port, proxy_main, serve_mocks, stop_stack, wait_closed, wait_ready
from lw_core.wire import DecodeTransferParams, MetaserverRequest, decode_transfer_params
from lw_proxy.config import ProxyConfig


def _mock_main(conn: Any, fail_rate: float, seed: int) -> None:
    from aiohttp import web

    rng = random.Random(seed)

    async def main() -> None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        async def decoder(request: web.Request) -> web.Response:
            body = msgspec.json.decode(await request.read())
            params = body.get("kv_transfer_params") or {}
            if params.get("do_remote_prefill"):
                dp = decode_transfer_params(params)
                assert isinstance(dp, DecodeTransferParams), dp
                cb = msgspec.json.encode(MetaserverRequest(lw_parent_id=dp.lw_parent_id, request_id=f"soak-{rng.random()}"))
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.post(dp.metaserver, data=cb, headers={"Content-Type": "application/json"},
                                            timeout=aiohttp.ClientTimeout(total=10)) as r:
                        await r.read()
            x = rng.random()
            if x < fail_rate / 2:
                return web.json_response({"error": {"message": "mock overload", "code": 503}}, status=503)
            if x < fail_rate:
                return web.Response(status=200, body=b"")
            return web.json_response({"id": "cmpl-soak", "object": "text_completion",
                                      "choices": [{"index": 0, "text": "echo: " + body["prompt"],
                                                   "finish_reason": "length", "stop_reason": None}],
                                      "usage": {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}})

        async def prefiller(request: web.Request) -> web.Response:
            await request.read()
            if rng.random() < fail_rate:
                return web.json_response({"error": {"message": "mock prefill failure", "code": 500}}, status=500)
            return web.json_response({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})

        ports, runners = await serve_mocks((decoder, decoder, prefiller))
        conn.send(ports)

        await asyncio.get_running_loop().run_in_executor(None, wait_closed, conn)
        await session.close()
        for r in runners:
            await r.cleanup()

    asyncio.run(main())


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


async def _drive(url: str, n: int, concurrency: int, proxy_pid: int) -> dict[str, Any]:
    await wait_ready(url.rsplit("/v1/", 1)[0] + "/healthcheck")
    out: dict[str, Any] = {"ok": 0, "errors": {}, "lost": 0, "wrong_answer": 0}
    warm = max(1, n // 10)
    rss: dict[str, float] = {}
    next_i = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                     timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def worker() -> None:
            nonlocal next_i
            while next_i < n:
                i = next_i
                next_i += 1
                if i == warm:
                    rss["start"] = _rss_mib(proxy_pid)
                prompt = f"soak {i}"
                try:
                    async with s.post(url, json={"prompt": prompt, "max_tokens": 4}) as r:
                        raw = await r.read()
                        status = r.status
                except (TimeoutError, aiohttp.ClientError):
                    out["lost"] += 1
                    continue
                try:
                    body = msgspec.json.decode(raw)
                    if status == 200:
                        good = body["choices"][0]["text"] == "echo: " + prompt
                    else:
                        good = status in (502, 503, 504) and bool(body["error"]["message"])
                except (msgspec.DecodeError, KeyError, IndexError, TypeError):
                    good = False
                if not good:
                    out["wrong_answer"] += 1
                elif status == 200:
                    out["ok"] += 1
                else:
                    out["errors"][str(status)] = out["errors"].get(str(status), 0) + 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        out["elapsed_s"] = round(time.perf_counter() - t0, 2)
    await asyncio.sleep(0.5)  # let the proxy drop its per-request state
    rss["end"] = _rss_mib(proxy_pid)
    out["rps"] = round(n / out["elapsed_s"], 1)
    out["rss_start_mib"] = round(rss.get("start", rss["end"]), 1)
    out["rss_end_mib"] = round(rss["end"], 1)
    out["rss_growth_mib"] = round(out["rss_end_mib"] - out["rss_start_mib"], 1)
    return out


def run(n: int, concurrency: int, fail_rate: float, *, quiet: bool = False) -> dict[str, Any]:
    if n < 1 or not 1 <= concurrency <= 4096:
        raise SystemExit("lw-bench proxy: --soak must be >= 1 and --soak-concurrency 1-4096")
    if not 0.0 <= fail_rate < 1.0:
        raise SystemExit(f"lw-bench proxy: --soak-fail-rate={fail_rate} must be in [0, 1)")
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    mocks = ctx.Process(target=_mock_main, args=(child_end, fail_rate, 7), daemon=True)
    mocks.start()
    proxy = None
    try:
        if not parent_end.poll(30):
            raise RuntimeError("mock backends did not start within 30 s")
        d0, d1, pf = parent_end.recv()
        port = free_port()
        cfg = ProxyConfig(host="127.0.0.1", port=port, prefillers=[f"http://127.0.0.1:{pf}"],
                          decoders=[f"http://127.0.0.1:{d0}", f"http://127.0.0.1:{d1}"], max_retries=2,
                          retry_delay=0.0, health_interval=0.1)
        proxy = ctx.Process(target=proxy_main, args=(cfg,), daemon=True)
        proxy.start()
        assert proxy.pid is not None  # set by start()
        res = asyncio.run(_drive(f"http://127.0.0.1:{port}/v1/completions", n, concurrency, proxy.pid))
    finally:
        stop_stack(parent_end, (proxy, mocks))
    res = as_json_object(checked(SoakResult(requests=n, concurrency=concurrency, fail_rate=fail_rate, **res)))
    if not quiet:
        print(f"lw-bench proxy --soak: {n} requests at concurrency {concurrency}, fail rate {fail_rate:g}: "
              f"{res['rps']} req/s; ok {res['ok']}, errors {res['errors']}, lost {res['lost']}, "
              f"wrong answers {res['wrong_answer']}; proxy RSS {res['rss_start_mib']} -> {res['rss_end_mib']} MiB")
    return res
