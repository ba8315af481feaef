"""Every validation rule: bad input gets a 4xx in OpenAI's error shape naming the problem, never a 500,
and never reaches a backend."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lw_dev.proxy_mocks import harness, run
from lw_proxy.errors import ProxyError
from lw_proxy.validate import parse_chat, parse_completion

BAD_COMPLETIONS = [
    # (raw body, status, text the message must contain, param)
    (b"{not json", 400, "not valid JSON", None),
    (b"", 400, "not valid JSON", None),
    (b"[1, 2]", 400, "must be a JSON object", None),
    (b'"prompt"', 400, "must be a JSON object", None),
    (b"\xff\xfe{}", 400, "not valid JSON", None),
    (b"[" * 5000 + b"]" * 5000, 400, "nested too deeply", None),
    (b'{"max_tokens": 3}', 400, "prompt", None),
    (b'{"prompt": 5}', 400, "prompt", "prompt"),
    (b'{"prompt": "x", "max_tokens": "5"}', 400, "Expected `int | null`, got `str`", "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 0}', 400, ">= 1", "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 100000000000000000000000000000}', 400, "<= 2147483648", "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 1.5}', 400, "Expected `int | null`", "max_tokens"),
    (b'{"prompt": "x", "n": 0}', 400, ">= 1", "n"),
    (b'{"prompt": "x", "stream": "yes"}', 400, "Expected `bool | null`", "stream"),
    (b'{"prompt": []}', 400, "must not be an empty list", "prompt"),
    (b'{"prompt": ["a", [1]]}', 400, "only strings or only token lists", "prompt"),
    (b'{"prompt": [[1], "a"]}', 400, "prompt[1]", "prompt"),
    (b'{"prompt": [[]]}', 400, "prompt[0]", "prompt"),
    (b'{"prompt": [1, -2]}', 400, "token ids must be integers", "prompt"),
    (b'{"prompt": [1, 99999999999]}', 400, "token ids must be integers", "prompt"),
    (b'{"prompt": [1, "a"]}', 400, "token ids must be integers", "prompt"),
    (b'{"prompt": [true]}', 400, "accepted forms", "prompt"),
    (b'{"prompt": [{"a": 1}]}', 400, "accepted forms", "prompt"),
    (b'{"prompt": "x", "kv_transfer_params": {}}', 400, "set by the proxy", "kv_transfer_params"),
    (b'{"prompt": ["a"], "n": 5000}', 400, "<= 256", "n"),
    (b'{"prompt": ' + b'["a",' * 0 + msgspec.json.encode(["a"] * 5000) + b"}", 400, "at most 4096", "prompt"),
]

BAD_CHATS = [
    (b'{"messages": []}', 400, "length >= 1", "messages"),
    (b'{"messages": "hi"}', 400, "Expected `array`", "messages"),
    (b'{"messages": [{"content": "hi"}]}', 400, "missing required field `role`", "messages[0]"),
    (b'{"messages": [{"role": 1}]}', 400, "Expected `str`", "messages[0].role"),
    (b'{"messages": [{"role": "user"}], "max_completion_tokens": -1}', 400, ">= 1", "max_completion_tokens"),
]


@pytest.mark.parametrize("raw,status,text,param", BAD_COMPLETIONS)
def test_bad_completion_bodies(raw, status, text, param):
    with pytest.raises(ProxyError) as ei:
        parse_completion(raw)
    e = ei.value
    assert e.status == status and text in e.message, e.message
    if param is not None:
        assert e.param == param
    body = msgspec.json.decode(e.body())
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status and body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw,status,text,param", BAD_CHATS)
def test_bad_chat_bodies(raw, status, text, param):
    with pytest.raises(ProxyError) as ei:
        parse_chat(raw)
    assert ei.value.status == status and text in ei.value.message, ei.value.message
    assert ei.value.param == param


def test_good_bodies_keep_every_field():
    r = parse_completion(b'{"prompt": ["a", "b"], "n": 3, "max_tokens": 7, "temperature": 0, "x_vendor": [1]}')
    assert r.children == 6 and r.max_tokens == 7 and r.prompts == ["a", "b"] and not r.stream
    assert r.body["temperature"] == 0 and r.body["x_vendor"] == [1]
    c = parse_chat(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "stream": null}')
    assert c.chat and c.children == 1 and not c.stream


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=10), kids, max_size=5),
    max_leaves=30,
)
fields = st.sampled_from(["prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stream",
                          "stream_options", "model", "kv_transfer_params"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(fields, json_values, max_size=6) | json_values)
def test_fuzzed_bodies_are_accepted_or_refused_with_4xx(value):
    raw = msgspec.json.encode(value)
    for parse in (parse_completion, parse_chat):
        try:
            parse(raw)
        except ProxyError as e:
            assert 400 <= e.status < 500 and e.message


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_fuzzed_bytes_never_crash(raw):
    for parse in (parse_completion, parse_chat):
        try:
            parse(raw)
        except ProxyError as e:
            assert 400 <= e.status < 500


def test_bad_input_over_http_is_4xx_json_and_never_reaches_a_backend():
    async def body():
        async with harness(max_body_bytes=2048) as h:
            cases = [(path, raw, s) for raw, s, _, _ in BAD_COMPLETIONS for path in ["/v1/completions"]]
            cases += [("/v1/chat/completions", raw, s) for raw, s, _, _ in BAD_CHATS]
            cases.append(("/v1/completions", b'{"prompt": "' + b"x" * 4000 + b'"}', 413))
            for path, raw, want in cases:
                async with h.session.post(h.url + path, data=raw,
                                          headers={"Content-Type": "application/json"}) as r:
                    assert r.status in (want, 413), (raw[:60], r.status)
                    err = (await r.json())["error"]
                    assert err["code"] == r.status and err["message"]
            assert h.decoders[0].bodies == [] and h.prefillers[0].bodies == []
            m = await h.metrics()
            assert 'lw_proxy_requests_total{endpoint="/v1/completions",status="413"}' in m
            assert 'lw_proxy_errors_total{kind="bad_request"}' in m

    run(body())


def test_metaserver_validation():
    async def body():
        async with harness() as h:
            url = h.url + "/v1/metaserver"
            s, out = await h.post("/v1/metaserver", {"lw_parent_id": "nope", "request_id": "r"})
            assert s == 404 and out["error"]["param"] == "lw_parent_id" and "unknown" in out["error"]["message"]
            for raw, text in [(b"{", "truncated"), (b'{"lw_parent_id": "p"}', "request_id"),
                              (b'{"lw_parent_id": 1, "request_id": "r"}', "lw_parent_id"),
                              (b'{"lw_parent_id": "", "request_id": "r"}', "length >= 1"),
                              (b"[]", "Expected `object`")]:
                async with h.session.post(url, data=raw) as r:
                    assert r.status == 400, raw
                    assert text in (await r.json())["error"]["message"]
            async with h.session.post(url, data=b'{"lw_parent_id": "' + b"a" * 70000 + b'"}') as r:
                assert r.status == 413
            parent = h.proxy.registry.open(1, None)
            parent.result = (200, b'{"status":"ok"}')  # prefill done: a repeated POST gets the same answer
            parent.ids.add("r1")
            s, out = await h.post("/v1/metaserver", {"lw_parent_id": parent.id, "request_id": "r1"})
            assert s == 200 and out == {"status": "ok"}
            parent.result = None
            s, out = await h.post("/v1/metaserver", {"lw_parent_id": parent.id, "request_id": "r2"})
            assert s == 409 and out["error"]["param"] == "request_id"
            h.proxy.registry.close(parent)

    run(body())
