"""The proxy's SSE relay (lw_proxy.sse_relay.SseRelay) on its own: no backends, no Proxy. An
``Upstream`` stand-in answers each decoder call with canned SSE blocks; the relay forwards them,
holds back a recomputed choice's finish and resumes it through a second call, ends the stream with
one [DONE], and hands every call it got back to ``Upstream.finish`` exactly once. The same paths
through the whole proxy are test_flow.py, test_resume.py and test_deadlines.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from lw_proxy.config import parse_args
from lw_proxy.errors import ProxyError
from lw_proxy.metrics import ProxyMetrics
from lw_proxy.sse_relay import SseRelay
from lw_proxy.upstream import DecoderCall
from lw_proxy.validate import ClientRequest, parse_completion


def _event(text: str, finish: str | None = None, stop: str | None = None) -> bytes:
    ev = {"id": "cmpl-1", "object": "text_completion",
          "choices": [{"index": 0, "text": text, "finish_reason": finish, "stop_reason": stop}]}
    return b"data: " + json.dumps(ev).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


class _Content:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def readany(self) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""

    def at_eof(self) -> bool:
        return not self.chunks


class Upstream:
    """Each ``decode`` answers with the next list of chunks (the first one is the call's first bytes)."""

    def __init__(self, answers: list[list[bytes] | ProxyError]) -> None:
        self.answers = answers
        self.requests: list[ClientRequest] = []
        self.finished: list[DecoderCall] = []
        self.calls: list[DecoderCall] = []

    async def decode(self, req: ClientRequest, path: str, read: bool,
                     relay: asyncio.Future | None = None) -> tuple[int, bytes, str] | DecoderCall:
        assert not read
        self.requests.append(req)
        answer = self.answers.pop(0)
        if isinstance(answer, ProxyError):
            raise answer
        resp: Any = type("Resp", (), {"content": _Content(answer[1:])})()
        call = DecoderCall(None, None, resp, 0, 0.0, answer[0])  # type: ignore[arg-type]
        self.calls.append(call)
        return call

    def finish(self, call: DecoderCall) -> None:
        self.finished.append(call)

    def continues_stream(self, req: ClientRequest) -> bool:
        return False  # no prefill here: every stream is the decoder's

    async def prefill_alone(self, req: ClientRequest) -> Any:
        raise AssertionError("no prefill here")

    def close_parent(self, parent: Any, answered: bool) -> None:
        raise AssertionError("no prefill here")


async def _run(upstream: Upstream, body: dict[str, Any]) -> list[Any]:
    cfg, _ = parse_args([])
    relay = SseRelay(cfg, ProxyMetrics(), upstream)

    async def handler(request: web.Request) -> web.StreamResponse:
        req = parse_completion(await request.read())
        return await relay.stream(request, req, "/v1/completions", asyncio.get_running_loop().time() + 10)

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    async with TestClient(TestServer(app)) as client:
        r = await client.post("/v1/completions", data=json.dumps(body))
        assert r.status == 200
        raw = (await r.read()).decode()
    events = [b[len("data: "):] for b in raw.strip().split("\n\n")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_a_recomputed_choice_is_resumed_through_a_second_call_and_every_call_is_finished() -> None:
    upstream = Upstream([
        [_event(" a"), _event(" b", "stop", "recomputed") + DONE],
        [_event(" c"), _event(" d", "length"), DONE],
    ])
    events = asyncio.run(_run(upstream, {"prompt": "p", "max_tokens": 6, "stream": True}))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    choices = [e["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in choices) == " a b c d"
    assert [c["finish_reason"] for c in choices] == [None, None, None, "length"]  # the recomputed finish held back
    assert all(e["id"] == "cmpl-1" for e in events[:-1])
    assert upstream.requests[1].body["prompt"] == "p a b"  # the rest, after what the client got
    assert upstream.finished == upstream.calls and len(upstream.calls) == 2


def test_a_resubmission_that_finds_no_decoder_ends_the_started_stream_with_an_error_event() -> None:
    upstream = Upstream([
        [_event(" a", "stop", "recomputed"), DONE],
        ProxyError(502, "no decoder completed the request after 1 attempts"),
    ])
    events = asyncio.run(_run(upstream, {"prompt": "p", "max_tokens": 6, "stream": True}))
    assert events[0]["choices"][0]["text"] == " a" and events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 502 and "no decoder completed" in events[-2]["error"]["message"]
    assert upstream.finished == upstream.calls and len(upstream.calls) == 1


def test_a_decoder_stream_closed_before_done_ends_with_an_error_event() -> None:
    upstream = Upstream([[_event(" a")]])  # the connection ends before [DONE]
    events = asyncio.run(_run(upstream, {"prompt": "p", "max_tokens": 6, "stream": True}))
    assert events[0]["choices"][0]["text"] == " a" and events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 502 and "before [DONE]" in events[-2]["error"]["message"]
    assert upstream.finished == upstream.calls
