"""Operational endpoints: /healthcheck, /reset_prefix_cache, /metrics, auth, unknown routes."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from lw_dev.ports import dead_url
from lw_dev.proxy_mocks import harness, run
from lw_proxy.backends import BackendPool
from lw_proxy.metrics import ProxyMetrics


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_healthcheck_reports_counts_and_degrades():
    async def body():
        async with harness(n_prefill=2, n_decode=1) as h:
            async with h.session.get(h.url + "/healthcheck") as r:
                assert r.status == 200
                out = await r.json()
            assert out["status"] == "ok" and out["prefill_instances"] == 2 and out["decode_instances"] == 1
            assert {b["role"] for b in out["backends"]} == {"prefiller", "decoder"}
            h.proxy.prefillers.backends[0].mark_failed("test")
            h.proxy.prefillers.backends[1].mark_failed("test")
            async with h.session.get(h.url + "/healthcheck") as r:
                out = await r.json()
                assert r.status == 200 and out["status"] == "degraded"  # decoders recompute: still serving
            h.proxy.decoders.backends[0].mark_failed("test")
            async with h.session.get(h.url + "/healthcheck") as r:
                assert r.status == 503 and (await r.json())["healthy_decode_instances"] == 0

    run(body())


def test_reset_prefix_cache_fans_out_and_reports_failures():
    async def body():
        async with harness(n_prefill=1, n_decode=2, allow_unauthenticated_admin=True) as h:
            s, out = await h.post("/reset_prefix_cache", None)
            assert s == 200 and out["status"] == "ok" and len(out["succeeded"]) == 3 and out["failed"] == []
            assert [b.resets for b in h.prefillers + h.decoders] == [1, 1, 1]
            h.decoders[1].knobs.reset_status = 500
            s, out = await h.post("/reset_prefix_cache", None)
            assert s == 502 and out["status"] == "partial"
            (f,) = out["failed"]
            assert f["url"] == h.proxy.cfg.decoders[1] and f["status"] == 500

    run(body())


def test_reset_prefix_cache_passes_vllms_flags_on_and_hears_success_false():
    async def body():
        async with harness(n_prefill=1, n_decode=1, allow_unauthenticated_admin=True) as h:
            s, out = await h.post("/reset_prefix_cache?reset_external=true&reset_running_requests=False", None)
            assert s == 200 and out["status"] == "ok"
            want = {"reset_external": "true", "reset_running_requests": "false"}
            assert [b.reset_queries for b in h.prefillers + h.decoders] == [[want], [want]]
            h.decoders[0].knobs.reset_success = False  # vLLM: 200 {"success": false}, e.g. the pool kept objects
            s, out = await h.post("/reset_prefix_cache?reset_external=true", None)
            assert s == 502 and out["status"] == "partial" and out["succeeded"] == [h.proxy.cfg.prefillers[0]]
            (f,) = out["failed"]
            assert f["url"] == h.proxy.cfg.decoders[0] and f["status"] == 200 and '"success": false' in f["message"]
            for bad in ("reset_external=yes", "drop_everything=true"):
                s, out = await h.post("/reset_prefix_cache?" + bad, None)
                assert s == 400 and bad.split("=")[0] in out["error"]["message"]
            assert [b.resets for b in h.prefillers + h.decoders] == [2, 2]

    run(body())


def test_reset_prefix_cache_reports_unreachable_backend():
    async def body():
        dead = dead_url()
        async with harness(prefillers=[dead], api_key="k") as h:
            s, out = await h.post("/reset_prefix_cache", None, headers={"Authorization": "Bearer k"})
            assert s == 502 and out["failed"][0]["url"] == dead and out["failed"][0]["status"] is None

    run(body())


def test_metrics_cover_requests_backends_and_metaserver():
    async def body():
        async with harness(continue_after_prefill=False) as h:
            s, _ = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 2})
            assert s == 200
            s, _ = await h.post("/v1/completions", {"prompt": 3})
            assert s == 400
            async with h.session.get(h.url + "/metrics") as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                m = _samples(await r.text())
            dec, pf = h.proxy.cfg.decoders[0], h.proxy.cfg.prefillers[0]
            assert m[("lw_proxy_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 1
            assert m[("lw_proxy_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))] == 1
            assert m[("lw_proxy_requests_total", (("endpoint", "/v1/metaserver"), ("status", "200")))] == 1
            assert m[("lw_proxy_errors_total", (("kind", "bad_request"),))] == 1
            assert m[("lw_proxy_requests_in_flight", (("endpoint", "/v1/completions"),))] == 0
            for role, url in (("decoder", dec), ("prefiller", pf)):
                key = (("backend", url), ("role", role))
                assert m[("lw_proxy_backend_request_duration_seconds_count", key)] == 1
                assert m[("lw_proxy_backend_healthy", key)] == 1
                assert m[("lw_proxy_backend_load_tokens", key)] == 0
            assert m[("lw_proxy_metaserver_wait_seconds_count", (("outcome", "ok"),))] == 1
            assert m[("lw_proxy_prefill_dispatches_total", (("outcome", "ok"),))] == 1
            assert m[("lw_proxy_request_duration_seconds_count", (("endpoint", "/v1/completions"),))] == 2
            assert m[("lw_proxy_pending_parents", ())] == 0

    run(body())


def test_client_and_backend_bearer_tokens():
    async def body():
        async with harness(continue_after_prefill=False, api_key="sekret", backend_api_key="inner") as h:
            s, out = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 1})
            assert s == 401 and out["error"]["type"] == "authentication_error"
            s, _ = await h.post("/v1/completions", {"prompt": "p"}, headers={"Authorization": "Bearer wrong"})
            assert s == 401
            s, _ = await h.post("/reset_prefix_cache", None)
            assert s == 401
            assert h.decoders[0].bodies == []
            s, _ = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 1},
                                headers={"Authorization": "Bearer sekret"})
            assert s == 200
            assert h.decoders[0].auth == ["Bearer inner"] and h.prefillers[0].auth == ["Bearer inner"]
            async with h.session.get(h.url + "/healthcheck") as r:  # probes stay open
                assert r.status == 200

    run(body())


def test_unknown_routes_and_methods_get_json_errors():
    async def body():
        async with harness() as h:
            async with h.session.get(h.url + "/v1/nothing") as r:
                assert r.status == 404 and "routes:" in (await r.json())["error"]["message"]
            async with h.session.get(h.url + "/v1/completions") as r:
                assert r.status == 405 and "use POST" in (await r.json())["error"]["message"]

    run(body())


def test_pool_picks_least_loaded_and_skips_unhealthy():
    pool = BackendPool("prefiller", ["http://a:1", "http://b:1", "http://c:1"], ProxyMetrics())
    a, b, c = pool.backends
    a.acquire(500)
    b.acquire(100)
    c.acquire(300)
    assert pool.pick() is b
    b.mark_failed("x")
    assert pool.pick() is c
    assert pool.pick(exclude=c) is a
    a.mark_failed("x")
    c.mark_failed("x")
    assert pool.pick() is b  # all out: fall back to the least loaded rather than refuse
    for x in (a, b, c):
        x.mark_ok()
    b.release(100, 0.0)
    c.release(300, 0.0)
    a.release(500, 0.0)
    picks = {pool.pick().url for _ in range(6)}
    assert picks == {"http://a:1", "http://b:1", "http://c:1"}  # equal loads: round-robin
