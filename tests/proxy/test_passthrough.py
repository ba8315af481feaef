"""/v1/models, /tokenize and /detokenize pass through to a backend: vLLM's
benchmark client asks the server it benchmarks for them, and the proxy is that server."""

from __future__ import annotations

from lw_dev.proxy_mocks import harness, run


def test_model_list_and_tokenizer_come_from_a_decoder_with_the_backend_key():
    async def body():
        async with harness(backend_api_key="sekret") as h:
            async with h.session.get(h.url + "/v1/models") as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("application/json")
                out = await r.json()
            assert out["data"][0]["id"] == "mock-model" and out["data"][0]["owned_by"] == "decoder"
            st, out = await h.post("/tokenize", {"prompt": "one three seventeen", "model": "mock-model"})
            assert st == 200 and out == {"count": 3, "max_model_len": 4096, "tokens": [3, 5, 9]}
            st, out = await h.post("/detokenize", {"tokens": [2, 1]})
            assert st == 200 and out == {"prompt": "xx x"}
            calls = h.decoders[0].passthrough
            assert [c[0] for c in calls] == ["GET /v1/models", "POST /tokenize", "POST /detokenize"]
            assert calls[1][1] == {"prompt": "one three seventeen", "model": "mock-model"}  # the body as sent
            assert all(c[2] == "Bearer sekret" for c in calls)  # the backend key, as for generation
            assert h.prefillers[0].passthrough == []
            # the calls are counted under their own endpoint
            assert 'lw_proxy_requests_total{endpoint="/tokenize",status="200"} 1.0' in await h.metrics()

    run(body())


def test_a_failing_decoder_is_skipped_and_none_left_is_a_502():
    async def body():
        async with harness() as h:
            h.decoders[0].knobs.status = 503
            async with h.session.get(h.url + "/v1/models") as r:
                assert r.status == 200 and (await r.json())["data"][0]["owned_by"] == "prefiller"
            h.prefillers[0].knobs.status = 503
            async with h.session.get(h.url + "/v1/models") as r:
                assert r.status == 502
                err = (await r.json())["error"]
            assert "no backend answered GET /v1/models" in err["message"] and "HTTP 503" in err["message"]

    run(body())


def test_passthrough_needs_the_client_key_when_one_is_set():
    async def body():
        async with harness(api_key="client-key") as h:
            async with h.session.get(h.url + "/v1/models") as r:
                assert r.status == 401
            async with h.session.get(h.url + "/v1/models", headers={"Authorization": "bearer client-key"}) as r:
                assert r.status == 200
            assert len(h.decoders[0].passthrough) == 1

    run(body())
