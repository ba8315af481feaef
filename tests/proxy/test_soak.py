"""Bounded soak of lw-proxy: thousands of requests at concurrency 64 against mock backends whose
failures flip on and off all the time (503s, empty 200s, streams cut mid-way, failing prefills).

What must hold: every request gets exactly one answer, which is either its OWN correct text (the
mock's words depend only on the prompt, and every prompt is unique) or a clear error status with an
error message; decoders completed exactly as many answers as clients received whole; nothing is left
in flight or in the metaserver registry; RSS stays flat. ``lw-bench proxy --soak N`` runs a longer
variant with the proxy in its own process.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import time

import aiohttp
import msgspec
import pytest

from lw_dev.proxy_mocks import generate, harness, run

# 6,000 keeps it near a minute on 2 busy cores; LW_SOAK_REQUESTS=10000 (or lw-bench proxy --soak) for more.
N_REQUESTS = int(os.environ.get("LW_SOAK_REQUESTS", "6000"))
CONCURRENCY = 64
MAX_TOKENS = 4
ERROR_STATUSES = {502, 503, 504}
RSS_GROWTH_LIMIT = 32 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _chaos(h, stop: asyncio.Event, rng: random.Random) -> None:
    d0, d1 = h.decoders[0].knobs, h.decoders[1].knobs
    pf = h.prefillers[0].knobs
    while not stop.is_set():
        d0.status = 503 if rng.random() < 0.1 else None
        d1.status = 503 if rng.random() < 0.3 else None
        d1.empty_200 = rng.random() < 0.15
        d1.die_after = 1 if rng.random() < 0.2 else None
        pf.status = 500 if rng.random() < 0.3 else None
        await asyncio.sleep(0.02)


def _check_plain(i: int, status: int, raw: bytes, counts: dict[str, int]) -> None:
    prompt = f"soak request {i}"
    if status == 200:
        body = msgspec.json.decode(raw)
        text = body["choices"][0]["text"]
        assert text == "".join(generate(prompt, MAX_TOKENS)), f"request {i} got someone else's answer: {text!r}"
        counts["ok"] += 1
        return
    assert status in ERROR_STATUSES, f"request {i}: unexpected status {status}: {raw[:300]!r}"
    err = msgspec.json.decode(raw)["error"]
    assert err["message"] and err["code"] == status, err
    counts[f"http_{status}"] += 1


def _check_stream(i: int, status: int, raw: bytes, counts: dict[str, int]) -> None:
    prompt = f"soak request {i}"
    if status != 200:
        _check_plain(i, status, raw, counts)
        return
    events = [e[len("data: "):] for e in raw.decode().strip().split("\n\n")]
    assert events[-1] == "[DONE]", f"request {i}: stream did not end with [DONE]: {events[-3:]}"
    chunks = [msgspec.json.decode(e) for e in events[:-1]]
    if "error" in chunks[-1]:
        assert chunks[-1]["error"]["code"] == 502 and chunks[-1]["error"]["message"]
        chunks = chunks[:-1]
        counts["stream_cut"] += 1
        full = False
    else:
        counts["ok"] += 1
        full = True
    text = "".join(c["choices"][0]["text"] for c in chunks)
    want = "".join(generate(prompt, MAX_TOKENS))
    assert (text == want) if full else want.startswith(text), f"request {i}: stream text {text!r} vs {want!r}"


@pytest.mark.slow
def test_soak_no_request_lost_or_doubled_and_memory_flat():
    async def body():
        async with harness(n_prefill=1, n_decode=2, max_retries=2, retry_delay=0.0, health_interval=0.05,
                           metaserver_timeout=5.0) as h:
            counts: dict[str, int] = {"ok": 0, "http_502": 0, "http_503": 0, "http_504": 0, "stream_cut": 0}
            answered: list[int] = []
            stop = asyncio.Event()
            chaos = asyncio.create_task(_chaos(h, stop, random.Random(7)))
            next_i = 0
            rss: dict[str, int] = {}
            warm = min(1000, N_REQUESTS // 5)
            conn = aiohttp.TCPConnector(limit=CONCURRENCY)
            async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as s:
                async def worker() -> None:
                    nonlocal next_i
                    while next_i < N_REQUESTS:
                        i = next_i
                        next_i += 1
                        if i == warm:
                            gc.collect()
                            rss["start"] = _rss()
                        stream = i % 4 == 0
                        req = {"prompt": f"soak request {i}", "max_tokens": MAX_TOKENS, "stream": stream}
                        async with s.post(h.url + "/v1/completions", json=req) as r:
                            raw = await r.read()
                            (_check_stream if stream else _check_plain)(i, r.status, raw, counts)
                        answered.append(i)

                t0 = time.monotonic()
                await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
                elapsed = time.monotonic() - t0
            stop.set()
            await chaos
            gc.collect()
            rss["end"] = _rss()

            assert sorted(answered) == list(range(N_REQUESTS)), "a request was lost or answered twice"
            assert sum(counts.values()) == N_REQUESTS, counts
            # Decoders finished exactly the answers clients received whole (a cut stream is not finished).
            assert sum(d.completed for d in h.decoders) == counts["ok"], (counts, [d.completed for d in h.decoders])
            assert counts["ok"] > N_REQUESTS // 2, counts  # the chaos leaves most requests servable
            assert len(h.proxy.registry) == 0, "metaserver bookkeeping leaked"
            m = await h.metrics()
            assert 'lw_proxy_requests_in_flight{endpoint="/v1/completions"} 0.0' in m
            assert 'lw_proxy_pending_parents 0.0' in m
            total = sum(float(line.rsplit(" ", 1)[1]) for line in m.splitlines()
                        if line.startswith('lw_proxy_requests_total{endpoint="/v1/completions"'))
            assert total == N_REQUESTS
            d1 = h.proxy.cfg.decoders[1]
            fails = [line for line in m.splitlines()
                     if line.startswith("lw_proxy_backend_failures_total{") and d1 in line]
            assert fails and float(fails[0].rsplit(" ", 1)[1]) > 0, fails
            busy = [line for line in m.splitlines() if line.startswith("lw_proxy_backend_requests_in_flight{")]
            assert len(busy) == 3 and all(line.endswith(" 0.0") for line in busy), busy
            growth = rss["end"] - rss["start"]
            print(f"\nsoak: {N_REQUESTS} requests in {elapsed:.1f} s ({N_REQUESTS / elapsed:.0f}/s), {counts}, "
                  f"RSS {rss['start'] >> 20} -> {rss['end'] >> 20} MiB")
            assert growth < RSS_GROWTH_LIMIT, f"RSS grew by {growth >> 20} MiB over the soak"

    run(body(), timeout=240)


def test_bench_soak_mode_reports_every_request():
    """``lw-bench proxy --soak`` (proxy in its own process): every request accounted for, none wrong."""
    import argparse

    from lw_bench.proxy import mode as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--soak", "300", "--soak-concurrency", "16", "--soak-fail-rate", "0.3"])
    args.json = True
    r = bench.run(args)
    assert r["requests"] == 300 and r["lost"] == 0 and r["wrong_answer"] == 0
    assert r["ok"] + sum(r["errors"].values()) == 300 and r["ok"] > 150
    assert set(r["errors"]) <= {"502", "503", "504"}
    assert r["rss_start_mib"] > 0 and r["rss_end_mib"] > 0
