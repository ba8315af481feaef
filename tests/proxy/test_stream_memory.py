"""A stream's memory does not grow with its length: the proxy keeps no copy of the
events it forwarded, only what resuming a recomputed choice needs, capped by --max-resume-bytes."""

from __future__ import annotations

import os
import tracemalloc

import msgspec

import lw_proxy
from lw_dev.proxy_mocks import generate, harness, run
from lw_proxy.recompute import StreamLedger

_PROXY_FILES = os.path.join(os.path.dirname(lw_proxy.__file__), "*")


def _held_by_proxy() -> int:
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, _PROXY_FILES)])
    return sum(s.size for s in snap.statistics("filename"))


def test_long_stream_keeps_bounded_memory_in_the_proxy():
    tokens = 8000

    async def body():
        async with harness(max_resume_bytes=4096) as h:
            async with h.session.post(h.url + "/v1/completions",
                                      json={"prompt": "p", "max_tokens": tokens, "stream": True}) as r:
                assert r.status == 200
                got = 0
                base = None
                while got < tokens - 10:
                    await r.content.readuntil(b"\n\n")
                    got += 1
                    if got == 200:
                        base = _held_by_proxy()
                # mid-stream, ~8000 events (~800 KB of SSE) forwarded: what the proxy still holds
                held = _held_by_proxy() - base
                rest = await r.read()
            assert rest.endswith(b"data: [DONE]\n\n")
            return held

    tracemalloc.start()
    try:
        held = run(body(), timeout=60)
    finally:
        tracemalloc.stop()
    assert held < 64 << 10, f"the proxy retained {held} bytes over a long stream"


def test_ledger_is_capped_and_refuses_a_resume_past_the_cap():
    led = StreamLedger(chat=False, limit=1000)
    ev = b"".join(b"data: " + msgspec.json.encode({"choices": [{"index": 0, "text": w}]}) + b"\n\n"
                  for w in generate("p", 100))
    led.feed_block(ev)
    assert led.text(0) == "".join(generate("p", 100)) and led.generated(0) == 100 and not led.overflowed
    for _ in range(10):
        led.feed_block(ev)
    assert led.overflowed and led.size == 0 and led.generated(0) == 1100


def test_recompute_past_the_resume_cap_ends_the_stream_with_a_clear_error():
    async def body():
        async with harness(max_resume_bytes=64) as h:
            h.decoders[0].knobs.recompute_after = 40  # 40 words of ~4 bytes: past the 64-byte cap
            async with h.session.post(h.url + "/v1/completions",
                                      json={"prompt": "p", "max_tokens": 60, "stream": True}) as r:
                raw = (await r.read()).decode()
            events = [b[len("data: "):] for b in raw.strip().split("\n\n")]
            assert events[-1] == "[DONE]"
            err = msgspec.json.decode(events[-2])["error"]
            assert err["code"] == 502 and "--max-resume-bytes" in err["message"]

    run(body())


def test_decoder_stream_without_event_boundaries_is_cut_not_buffered(monkeypatch):
    from lw_proxy import sse_relay

    monkeypatch.setattr(sse_relay, "MAX_EVENT_BYTES", 64 << 10)

    async def body():
        async with harness() as h:
            orig = h.proxy.decode

            async def decode(req, path, read, relay=None):  # a decoder whose stream never ends an event
                call = await orig(req, path, read, relay=relay)
                call.first = b"data: " + b"x" * (100 << 10)
                return call

            h.proxy.decode = decode
            async with h.session.post(h.url + "/v1/completions",
                                      json={"prompt": "p", "max_tokens": 3, "stream": True}) as r:
                raw = (await r.read()).decode()
            events = [b[len("data: "):] for b in raw.strip().split("\n\n")]
            assert events[-1] == "[DONE]" and len(events) == 2
            assert "without ending an SSE event" in msgspec.json.decode(events[0])["error"]["message"]

    run(body())
