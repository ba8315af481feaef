"""Backends that die, stall or refuse; clients that leave; metaserver waits that must stay bounded."""

from __future__ import annotations

import time

import aiohttp
import msgspec
import pytest

from lw_dev.ports import dead_url
from lw_dev.proxy_mocks import generate, harness, run, wait_until


def _dead_url() -> str:
    return dead_url()  # nothing listens there: connections are refused


def test_decoder_dying_mid_stream_ends_with_an_error_event():
    async def body():
        async with harness() as h:
            h.decoders[0].knobs.die_after = 3
            async with h.session.post(h.url + "/v1/completions",
                                      json={"prompt": "p", "max_tokens": 10, "stream": True}) as r:
                assert r.status == 200
                raw = (await r.read()).decode()
            events = [b[len("data: "):] for b in raw.strip().split("\n\n")]
            assert events[-1] == "[DONE]"
            err = msgspec.json.decode(events[-2])
            assert err["error"]["code"] == 502 and "decoder" in err["error"]["message"]
            texts = [msgspec.json.decode(e)["choices"][0]["text"] for e in events[:-2]]
            assert "".join(texts) == "".join(generate("p", 3))
            assert 'lw_proxy_errors_total{kind="upstream_died"} 1.0' in await h.metrics()
            assert len(h.proxy.registry) == 0

    run(body())


def test_decoder_down_gives_clear_502_after_bounded_retries():
    async def body():
        async with harness(decoders=[_dead_url()], max_retries=2) as h:
            t0 = time.monotonic()
            status, out = await h.post("/v1/completions", {"prompt": "p"})
            assert status == 502
            assert "no decoder completed the request after 3 attempts" in out["error"]["message"]
            assert out["error"]["type"] == "upstream_error" and out["error"]["code"] == 502
            assert time.monotonic() - t0 < 5
            m = await h.metrics()
            assert 'lw_proxy_retries_total{role="decoder"} 2.0' in m
            assert f'lw_proxy_backend_healthy{{backend="{h.proxy.cfg.decoders[0]}",role="decoder"}} 0.0' in m

    run(body())


def test_empty_200_from_decoder_is_never_passed_on():
    async def body():
        async with harness(max_retries=1) as h:
            h.decoders[0].knobs.empty_200 = True
            status, out = await h.post("/v1/completions", {"prompt": "p"})
            assert status == 502 and "empty body" in out["error"]["message"]

    run(body())


def test_failing_decoder_is_taken_out_retried_elsewhere_and_probed_back():
    async def body():
        async with harness(n_decode=2, health_interval=0.1) as h:
            bad, good = h.decoders
            bad.knobs.status = 503
            bad.knobs.health_status = 503
            for _ in range(4):
                status, _ = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 2})
                assert status == 200
            assert len(bad.bodies) == 1, "a backend that failed is not picked again while it is out"
            assert len(good.bodies) == 4
            bad_backend = h.proxy.decoders.backends[0]
            assert not bad_backend.healthy
            bad.knobs.status = None
            bad.knobs.health_status = 200
            await wait_until(lambda: bad_backend.healthy, what="probe to bring the decoder back")
            assert bad.health_calls >= 1

    run(body())


def test_decoder_4xx_passes_through_without_retry():
    async def body():
        async with harness(n_decode=2) as h:
            for d in h.decoders:
                d.knobs.status = 400
            status, out = await h.post("/v1/completions", {"prompt": "p"})
            assert status == 400 and out["error"]["message"] == "mock failure"
            assert sum(len(d.bodies) for d in h.decoders) == 1
            assert all(b.healthy for b in h.proxy.decoders.backends)

    run(body())


def test_client_disconnect_aborts_streaming_upstream():
    async def body():
        async with harness() as h:
            dec = h.decoders[0]
            dec.knobs.token_delay = 0.05
            async with aiohttp.ClientSession() as s:
                r = await s.post(h.url + "/v1/completions", json={"prompt": "p", "max_tokens": 200, "stream": True})
                assert r.status == 200
                await r.content.readuntil(b"\n\n")
                r.close()  # the client goes away mid-stream
            await wait_until(lambda: dec.aborted == 1, what="decoder to see the abort")
            await wait_until(lambda: len(h.proxy.registry) == 0 and h.proxy.decoders.backends[0].in_flight == 0,
                             what="bookkeeping freed")
            assert dec.completed == 0
            await wait_until(lambda: 'lw_proxy_requests_in_flight{endpoint="/v1/completions"} 0.0'
                             in h.proxy.m.render()[0].decode(), what="in-flight gauge back to 0")

    run(body())


