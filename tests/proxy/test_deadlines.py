"""One deadline per client request, a first-byte timeout and a stream idle timeout:
a hung decoder costs a client seconds, not 4 x --backend-timeout, and every expiry says which limit."""

from __future__ import annotations

import time

import msgspec

from lw_dev.proxy_mocks import generate, harness, run, wait_until
from lw_proxy.config import ProxyConfig, parse_args
from lw_proxy.errors import ProxyError


async def _stream(h, body):
    async with h.session.post(h.url + "/v1/completions", json=body) as r:
        return r.status, (await r.read()).decode()


def _events(raw: str) -> list:
    out = []
    for block in raw.strip().split("\n\n"):
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else msgspec.json.decode(payload))
    return out


def test_defaults_bound_a_request_to_minutes_not_40():
    cfg, _ = parse_args([])
    assert cfg.request_timeout == ProxyConfig().request_timeout == 600
    assert cfg.first_byte_timeout < cfg.request_timeout and cfg.stream_idle_timeout < cfg.request_timeout


def test_hung_decoder_non_streaming_gets_504_at_the_request_deadline():
    async def body():
        async with harness(request_timeout=0.5, max_retries=3) as h:
            h.decoders[0].knobs.delay = 30  # accepts the request, never answers
            t0 = time.monotonic()
            status, out = await h.post("/v1/completions", {"prompt": "p", "max_tokens": 2})
            took = time.monotonic() - t0
            assert status == 504, out
            assert out["error"]["type"] == "timeout_error" and "--request-timeout" in out["error"]["message"]
            assert took < 3, took
            await wait_until(lambda: h.decoders[0].aborted == 1, what="the decoder's request aborted")
            await wait_until(lambda: len(h.proxy.registry) == 0, what="the parent freed")
            assert 'lw_proxy_errors_total{kind="timeout"} 1.0' in await h.metrics()

    run(body())


def test_silent_decoder_is_skipped_after_the_first_byte_timeout():
    async def body():
        async with harness(n_decode=2, first_byte_timeout=0.3) as h:
            for d in h.decoders:
                d.knobs.delay = 30
            h.decoders[0].knobs.health_status = h.decoders[1].knobs.health_status = 503
            status, raw = await _stream(h, {"prompt": "p", "max_tokens": 2, "stream": True})
            err = msgspec.json.decode(raw)["error"]
            assert status == 504 and "--first-byte-timeout" in err["message"] and err["type"] == "timeout_error"

            h.decoders[1].knobs.delay = 0  # one decoder hangs, the other answers: the client never notices
            for b in h.proxy.decoders.backends:
                b.mark_ok()
            for _ in range(2):
                status, raw = await _stream(h, {"prompt": "p", "max_tokens": 3, "stream": True})
                ev = _events(raw)
                assert status == 200 and ev[-1] == "[DONE]"
                assert "".join(e["choices"][0]["text"] for e in ev[:-1]) == "".join(generate("p", 3))

    run(body())


def test_stream_idle_timeout_ends_the_stream_with_an_error_event():
    async def body():
        async with harness(stream_idle_timeout=0.3) as h:
            h.decoders[0].knobs.token_delay = 5  # one token, then silence
            t0 = time.monotonic()
            status, raw = await _stream(h, {"prompt": "p", "max_tokens": 4, "stream": True})
            assert status == 200 and time.monotonic() - t0 < 3
            ev = _events(raw)
            assert ev[-1] == "[DONE]" and ev[0]["choices"][0]["text"] == generate("p", 1)[0]
            err = ev[-2]["error"]
            assert err["code"] == 504 and "--stream-idle-timeout" in err["message"]
            await wait_until(lambda: h.decoders[0].aborted == 1, what="the stalled stream aborted upstream")

    run(body())


def test_request_deadline_ends_a_running_stream_with_an_error_event():
    async def body():
        async with harness(request_timeout=0.6, stream_idle_timeout=5) as h:
            h.decoders[0].knobs.token_delay = 0.05  # steady tokens, too many to finish in time
            status, raw = await _stream(h, {"prompt": "p", "max_tokens": 1000, "stream": True})
            ev = _events(raw)
            assert status == 200 and ev[-1] == "[DONE]"
            assert ev[-2]["error"]["code"] == 504 and "--request-timeout" in ev[-2]["error"]["message"]
            assert 2 < len(ev) < 100
            await wait_until(lambda: h.decoders[0].aborted == 1, what="the stream aborted upstream")

    run(body())


def test_resubmission_without_a_decoder_ends_the_started_stream_with_an_error_event():
    async def body():
        async with harness(max_retries=0) as h:
            h.decoders[0].knobs.recompute_after = 2
            orig = h.proxy.decode
            calls = 0

            async def decode(req, path, read, relay=None):  # every decoder is gone once the first answer streamed
                nonlocal calls
                calls += 1
                if calls > 1:
                    raise ProxyError(502, "no decoder completed the request after 1 attempts; last error: down")
                return await orig(req, path, read, relay=relay)

            h.proxy.decode = decode
            status, raw = await _stream(h, {"prompt": "p", "max_tokens": 5, "stream": True})
            ev = _events(raw)
            assert status == 200 and ev[-1] == "[DONE]"
            assert "".join(e["choices"][0]["text"] for e in ev[:-2]) == "".join(generate("p", 2))
            assert ev[-2]["error"]["code"] == 502 and "no decoder completed" in ev[-2]["error"]["message"]

    run(body())
