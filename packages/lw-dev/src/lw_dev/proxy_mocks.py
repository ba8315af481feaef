"""Mock vLLM OpenAI servers (decoder / prefiller) and a harness that runs them with lw-proxy on 127.0.0.1.

The mock decoder behaves like the real connector will: for every engine request it derives from the
body (prompts x n, counted by itself, not from ``lw_children``), it POSTs
``{"lw_parent_id", "request_id"}`` to the ``metaserver`` URL it was given and waits for the answer
before "decoding". Its "model" is deterministic in the context text: the next word depends only on
prompt + text generated so far, so a resubmitted continuation yields exactly the uninterrupted answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from lw_core.wire import DecodeTransferParams, MetaserverRequest, decode_transfer_params
from lw_proxy import server
from lw_proxy.app import PROXY_KEY
from lw_proxy.config import ProxyConfig


def next_word(context: str) -> str:
    return f" w{(len(context) * 7 + 3) % 101}"


def generate(context: str, n_tokens: int) -> list[str]:
    out = []
    for _ in range(n_tokens):
        w = next_word(context + "".join(out))
        out.append(w)
    return out


def chat_context(messages: list[dict[str, Any]]) -> str:
    return "".join(str(m.get("content") or "") for m in messages)


@dataclass
class Knobs:
    status: int | None = None  # answer every generation request with this status (JSON error)
    delay: float = 0.0  # seconds before answering
    token_delay: float = 0.0  # seconds between streamed tokens
    die_after: int | None = None  # decoder: drop the connection after this many tokens
    empty_200: bool = False
    skip_metaserver: bool = False
    recompute_after: int | None = None  # decoder: end the first answer after k tokens with "recomputed"
    recompute_times: int = 1
    reset_status: int = 200
    health_status: int = 200
    status_after_metaserver: int | None = None  # decoder: call the metaserver back, then fail with this
    fail_times: int | None = None  # status_after_metaserver for this many requests only (None: all)
    wait_metaserver: bool = True  # decoder: a failing request waits for its metaserver answers (False: fails at once)
    needs_prefill: bool | None = None  # decoder: sent in the metaserver body when not None
    send_token: bool = True  # decoder: send lw_token back on metaserver calls (an older connector does not)
    # decoder: the next streamed answer starts with this word instead of the model's (a near-tie the
    # decoder decides the other way than the prefiller); used once, then cleared
    first_word: str | None = None


@dataclass
class MockState:
    role: str
    knobs: Knobs = field(default_factory=Knobs)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    metaserver_results: list[tuple[int, Any]] = field(default_factory=list)
    aborted: int = 0
    completed: int = 0
    recomputed: int = 0
    resets: int = 0
    health_calls: int = 0
    started: asyncio.Event = field(default_factory=asyncio.Event)
    background: list[asyncio.Future] = field(default_factory=list)
    failed: int = 0
    passthrough: list[tuple[str, Any, str | None]] = field(default_factory=list)  # model list / tokenizer calls


def _choice_prompts(body: dict[str, Any]) -> list[Any]:
    p = body["prompt"]
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        return [p]
    return list(p)


async def _call_metaserver(session: aiohttp.ClientSession, st: MockState, params: dict[str, Any], n: int) -> None:
    dp = decode_transfer_params(params)  # what the real connector reads, with its checks
    assert isinstance(dp, DecodeTransferParams), dp

    async def one(i: int) -> None:
        body = msgspec.json.encode(MetaserverRequest(lw_parent_id=dp.lw_parent_id, request_id=f"cmpl-{uuid.uuid4().hex}-{i}",
                                                     needs_prefill=st.knobs.needs_prefill))
        headers = {"Content-Type": "application/json"}
        if st.knobs.send_token and dp.lw_token:
            headers["Authorization"] = f"Bearer {dp.lw_token}"
        try:
            async with session.post(dp.metaserver, data=body, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=30)) as r:
                st.metaserver_results.append((r.status, await r.json(content_type=None)))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            st.metaserver_results.append((None, repr(e)))

    await asyncio.gather(*(one(i) for i in range(n)))


SESSION = web.AppKey("session", aiohttp.ClientSession)


def make_backend(role: str) -> tuple[web.Application, MockState]:
    st = MockState(role)
    app = web.Application(client_max_size=64 << 20)  # the proxy forwards bodies up to its --max-body-bytes

    async def gen(request: web.Request) -> web.StreamResponse:
        try:
            return await _gen(request)
        except asyncio.CancelledError:  # the proxy dropped the connection: vLLM would abort here
            st.aborted += 1
            raise

    async def _gen(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        st.bodies.append(body)
        st.auth.append(request.headers.get("Authorization"))
        st.started.set()
        k = st.knobs
        if k.delay:
            await asyncio.sleep(k.delay)
        if k.status is not None:
            return web.json_response({"error": {"message": "mock failure", "type": "x", "param": None,
                                                "code": k.status}}, status=k.status)
        chat = request.path.endswith("chat/completions")
        params = body.get("kv_transfer_params") or {}
        n = body.get("n") or 1
        prompts = [None] if chat else _choice_prompts(body)
        failing = k.status_after_metaserver is not None and (k.fail_times is None or st.failed < k.fail_times)
        if role == "decoder" and params.get("do_remote_prefill") and not k.skip_metaserver:
            calls = _call_metaserver(request.app[SESSION], st, params, len(prompts) * n)
            if k.wait_metaserver or not failing:
                await calls
            else:
                st.background.append(asyncio.ensure_future(calls))
        if failing:
            st.failed += 1
            return web.json_response({"error": {"message": "mock failure after the metaserver call", "type": "x",
                                                "param": None, "code": k.status_after_metaserver}},
                                     status=k.status_after_metaserver)
        if k.empty_200:
            return web.Response(status=200, body=b"")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        choices = []
        for pi, p in enumerate(prompts):
            ctx = chat_context(body["messages"]) if chat else (p if isinstance(p, str) else " ".join(map(str, p)))
            for j in range(n):
                choices.append((pi * n + j, ctx))
        cut = None
        if k.recompute_after is not None and st.recomputed < k.recompute_times and role == "decoder":
            st.recomputed += 1
            cut = k.recompute_after
        if body.get("stream"):
            return await _stream(request, st, choices, max_tokens, cut, chat, body)
        out = []
        total = 0
        for idx, ctx in choices:
            words = generate(ctx, max_tokens if cut is None else min(cut, max_tokens))
            total += len(words)
            text = "".join(words)
            c: dict[str, Any] = {"index": idx, "finish_reason": "length" if cut is None else "stop",
                                 "stop_reason": None if cut is None else "recomputed"}
            if chat:
                c["message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
            out.append(c)
        st.completed += 1
        return web.json_response({"id": f"cmpl-{uuid.uuid4().hex}", "object": "chat.completion" if chat
                                  else "text_completion", "choices": out,
                                  "usage": {"prompt_tokens": 5, "completion_tokens": total, "total_tokens": 5 + total}})

    async def health(request: web.Request) -> web.Response:
        st.health_calls += 1
        return web.Response(status=st.knobs.health_status)

    async def reset(request: web.Request) -> web.Response:
        st.resets += 1
        return web.json_response({}, status=st.knobs.reset_status)

    async def models(request: web.Request) -> web.Response:
        st.passthrough.append(("GET /v1/models", None, request.headers.get("Authorization")))
        if st.knobs.status is not None:
            return web.json_response({"error": {"message": "mock"}}, status=st.knobs.status)
        return web.json_response({"object": "list", "data": [{"id": "mock-model", "object": "model",
                                                               "owned_by": st.role}]})

    async def tokenize(request: web.Request) -> web.Response:  # a "token" per word: enough to check the relay
        body = await request.json()
        st.passthrough.append(("POST /tokenize", body, request.headers.get("Authorization")))
        toks = [len(w) for w in str(body.get("prompt", "")).split()]
        return web.json_response({"count": len(toks), "max_model_len": 4096, "tokens": toks})

    async def detokenize(request: web.Request) -> web.Response:
        body = await request.json()
        st.passthrough.append(("POST /detokenize", body, request.headers.get("Authorization")))
        return web.json_response({"prompt": " ".join("x" * t for t in body.get("tokens", []))})

    async def on_startup(app: web.Application) -> None:
        app[SESSION] = aiohttp.ClientSession()

    async def on_cleanup(app: web.Application) -> None:
        await app[SESSION].close()

    app.router.add_post("/v1/completions", gen)
    app.router.add_post("/v1/chat/completions", gen)
    app.router.add_get("/health", health)
    app.router.add_post("/reset_prefix_cache", reset)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app, st


async def _stream(request: web.Request, st: MockState, choices: list[tuple[int, str]], max_tokens: int,
                  cut: int | None, chat: bool, body: dict[str, Any]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    rid = f"cmpl-{uuid.uuid4().hex}"
    k = st.knobs
    limit = max_tokens if cut is None else min(cut, max_tokens)
    sent = 0
    gen = {idx: generate(ctx, limit) for idx, ctx in choices}
    if k.first_word is not None and st.role == "decoder" and limit:
        for words in gen.values():
            words[0] = k.first_word
        k.first_word = None
    try:
        for t in range(limit):
            for idx, _ in choices:
                if k.die_after is not None and sent >= k.die_after:
                    request.transport.close()  # the decoder process "dies" mid-stream
                    return resp
                last = t == limit - 1
                c: dict[str, Any] = {"index": idx, "finish_reason": None, "stop_reason": None}
                if chat:
                    c["delta"] = {"content": gen[idx][t]}
                else:
                    c["text"] = gen[idx][t]
                if last:
                    c["finish_reason"] = "length" if cut is None else "stop"
                    c["stop_reason"] = None if cut is None else "recomputed"
                await resp.write(b"data: " + msgspec.json.encode({"id": rid, "choices": [c]}) + b"\n\n")
                sent += 1
            if k.token_delay:
                await asyncio.sleep(k.token_delay)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 5, "completion_tokens": sent, "total_tokens": 5 + sent}
            await resp.write(b"data: " + msgspec.json.encode({"id": rid, "choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        st.completed += 1
    except ConnectionResetError:
        st.aborted += 1
        raise
    return resp


def _bound_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


async def start_app(app: web.Application, sock: socket.socket | None = None) -> tuple[web.AppRunner, str]:
    sock = sock or _bound_socket()
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    host, port = sock.getsockname()[:2]
    return runner, f"http://{host}:{port}"


@dataclass
class Harness:
    url: str
    metaserver_url: str
    decoders: list[MockState]
    prefillers: list[MockState]
    session: aiohttp.ClientSession
    app: web.Application
    backend_urls: list[str]
    runners: list[web.AppRunner]

    @property
    def proxy(self):
        return self.app[PROXY_KEY]

    async def post(self, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
        async with self.session.post(self.url + path, json=body, **kw) as r:
            return r.status, await r.json(content_type=None)

    async def metrics(self) -> str:
        async with self.session.get(self.url + "/metrics") as r:
            return await r.text()


@contextlib.asynccontextmanager
async def harness(n_prefill: int = 1, n_decode: int = 1, **cfg: Any):
    runners = []
    decoders, prefillers, urls = [], [], {"prefiller": [], "decoder": []}
    try:
        for role, n, acc in (("prefiller", n_prefill, prefillers), ("decoder", n_decode, decoders)):
            for _ in range(n):
                app, st = make_backend(role)
                runner, url = await start_app(app)
                runners.append(runner)
                acc.append(st)
                urls[role].append(url)
        sock = _bound_socket()
        port = sock.getsockname()[1]
        msock = None
        if cfg.pop("dedicated_metaserver", False):
            msock = _bound_socket()
            cfg["metaserver_port"] = msock.getsockname()[1]
        base = dict(host="127.0.0.1", port=port, prefillers=urls["prefiller"], decoders=urls["decoder"],
                    retry_delay=0.01, metaserver_timeout=5.0, health_interval=0.2)
        base.update(cfg)
        pcfg = ProxyConfig(**base)
        prunners = await server.start(pcfg, sock, msock, shutdown_timeout=1.0)
        runners.extend(reversed(prunners))  # cleaned up in reverse: the client listener last
        purl = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            yield Harness(purl, pcfg.metaserver_url, decoders, prefillers, s, prunners[0].app,
                          urls["prefiller"] + urls["decoder"], runners)
    finally:
        for r in reversed(runners):
            await r.cleanup()


def run(coro, timeout: float = 30.0):
    """Run one test coroutine with a deadline (no pytest-asyncio in the dev group)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def wait_until(pred, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


__all__ = ["Harness", "Knobs", "chat_context", "generate", "harness", "make_backend", "replace", "run",
           "start_app", "wait_until"]
