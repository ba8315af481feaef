"""``lw-bench proxy``: the proxy's own overhead and throughput against mock backends.

Three processes: mock backends (an aiohttp decoder that calls back the metaserver like the real
connector, and a prefiller; both answer at once), ``lw-proxy`` itself, and this load generator.
For each concurrency, the same closed-loop load runs first straight at the mock decoder ("direct",
what a client of a single vLLM would see) and then through the proxy (full PD flow: decoder,
metaserver callback, one prefill, answer). Timings are wall-clock latencies of whole requests.

The report is a ``lw_bench.proxy.result.ProxyBenchResult`` (its fields are the JSON's keys; the
per-concurrency points appear as top-level ``c<N>`` keys): ``duration_s``, ``concurrency``, ``c<N>``
(``direct`` and ``proxy`` load figures, ``added_p50_ms``, ``throughput_ratio``,
``proxy_p99_over_p50``) and ``targets`` (booleans, reported, never asserted; each only when 1 or 64
is among the concurrency levels, as by default).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time
from typing import Any

import aiohttp
import msgspec

from lw_bench.proxy.result import ConcurrencyPoint, LoadStats, ProxyBenchResult, ProxyTargets, as_json_object, checked
from lw_bench.proxy.stack import free_port, proxy_main, serve_mocks, stop_stack, wait_closed, wait_ready
from lw_core.wire import DecodeTransferParams, MetaserverRequest, decode_transfer_params
from lw_proxy.config import ProxyConfig

_ANSWER = msgspec.json.encode({
    "id": "cmpl-bench", "object": "text_completion", "model": "mock",
    "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "stop_reason": None}],
    "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
})
_REQUEST = msgspec.json.encode({"model": "mock", "prompt": "The quick brown fox jumps over the lazy dog",
                                "max_tokens": 16, "temperature": 0})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--duration", type=float, default=4.0, help="seconds of load per point (after warm-up)")
    p.add_argument("--event-loop", default="auto", choices=["auto", "asyncio", "uvloop"],
                   help="the proxy's event loop (lw-proxy --event-loop; default auto: uvloop when installed)")
    p.add_argument("--quick", action="store_true", help="smoke test: 0.5 s per point")
    p.add_argument("--soak", type=int, default=0, metavar="N",
                   help="instead: soak the proxy with N requests against failing mocks (see lw_bench.proxy.soak)")
    p.add_argument("--soak-concurrency", type=int, default=64)
    p.add_argument("--soak-fail-rate", type=float, default=0.2, help="share of mock answers that fail")


# ------------------------------------------------------------------------ mock backends (own process)
def _mock_main(conn: Any) -> None:
    from aiohttp import web

    async def main() -> None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        dec_json = msgspec.json.Decoder()

        async def decoder(request: web.Request) -> web.Response:
            body = dec_json.decode(await request.read())
            params = body.get("kv_transfer_params")
            if params and params.get("do_remote_prefill"):
                dp = decode_transfer_params(params)
                assert isinstance(dp, DecodeTransferParams), dp
                cb = msgspec.json.encode(MetaserverRequest(lw_parent_id=dp.lw_parent_id, request_id="bench-0"))
                async with session.post(dp.metaserver, data=cb,
                                        headers={"Content-Type": "application/json"}) as r:
                    await r.read()
            return web.Response(body=_ANSWER, content_type="application/json")

        async def prefiller(request: web.Request) -> web.Response:
            await request.read()
            return web.Response(body=_ANSWER, content_type="application/json")

        ports, runners = await serve_mocks((decoder, prefiller))
        conn.send(ports)
        # Run until the parent closes its end of the pipe.
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, wait_closed, conn)
        await session.close()
        for r in runners:
            await r.cleanup()

    asyncio.run(main())


# ------------------------------------------------------------------------ load generator
async def _load(url: str, concurrency: int, duration: float) -> LoadStats:
    conn = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0)
    headers = {"Content-Type": "application/json"}
    lat: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as s:
        async def one() -> bool:
            async with s.post(url, data=_REQUEST, headers=headers) as r:
                await r.read()
                return r.status == 200

        # Warm-up: open the pool's connections, let the proxy open its own.
        await asyncio.gather(*(one() for _ in range(concurrency * 2)), return_exceptions=True)
        stop = time.perf_counter() + duration

        async def worker() -> None:
            nonlocal errors
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                try:
                    ok = await one()
                except (TimeoutError, aiohttp.ClientError):
                    ok = False
                if ok:
                    lat.append(time.perf_counter() - t0)
                else:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    ms = sorted(x * 1000 for x in lat)
    return LoadStats(requests=len(lat), errors=errors, rps=round(len(lat) / elapsed, 1),
                     p50_ms=round(percentile(ms, 50), 3), p99_ms=round(percentile(ms, 99), 3),
                     mean_ms=round(sum(ms) / len(ms), 3) if ms else float("nan"))


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation between closest ranks (numpy's default);
    NaN for no values."""
    if not sorted_values:
        return float("nan")
    k = (len(sorted_values) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if getattr(args, "soak", 0):
        from lw_bench.proxy import soak

        return soak.run(args.soak, args.soak_concurrency, args.soak_fail_rate, quiet=getattr(args, "json", False))
    duration = 0.5 if args.quick else args.duration
    levels = list(args.concurrency)
    if not levels or min(levels) < 1 or max(levels) > 4096:
        raise SystemExit("lw-bench proxy: --concurrency values must be 1-4096")
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    mocks = ctx.Process(target=_mock_main, args=(child_end,), daemon=True)
    mocks.start()
    proxy = None
    try:
        if not parent_end.poll(30):
            raise RuntimeError("mock backends did not start within 30 s")
        dport, pport = parent_end.recv()
        port = free_port()
        cfg = ProxyConfig(host="127.0.0.1", port=port, prefillers=[f"http://127.0.0.1:{pport}"],
                          decoders=[f"http://127.0.0.1:{dport}"])
        proxy = ctx.Process(target=proxy_main, args=(cfg, getattr(args, "event_loop", "auto")), daemon=True)
        proxy.start()
        direct_url = f"http://127.0.0.1:{dport}/v1/completions"
        proxy_url = f"http://127.0.0.1:{port}/v1/completions"
        points = asyncio.run(_measure(direct_url, proxy_url, f"http://127.0.0.1:{port}/healthcheck", levels, duration))
    finally:
        stop_stack(parent_end, (proxy, mocks))
    out = as_json_object(checked(ProxyBenchResult(duration_s=duration, concurrency=levels,
                                                  targets=_targets(points), points=points)))
    if not getattr(args, "json", False):
        _print_table(out)
    return out


async def _measure(direct_url: str, proxy_url: str, health: str, levels: list[int],
                   duration: float) -> dict[str, ConcurrencyPoint]:
    await wait_ready(health)
    out: dict[str, ConcurrencyPoint] = {}
    for c in levels:
        d = await _load(direct_url, c, duration)
        p = await _load(proxy_url, c, duration)
        out[f"c{c}"] = ConcurrencyPoint(
            direct=d, proxy=p,
            added_p50_ms=round(p.p50_ms - d.p50_ms, 3),
            throughput_ratio=round(p.rps / d.rps, 3) if d.rps else None,
            proxy_p99_over_p50=round(p.p99_ms / p.p50_ms, 2) if p.p50_ms else None,
        )
    return out


def _targets(points: dict[str, ConcurrencyPoint]) -> ProxyTargets:
    t = ProxyTargets()
    if "c1" in points:
        t.added_p50_ms_c1_le_2 = points["c1"].added_p50_ms <= 2.0
    if "c64" in points:
        r = points["c64"]
        t.throughput_ratio_c64_ge_0_5 = r.throughput_ratio is not None and r.throughput_ratio >= 0.5
        t.p99_le_3x_p50_c64 = r.proxy_p99_over_p50 is not None and r.proxy_p99_over_p50 <= 3.0
    return t


def _print_table(r: dict[str, Any]) -> None:
    print(f"lw-bench proxy: {r['duration_s']:g} s per point; direct = straight to the mock decoder")
    print(f"{'conc':>5} {'target':>7} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6}")
    for c in r["concurrency"]:
        row = r[f"c{c}"]
        for name in ("direct", "proxy"):
            s = row[name]
            print(f"{c:>5} {name:>7} {s['rps']:>9.1f} {s['p50_ms']:>8.3f} {s['p99_ms']:>8.3f} {s['errors']:>6}")
        print(f"{'':>5} added p50 {row['added_p50_ms']:.3f} ms; throughput ratio {row['throughput_ratio']}; "
              f"proxy p99/p50 {row['proxy_p99_over_p50']}")
    for k, v in r["targets"].items():
        print(f"target {k}: {'met' if v else 'NOT met'}")
