"""Hostile bodies over real HTTP: whatever a client sends, lw-proxy answers a 4xx naming the problem
(or passes a valid request on), never a 5xx of its own, and stays up.

tests/proxy/test_validation.py checks every rule and fuzzes the parsers directly; this sweep sends
hypothesis-built bodies through the whole app (body reading, size limits, routing, error rendering,
re-encoding for the decoder): wrong types, huge and non-finite numbers, deep nesting, invalid UTF-8
inside strings, lone surrogates, duplicate keys, oversize bodies, lying Content-Length headers, on
every generation endpoint and the metaserver. The mock decoder answers every request that passes
validation with 418, so a valid body is visible (and can never make the mock generate for long).
"""

from __future__ import annotations

import asyncio

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lw_dev.proxy_mocks import harness, run

MAX_BODY = 4096
ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/v1/metaserver"]
CLIENT_STATUSES = {400, 404, 405, 409, 413, 418}

FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options",
          "model", "temperature", "kv_transfer_params", "min_tokens", "lw_parent_id", "request_id", "role", "content"]

scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**63, max_value=2**200)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30))
json_values = st.recursive(scalars, lambda k: st.lists(k, max_size=4) | st.dictionaries(st.sampled_from(FIELDS), k, max_size=4),
                           max_leaves=20)
# Raw fragments msgspec's encoder would never write: non-finite literals, invalid UTF-8, lone
# surrogates, control characters, duplicate keys, deep nesting, trailing garbage.
raw_values = st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-0", b"1" * 400, b'"\xff\xfe"',
                              b'"\\ud800"', b'"\\udfff\\ud800"', b'"a\x00b"', b'"\x1f"', b"[" * 300 + b"]" * 300,
                              b'{"a": ' * 200 + b"1" + b"}" * 200, b"tru", b'"unterminated'])


@st.composite
def bodies(draw) -> bytes:
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=200))
    if kind == 1:
        return msgspec.json.encode(draw(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6)))
    # a plausible body with one hostile raw value spliced in (possibly twice: duplicate keys)
    base = {"prompt": draw(st.sampled_from(["hi", [1, 2, 3], ["a", "b"]])), "max_tokens": 4}
    if draw(st.booleans()):
        base = {"messages": [{"role": "user", "content": "hi"}]}
    field = draw(st.sampled_from(FIELDS)).encode()
    raw = draw(raw_values)
    enc = msgspec.json.encode(base)
    dup = b', "%s": %s' % (field, raw) if kind == 3 else b""
    return enc[:-1] + b', "%s": %s%s}' % (field, raw, dup)


async def _send(h, path: str, raw: bytes, lie: bool) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if lie:  # a Content-Length beyond the limit, whatever the body
        headers["Content-Length"] = str(MAX_BODY * 100)
        reader, writer = await asyncio.open_connection(*h.url.removeprefix("http://").split(":"))
        try:
            writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {MAX_BODY * 100}\r\nConnection: close\r\n\r\n".encode() + raw)
            await writer.drain()
            # The proxy answers before the (never sent) rest of the body: read by Content-Length.
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            lines = head.decode().split("\r\n")
            length = next(int(x.split(":", 1)[1]) for x in lines if x.lower().startswith("content-length:"))
            body = await asyncio.wait_for(reader.readexactly(length), 10)
        finally:
            writer.close()
        return int(lines[0].split(" ", 2)[1]), body
    async with h.session.post(h.url + path, data=raw, headers=headers) as r:
        return r.status, await r.read()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(ENDPOINTS), bodies(), st.booleans()),
                min_size=1, max_size=12))
def test_hostile_bodies_get_4xx_over_http_never_5xx(cases):
    async def body():
        async with harness(max_body_bytes=MAX_BODY) as h:
            h.decoders[0].knobs.status = 418
            for path, raw, lie in cases:
                status, out = await _send(h, path, raw, lie and len(raw) < MAX_BODY)
                assert status in CLIENT_STATUSES, (path, raw[:120], status, out[:300])
                err = msgspec.json.decode(out)["error"]
                assert isinstance(err["message"], str) and err["message"], out[:300]
            # still serving after all of it
            s, _ = await h.post("/v1/completions", {"prompt": "ok", "max_tokens": 2})
            assert s == 418
            assert len(h.proxy.registry) == 0

    run(body(), timeout=60)


def test_oversize_and_deep_bodies_are_refused_without_reading_them_all():
    async def body():
        async with harness(max_body_bytes=MAX_BODY) as h:
            for path in ENDPOINTS[:2]:
                for raw in (b'{"prompt": "' + b"x" * (MAX_BODY * 4) + b'"}', b"[" * 100000):
                    status, out = await _send(h, path, raw, False)
                    assert status == 413, (path, status)
                    assert str(MAX_BODY) in msgspec.json.decode(out)["error"]["message"]
            status, out = await _send(h, "/v1/completions", b'{"prompt": "x"}', True)
            assert status == 413 and b"exceeds the limit" in out

    run(body())