def test_client_disconnect_aborts_non_streaming_upstream():
    async def body():
        async with harness() as h:
            dec = h.decoders[0]
            dec.knobs.delay = 5
            async with aiohttp.ClientSession() as s:
                try:
                    await s.post(h.url + "/v1/completions", json={"prompt": "p"},
                                 timeout=aiohttp.ClientTimeout(total=0.3))
                except TimeoutError:
                    pass
            await wait_until(lambda: dec.aborted == 1, what="decoder to see the abort")
            await wait_until(lambda: len(h.proxy.registry) == 0, what="parent freed")
            m = await h.metrics()
            assert 'lw_proxy_errors_total{kind="client_disconnect"} 1.0' in m
            assert 'lw_proxy_requests_total{endpoint="/v1/completions",status="499"} 1.0' in m

    run(body())


@pytest.mark.parametrize("mode", ["early", "on-metaserver"])
def test_metaserver_never_called_leaves_nothing_behind(mode):
    async def body():
        async with harness(continue_after_prefill=False, prefill_dispatch=mode) as h:
            h.decoders[0].knobs.skip_metaserver = True
            status, out = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 2})
            assert status == 200
            # on-metaserver: no callback, no prefill; early: dispatched with the request
            assert len(h.prefillers[0].bodies) == (1 if mode == "early" else 0)
            assert len(h.proxy.registry) == 0

    run(body())


def test_metaserver_wait_is_bounded_when_prefill_stalls():
    async def body():
        async with harness(continue_after_prefill=False, metaserver_timeout=0.3) as h:
            h.prefillers[0].knobs.delay = 3
            t0 = time.monotonic()
            status, out = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 2})
            assert status == 200  # the decoder recomputes; the client still gets its answer
            assert time.monotonic() - t0 < 2.5
            ((ms, mbody),) = h.decoders[0].metaserver_results
            assert ms == 504 and "recompute locally" in mbody["error"]["message"]
            await wait_until(lambda: h.prefillers[0].aborted == 1, what="stale prefill cancelled")
            assert 'lw_proxy_metaserver_wait_seconds_count{outcome="timeout"} 1.0' in await h.metrics()

    run(body())


def test_partial_fan_in_times_out():
    async def body():
        async with harness(metaserver_timeout=0.2) as h:
            parent = h.proxy.registry.open(2, None)
            status, out = await h.post("/v1/metaserver", {"lw_parent_id": parent.id, "request_id": "r1"})
            assert status == 504 and "1/2 request ids" in out["error"]["message"]
            assert h.prefillers[0].bodies == []
            h.proxy.registry.close(parent)

    run(body())


def test_prefiller_failures_answer_the_metaserver_with_an_error():
    async def body():
        async with harness(max_retries=1) as h:
            h.prefillers[0].knobs.status = 503  # "cannot serve": not asked again for this parent, given up
            status, _ = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 2})
            assert status == 200
            assert len(h.prefillers[0].bodies) == 1
            ((ms, mbody),) = h.decoders[0].metaserver_results
            assert ms == 502 and "no prefiller completed" in mbody["error"]["message"]

            h.prefillers[0].bodies.clear()
            h.prefillers[0].knobs.status = 400  # the request itself is refused: not retried
            h.proxy.prefillers.backends[0].mark_ok()
            status, _ = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 2})
            assert status == 200 and len(h.prefillers[0].bodies) == 1
            ms, mbody = h.decoders[0].metaserver_results[-1]
            assert ms == 502 and "answered HTTP 400" in mbody["error"]["message"]
            assert 'lw_proxy_prefill_dispatches_total{outcome="error"} 2.0' in await h.metrics()

    run(body())
