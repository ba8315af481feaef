"""Mock vLLM OpenAI servers (decoder / prefiller) and a harness that runs them with lw-proxy on 127.0.0.1.

The mock decoder behaves like the real connector will: for every engine request it derives from the
body (prompts x n, counted by itself, not from ``lw_children``), it POSTs
``{"lw_parent_id", "request_id"}`` to the ``metaserver`` URL it was given and waits for the answer
before "decoding". Its "model" is deterministic in the context's token ids: the next token depends
only on the prompt's ids + the ids generated so far. A string is tokenized one character a token and
generated tokens are words (``" w<k>"``, one token each), so a continuation resubmitted by token ids
yields exactly the uninterrupted answer, and one resubmitted as prompt + generated text (re-tokenized
into characters) does not, as with a real tokenizer whose merges differ across the seam.

The answers have vLLM 0.32's shape where the proxy depends on it: ``prompt_token_ids``/``token_ids``
(lists with ``return_token_ids: true``, else null; chat: ``prompt_token_ids`` at the top of the first
event, which opens each choice with ``{"role": "assistant", "content": ""}``), ``logprobs`` when asked,
and a chat request's ``kv_transfer_params.prompt_token_ids`` taken as its prompt instead of its
rendered messages (text-only messages, no ``echo``).
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

WORD = 1 << 20  # token ids from here up are the words " w<id - WORD>"; below, one character each


def tokenize(text: str) -> list[int]:
    return [ord(c) for c in text]


def token_text(t: int) -> str:
    return f" w{t - WORD}" if t >= WORD else chr(t)


def generate_ids(prompt_ids: list[int], n_tokens: int) -> list[int]:
    total, length, out = sum(prompt_ids), len(prompt_ids), []
    for _ in range(n_tokens):
        t = WORD + (total * 7 + length * 3) % 101
        out.append(t)
        total, length = total + t, length + 1
    return out


def generate(context: str | list[int], n_tokens: int) -> list[str]:
    """The texts of the next ``n_tokens`` tokens after ``context`` (a text, or token ids)."""
    ids = tokenize(context) if isinstance(context, str) else list(context)
    return [token_text(t) for t in generate_ids(ids, n_tokens)]


def _stop_strings(toks: list[int], body: dict[str, Any]) -> tuple[list[int], str, str | None]:
    """A whole answer's tokens and text cut at its first stop string, as vLLM finds them (in the
    output text only, at each token in the text just added plus a stop string's length less one;
    the first stop string of the list that matches wins), and the stop string that ended it."""
    stop = body.get("stop") or []
    stops = [stop] if isinstance(stop, str) else stop
    text = ""
    for j, t in enumerate(toks):
        new = token_text(t)
        text += new
        for s in stops:
            at = text.find(s, max(0, len(text) - len(new) - len(s) + 1))
            if at >= 0:
                end = at + len(s) if body.get("include_stop_str_in_output") else at
                return toks[: j + 1], text[:end], s
    return toks, text, None


def chat_context(messages: list[dict[str, Any]]) -> str:
    return "".join(str(m.get("content") or "") for m in messages)


@dataclass
class Knobs:
    status: int | None = None  # answer every generation request with this status (JSON error)
    delay: float = 0.0  # seconds before answering
    answer_delay: float = 0.0  # decoder: seconds between its metaserver answers and its own (a load, a step)
    token_delay: float = 0.0  # seconds between streamed tokens
    die_after: int | None = None  # streams: drop the connection after this many tokens
    choice_delay: float = 0.0  # streams: seconds before each choice's event after the first choice's
    empty_200: bool = False
    skip_metaserver: bool = False
    recompute_after: int | None = None  # decoder: end the first answer after k tokens with "recomputed"
    recompute_times: int = 1
    reset_status: int = 200
    reset_success: bool = True  # the body of a 200 answer to /reset_prefix_cache: {"success": ...}, as vLLM's
    health_status: int = 200
    status_after_metaserver: int | None = None  # decoder: call the metaserver back, then fail with this
    fail_times: int | None = None  # status_after_metaserver for this many requests only (None: all)
    wait_metaserver: bool = True  # decoder: a failing request waits for its metaserver answers (False: fails at once)
    needs_prefill: bool | None = None  # decoder: sent in the metaserver body when not None
    # decoder: sent in the metaserver body; when true, each choice continues from the first token its
    # engine request's answer carries (as lw-vllm's decoder does)
    forces_first: bool | None = None
    # choice j > 0 of a prompt draws its tokens as if its prompt ended with j (sampled choices differ)
    distinct_choices: bool = False
    send_token: bool = True  # decoder: send lw_token back on metaserver calls (an older connector does not)
    # decoder: the next streamed answer starts with this word instead of the model's (a near-tie the
    # decoder decides the other way than the prefiller); used once, then cleared
    first_word: str | None = None
    first_word_choices: frozenset[int] | None = None  # only these choices start with first_word (None: all)
    # chat: the answer goes out as reasoning_content deltas, with no content (a reasoning model on a
    # server with a reasoning parser: chat usage carries completion_tokens_details, as vLLM's then
    # does; a one-token answer is parsed as the stream's last, which falls back to content)
    reasoning: bool = False
    # chat with tools: a tool parser holds the first token back (an event with an empty delta when
    # ids or log-probs are asked, else none) and sends it with the second as a tool call's opening
    # delta (id, name "f", arguments); later tokens are its arguments. A one-token answer is parsed
    # as the stream's last: content, as vLLM's finished parse falls back to
    tool_parser: bool = False
    # streams: every k-th token (k, 2k, ...) is sent with empty text (its text held back, as for a
    # partial UTF-8 character) and its text comes with the next token
    empty_every: int | None = None
    # the first token's text is held back (a partial UTF-8 character) and comes with the second; an
    # answer of that one token has empty text, as vLLM's; a continuation of a prefill
    # (lw_prefilled) begins its text with its prompt's last token's, as vLLM's detokenizer, primed
    # with the prompt, completes the character with the first token it generates
    hold_first: bool = False
    logprob: float = -0.5  # every token's logprob (tell a prefiller's from a decoder's)
    created: int = 0  # every answer's ``created`` (tell a prefiller's from a decoder's)


@dataclass
class MockState:
    role: str
    knobs: Knobs = field(default_factory=Knobs)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    metaserver_results: list[tuple[int | None, Any]] = field(default_factory=list)  # None: no answer
    metaserver_ids: list[str] = field(default_factory=list)  # the engine request ids that called, in order
    answered_first: dict[int, int] = field(default_factory=dict)  # choice index -> first token its answer carried
    aborted: int = 0
    completed: int = 0
    recomputed: int = 0
    resets: int = 0
    reset_queries: list[dict[str, str]] = field(default_factory=list)
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


async def _call_metaserver(session: aiohttp.ClientSession, st: MockState, params: dict[str, Any], prompts: int,
                           n: int = 1, base: str | None = None) -> None:
    """One metaserver POST per engine request, named as vLLM names them: prompt ``i`` of a
    completion ``f"cmpl-{base}-{i}"`` (``base``: the request's ``X-Request-Id``, else random) plus
    ``-`` and 8 random characters, choice ``j`` of a request of several choices ``f"{j}_{that}"``."""
    dp = decode_transfer_params(params)  # what the real connector reads, with its checks
    assert isinstance(dp, DecodeTransferParams), dp
    rid = base or uuid.uuid4().hex

    async def one(i: int) -> None:
        pi, j = divmod(i, n)
        engine_id = f"cmpl-{rid}-{pi}-{uuid.uuid4().hex[:8]}"
        request_id = engine_id if n == 1 else f"{j}_{engine_id}"
        st.metaserver_ids.append(request_id)
        body = msgspec.json.encode(MetaserverRequest(lw_parent_id=dp.lw_parent_id, request_id=request_id,
                                                     needs_prefill=st.knobs.needs_prefill,
                                                     forces_first=st.knobs.forces_first))
        headers = {"Content-Type": "application/json"}
        if st.knobs.send_token and dp.lw_token:
            headers["Authorization"] = f"Bearer {dp.lw_token}"
        try:
            async with session.post(dp.metaserver, data=body, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=30)) as r:
                answer = await r.json(content_type=None)
                st.metaserver_results.append((r.status, answer))
                if r.status == 200 and st.knobs.forces_first and isinstance(answer.get("first_token"), int):
                    st.answered_first[i] = answer["first_token"]
        except (TimeoutError, aiohttp.ClientError) as e:
            st.metaserver_results.append((None, repr(e)))

    await asyncio.gather(*(one(i) for i in range(prompts * n)))


SESSION = web.AppKey("session", aiohttp.ClientSession)


class _MetaserverOk:
    """Equals a mock's ``metaserver_results`` entry for a 200 answer, whatever first token it carries."""

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, tuple) and len(other) == 2 and other[0] == 200 and isinstance(other[1], dict)
                and other[1].get("status") == "ok")

    def __repr__(self) -> str:
        return "(200, {'status': 'ok', ...})"


