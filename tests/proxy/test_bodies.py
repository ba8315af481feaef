"""Request bodies are read whole, however they arrive: large bodies, many small
chunks, curl's ``Expect: 100-continue``; a body that ends short is a 400, one over the limit a 413.
Everything over real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import shutil

import msgspec
import pytest
from raw_http import chunked, exchange, head

from lw_dev.proxy_mocks import generate, harness, run


def _body(prompt_len: int) -> bytes:
    return msgspec.json.encode({"prompt": "a" * prompt_len, "max_tokens": 2})


@pytest.mark.parametrize("size", [1 << 20, 16 << 20])
def test_large_bodies_are_read_whole(size):
    async def body():
        async with harness(continue_after_prefill=False) as h:
            raw = _body(size)
            async with h.session.post(h.url + "/v1/completions", data=raw,
                                      headers={"Content-Type": "application/json"}) as r:
                out = await r.json()
                assert r.status == 200, out
            assert out["choices"][0]["text"] == "".join(generate("a" * size, 2))
            assert len(h.decoders[0].bodies[0]["prompt"]) == size
            assert len(h.prefillers[0].bodies[0]["prompt"]) == size

    run(body(), timeout=60)


def test_chunked_body_in_many_small_pieces():
    async def body():
        async with harness() as h:
            raw = _body(20_000)
            pieces = [raw[i:i + 97] for i in range(0, len(raw), 97)]  # ~200 chunks, sent apart
            status, out = await exchange(h.url, [head("/v1/completions", chunked=True)] + chunked(pieces),
                                         pause=0.001)
            assert status == 200, out
            assert out["choices"][0]["text"] == "".join(generate("a" * 20_000, 2))

    run(body())


def test_body_split_across_segments_with_content_length():
    async def body():
        async with harness() as h:
            raw = msgspec.json.encode({"prompt": "hello", "max_tokens": 2})  # 100 bytes or so, in 3 parts
            status, out = await exchange(h.url, [head("/v1/completions", length=len(raw)), raw[:10], raw[10:40],
                                                 raw[40:]], pause=0.02)
            assert status == 200, out
            assert out["choices"][0]["text"] == "".join(generate("hello", 2))

    run(body())


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed on this machine")
def test_curl_expect_100_continue(tmp_path):
    async def body():
        async with harness() as h:
            path = tmp_path / "body.json"
            path.write_bytes(_body(300_000))
            proc = await asyncio.create_subprocess_exec(
                "curl", "-sS", "-v", "--max-time", "20", "-H", "Content-Type: application/json",
                "-H", "Expect: 100-continue", "--data-binary", f"@{path}", "-w", "\n%{http_code}",
                h.url + "/v1/completions", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 30)
            assert b"100 Continue" in err, err[-2000:]  # the handshake really took place
            text, code = out.rsplit(b"\n", 1)
            assert code == b"200", text[:500]
            assert msgspec.json.decode(text)["choices"][0]["text"] == "".join(generate("a" * 300_000, 2))

    run(body())


def test_body_over_the_limit_is_413_even_without_content_length():
    async def body():
        async with harness(max_body_bytes=4096) as h:
            raw = _body(10_000)
            pieces = [raw[i:i + 1000] for i in range(0, len(raw), 1000)]
            status, out = await exchange(h.url, [head("/v1/completions", chunked=True)] + chunked(pieces))
            assert status == 413 and "--max-body-bytes" in out["error"]["message"]
            assert out["error"]["type"] == "invalid_request_error"
            assert h.decoders[0].bodies == []

    run(body())


def test_body_shorter_than_content_length_is_400_when_the_client_stalls():
    async def body():
        async with harness(client_body_timeout=0.3) as h:
            raw = msgspec.json.encode({"prompt": "p", "max_tokens": 1})  # complete JSON, but announced longer
            status, out = await exchange(h.url, [head("/v1/completions", length=len(raw) + 50), raw])
            assert status == 400, out
            msg = out["error"]["message"]
            assert "incomplete" in msg and f"{len(raw)} bytes of the {len(raw) + 50} announced" in msg
            assert h.decoders[0].bodies == []

    run(body())


def test_body_shorter_than_content_length_is_400_when_the_client_half_closes():
    async def body():
        async with harness() as h:
            raw = msgspec.json.encode({"prompt": "p", "max_tokens": 1})
            status, out = await exchange(h.url, [head("/v1/completions", length=len(raw) + 50), raw],
                                         half_close=True)
            assert status == 400, out
            assert "the client ended it" in out["error"]["message"]
            assert h.decoders[0].bodies == []

    run(body())