METASERVER_OK = _MetaserverOk()


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
        fail_status = k.status_after_metaserver if k.fail_times is None or st.failed < k.fail_times else None
        failing = fail_status is not None
        # A continued prefill (lw_prefilled) calls no metaserver, as lw-vllm's decoder.
        if role == "decoder" and params.get("do_remote_prefill") and not params.get("lw_prefilled") and not k.skip_metaserver:
            st.answered_first.clear()
            calls = _call_metaserver(request.app[SESSION], st, params, len(prompts), n,
                                     request.headers.get("X-Request-Id"))
            if k.wait_metaserver or not failing:
                await calls
            else:
                st.background.append(asyncio.ensure_future(calls))
        if k.answer_delay:
            await asyncio.sleep(k.answer_delay)
        if fail_status is not None:
            st.failed += 1
            return web.json_response({"error": {"message": "mock failure after the metaserver call", "type": "x",
                                                "param": None, "code": k.status_after_metaserver}},
                                     status=fail_status)
        if k.empty_200:
            return web.Response(status=200, body=b"")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        choices = []
        for pi, p in enumerate(prompts):
            ids = _chat_prompt_ids(body, params) if chat else (tokenize(p) if isinstance(p, str) else list(p))
            for j in range(n):
                choices.append((pi * n + j, ids))
        cut = None
        if k.recompute_after is not None and st.recomputed < k.recompute_times and role == "decoder":
            st.recomputed += 1
            cut = k.recompute_after
        if body.get("stream"):
            return await _stream(request, st, choices, max_tokens, cut, chat, body, n, prompts)
        ret_ids = bool(body.get("return_token_ids"))
        if k.choice_delay and len(choices) > 1:  # a whole answer waits for its last choice
            await asyncio.sleep(k.choice_delay * (len(choices) - 1))
        out = []
        total = 0
        for idx, pids in choices:
            toks = choice_tokens(st, idx, pids, n, max_tokens if cut is None else min(cut, max_tokens))
            toks, text, stopped = _stop_strings(toks, body)
            total += len(toks)
            if k.hold_first and len(toks) == 1 and not params.get("lw_prefilled"):
                text = ""
            elif k.hold_first and params.get("lw_prefilled") and toks:
                text = token_text(pids[-1]) + text
            c: dict[str, Any] = {"index": idx}
            if chat and k.tool_parser and body.get("tools") and len(toks) > 1:
                c["message"] = {"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"call-{uuid.uuid4().hex[:8]}", "type": "function",
                     "function": {"name": "f", "arguments": text}}]}
            elif chat:
                reasons = k.reasoning and len(toks) > 1
                c["message"] = {"role": "assistant", "content": None if reasons else text}
                if reasons:
                    c["message"]["reasoning_content"] = text
            else:
                c["text"] = _echo(body, prompts[idx // n], ret_ids) + text
            c.update(logprobs=_logprobs(toks, chat, k.logprob) if _wants_logprobs(body, chat) else None,
                     finish_reason="length" if cut is None and stopped is None else "stop",
                     stop_reason=stopped if cut is None else "recomputed", token_ids=toks if ret_ids else None)
            if not chat:
                c["prompt_token_ids"] = pids if ret_ids else None
            out.append(c)
        st.completed += 1
        answer: dict[str, Any] = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "chat.completion" if chat
                                  else "text_completion", "created": st.knobs.created, "model": "mock-model",
                                  "choices": out,
                                  "usage": {"prompt_tokens": 5, "completion_tokens": total, "total_tokens": 5 + total,
                                            **_details(k, chat, total)}}
        if chat:
            answer["prompt_token_ids"] = choices[0][1] if ret_ids else None
        return web.json_response(answer)

    async def health(request: web.Request) -> web.Response:
        st.health_calls += 1
        return web.Response(status=st.knobs.health_status)

    async def reset(request: web.Request) -> web.Response:
        st.resets += 1
        st.reset_queries.append(dict(request.query))
        return web.json_response({"success": st.knobs.reset_success}, status=st.knobs.reset_status)

    async def models(request: web.Request) -> web.Response:
        st.passthrough.append(("GET /v1/models", None, request.headers.get("Authorization")))
        if st.knobs.status is not None:
            return web.json_response({"error": {"message": "mock"}}, status=st.knobs.status)
        return web.json_response({"object": "list", "data": [{"id": "mock-model", "object": "model",
                                                               "owned_by": st.role}]})

    async def tokenize_endpoint(request: web.Request) -> web.Response:  # a "token" per word: enough to check the relay
        body = await request.json()
        st.passthrough.append(("POST /tokenize", body, request.headers.get("Authorization")))
        toks = [len(w) for w in str(body.get("prompt", "")).split()]
        return web.json_response({"count": len(toks), "max_model_len": 4096, "tokens": toks})

    async def detokenize_endpoint(request: web.Request) -> web.Response:
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
    app.router.add_post("/tokenize", tokenize_endpoint)
    app.router.add_post("/detokenize", detokenize_endpoint)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app, st


def _chat_prompt_ids(body: dict[str, Any], params: dict[str, Any]) -> list[int]:
    """As vLLM 0.32: kv_transfer_params.prompt_token_ids, when given (text-only messages, no echo),
    is the prompt; else the rendered messages."""
    ids = params.get("prompt_token_ids")  # vLLM pops it; kept here so tests see what was sent
    if ids is not None and not body.get("echo") and all(isinstance(m.get("content"), str) for m in body["messages"]):
        return list(ids)
    return tokenize(chat_context(body["messages"]))


def _wants_logprobs(body: dict[str, Any], chat: bool) -> bool:
    return bool(body.get("logprobs")) if chat else body.get("logprobs") is not None


def _logprobs(toks: list[int], chat: bool, value: float = -0.5) -> dict[str, Any]:
    if chat:
        return {"content": [{"token": token_text(t), "logprob": value, "bytes": None, "top_logprobs": []} for t in toks]}
    return {"tokens": [token_text(t) for t in toks], "token_logprobs": [value] * len(toks),
            "top_logprobs": None, "text_offset": [0] * len(toks)}


def _echo(body: dict[str, Any], prompt: Any, ret_ids: bool) -> str:
    """As vLLM: with ``echo`` a completion's first text begins with its prompt's text (a token-id
    prompt's decoded), none when token ids are asked for."""
    if not body.get("echo") or ret_ids:
        return ""
    return prompt if isinstance(prompt, str) else "".join(token_text(t) for t in prompt)


def choice_tokens(st: MockState, idx: int, pids: list[int], n: int, count: int) -> list[int]:
    """The ``count`` tokens choice ``idx`` (of ``n`` per prompt) generates after ``pids``: from the
    first token its metaserver answer carried when the decoder continues from it, with
    ``distinct_choices`` as if choice ``j > 0``'s prompt ended with ``j``."""
    j = idx % n
    base = pids + [j] if st.knobs.distinct_choices and j else pids
    first = st.answered_first.get(idx) if st.role == "decoder" else None
    if first is None or count < 1:
        return generate_ids(base, count)
    return [first] + generate_ids(base + [first], count - 1)


async def _stream(request: web.Request, st: MockState, choices: list[tuple[int, list[int]]], max_tokens: int,
                  cut: int | None, chat: bool, body: dict[str, Any], n: int = 1,
                  prompts: list[Any] | None = None) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    rid = f"cmpl-{uuid.uuid4().hex}"
    k = st.knobs
    limit = max_tokens if cut is None else min(cut, max_tokens)
    sent = 0
    ret_ids, lp = bool(body.get("return_token_ids")), _wants_logprobs(body, chat)
    gen: dict[int, list[int]] = {}
    for idx, pids in choices:
        if (k.first_word is not None and st.role == "decoder" and limit
                and (k.first_word_choices is None or idx in k.first_word_choices)):
            first = WORD + int(k.first_word.strip().removeprefix("w"))
            gen[idx] = [first] + generate_ids(pids + [first], limit - 1)
        else:
            gen[idx] = choice_tokens(st, idx, pids, n, limit)
    if st.role == "decoder":
        k.first_word = None
    head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": k.created,
            "model": "mock-model"}

    so = body.get("stream_options") or {}
    continuous = bool(so.get("include_usage")) and bool(so.get("continuous_usage_stats"))  # as vLLM reads them
    counts = {idx: 0 for idx, _ in choices}

    async def send(c: dict[str, Any], **top: Any) -> None:
        if continuous:  # every event carries its choice's usage so far (chat also completion_tokens_details)
            k = counts[c["index"]]
            top["usage"] = {"prompt_tokens": 5, "total_tokens": 5 + k, "completion_tokens": k,
                            **({"completion_tokens_details": None} if chat else {}), **_details(st.knobs, chat, k)}
        await resp.write(b"data: " + msgspec.json.encode({**head, "choices": [c], **top}) + b"\n\n")

    try:
        if chat:
            for idx, pids in choices:
                await send({"index": idx, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}, prompt_token_ids=pids if ret_ids else None, prompt_text=None)
        prefilled = bool((body.get("kv_transfer_params") or {}).get("lw_prefilled"))
        # text held back by empty_every or for stop strings (or a continuation's prompt's, hold_first)
        held = {idx: token_text(pids[-1]) if k.hold_first and prefilled else "" for idx, pids in choices}
        tools = chat and k.tool_parser and bool(body.get("tools"))
        tool_held = {idx: "" for idx, _ in choices}  # the first token's text a tool parser held back
        stop = body.get("stop") or []
        stops = [stop] if isinstance(stop, str) else stop
        hold = max(map(len, stops)) - 1 if stops and not body.get("include_stop_str_in_output") else 0
        for t in range(limit):
            for idx, pids in choices:
                if k.choice_delay and idx != choices[0][0]:
                    await asyncio.sleep(k.choice_delay)
                if k.die_after is not None and sent >= k.die_after:
                    if request.transport is not None:
                        request.transport.close()  # the decoder process "dies" mid-stream
                    return resp
                last = t == limit - 1
                tok = gen[idx][t]
                text = held[idx] + token_text(tok)
                held[idx] = ""
                if (k.empty_every and (t + 1) % k.empty_every == 0 or k.hold_first and t == 0 and not prefilled) \
                        and not last:
                    held[idx], text = text, ""
                if hold and not last:  # as vLLM: the stop strings' longest length less one is held back
                    text = held[idx] + text
                    held[idx], text = text[max(len(text) - hold, 0):], text[:max(len(text) - hold, 0)]
                elif hold:
                    text = held[idx] + text
                c: dict[str, Any] = {"index": idx}
                if tools and not (last and t == 0):
                    c["delta"] = _tool_delta(t, tool_held, idx, text)
                    if not c["delta"] and not ret_ids and not lp:  # as vLLM: a held-back token sends no event
                        counts[idx] += 1
                        sent += 1
                        continue
                elif chat:
                    c["delta"] = {"reasoning_content": text} if k.reasoning and not (last and t == 0) else {"content": text}
                else:
                    c["text"] = (_echo(body, prompts[idx // n], ret_ids) if t == 0 and prompts else "") + text
                c.update(logprobs=_logprobs([tok], chat, k.logprob) if lp else None, finish_reason=None, stop_reason=None)
                if not chat:  # as vLLM: the echoing event carries the prompt's ids, asked for or not
                    c["prompt_token_ids"] = pids if (ret_ids or body.get("echo")) and t == 0 else None
                c["token_ids"] = [tok] if ret_ids else None
                if last:
                    c["finish_reason"] = "length" if cut is None else "stop"
                    c["stop_reason"] = None if cut is None else "recomputed"
                counts[idx] += 1
                await send(c)
                sent += 1
            if k.token_delay:
                await asyncio.sleep(k.token_delay)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 5, "completion_tokens": sent, "total_tokens": 5 + sent, **_details(k, chat, sent)}
            await resp.write(b"data: " + msgspec.json.encode({**head, "choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        st.completed += 1
    except ConnectionResetError:
        st.aborted += 1
        raise
    return resp


def _details(k: Knobs, chat: bool, generated: int) -> dict[str, Any]:
    """A chat usage's ``completion_tokens_details`` on a server with a reasoning parser (vLLM sets it
    only there)."""
    return {"completion_tokens_details": {"reasoning_tokens": generated}} if chat and k.reasoning else {}


def _tool_delta(t: int, held: dict[int, str], idx: int, text: str) -> dict[str, Any]:
    """Token ``t``'s delta under the mock's tool parser (``Knobs.tool_parser``)."""
    if t == 0:
        held[idx] = text
        return {}
    if t == 1:
        return {"tool_calls": [{"index": 0, "id": f"call-{uuid.uuid4().hex[:8]}", "type": "function",
                                "function": {"name": "f", "arguments": held.pop(idx) + text}}]}
    return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}


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
    decoders: list[MockState] = []
    prefillers: list[MockState] = []
    urls: dict[str, list[str]] = {"prefiller": [], "decoder": []}
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


__all__ = ["WORD", "Harness", "Knobs", "chat_context", "generate", "generate_ids", "harness", "make_backend",
           "replace", "run", "start_app", "token_text", "tokenize", "wait_until"]
