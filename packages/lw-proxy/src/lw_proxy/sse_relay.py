"""The proxy's SSE relay (``SseRelay``, owned by ``proxy.Proxy``): forwarding the decoder's events,
the deadlines of a stream, and resuming choices the decoder ended with ``stop_reason ==
"recomputed"``, and streams continued after their prefill (``--continue-streams``). Built from the
proxy's config and metrics and an ``upstream.Upstream`` (the decoder calls); it holds no state
across streams. Each stream's state is one ``StreamState``: what was
relayed from the prefill and is still to be cut, whether token ids the client did not ask for are
stripped, the stream's id and usage summary, and the ledger a resume is built from."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from . import parsed_relay, prefill_continue, token_ids
from . import recompute as rc
from . import relay as relay_mod
from .config import ProxyConfig
from .errors import ProxyError
from .metrics import ProxyMetrics
from .upstream import UPSTREAM_ERRORS, DecoderCall, Upstream
from .validate import ClientRequest

log = logging.getLogger("lw_proxy")
_DONE = b"data: [DONE]\n\n"
MAX_EVENT_BYTES = 16 << 20  # the most bytes one SSE event may hold while the proxy waits for its end


def deadline_error(cfg: ProxyConfig) -> ProxyError:
    return ProxyError(504, f"the request did not complete within {cfg.request_timeout:g} s "
                      "(--request-timeout)", kind="timeout")


@dataclass(slots=True)
class Skip:
    """What one choice relayed from the prefill (--prefill-first) and is still to be cut from the
    decoder's stream."""

    text: str = ""  # the relayed text
    ids: list[int] | None = None  # the token ids relayed likewise
    role: bool = False  # a chat relay sent the role event: the decoder's is dropped
    logprobs: int = 0  # log-prob entries relayed with the first token: the decoder's are dropped
    prompt: bool = False  # the relayed event carried the prompt's ids: the decoder's first event's are dropped
    delta: dict[str, Any] | None = None  # a parsed chat's relayed delta (parsed_relay): cut with ``ids``

    def done(self) -> bool:
        return not (self.text or self.ids or self.role or self.logprobs or self.delta is not None)


@dataclass(slots=True)
class StreamState:
    """One client stream's state, across the decoder's call and any resumed choices."""

    ledger: rc.StreamLedger  # what the decoder sent per choice (a resume's text and token ids)
    strip: bool  # the proxy asked for token ids the client did not (lw_proxy.token_ids): strip them
    usage: dict[str, Any] | None = None  # the usage summary, sent once at the end
    id: str | None = None  # the stream's id (a continuation's events are renamed to it)
    skips: dict[int, Skip] = field(default_factory=dict)  # per choice index: what is still to be cut
    # Choices whose decoder text contradicted the relayed token: the rest of their events is dropped
    # and each is resumed after the relayed token once the decoder's stream ends.
    dropped: list[int] = field(default_factory=list)
    created: int | None = None  # the relayed event's ``created``: the decoder's events get it too
    # Usage of a stream with resumed choices (``usage_summary``): whether ``usage`` is the decoder's
    # own summary, the token ids the decoder sent per choice, the relayed tokens per choice, and
    # the choices whose relayed tokens no decoder stream sent (dropped for contradicting them, or
    # continued after them: ``_continue_relaying``).
    decoder_usage: bool = False
    decoder_tokens: dict[int, int] = field(default_factory=dict)
    relayed_tokens: dict[int, int] = field(default_factory=dict)
    contradicted: set[int] = field(default_factory=set)
    # The relayed first token's text held back for stop strings, per choice (``relay.Relayed.held``):
    # a decoder that continues from the token sends it later; one that contradicted the token never
    # does, so its choice's resume (``prefix``) begins with it.
    held_text: dict[int, str] = field(default_factory=dict)
    prefix: dict[int, str] = field(default_factory=dict)  # text a resumed choice's next text begins with
    # A streamed prefill's later choices (the request and their queue: ``_relay_more``).
    more: tuple[ClientRequest, Any] | None = None
    choices: int = 1  # the stream's choices, every prompt's (a completion's prompt list: n each)

    def stop_cutting(self) -> None:
        self.skips.clear()
        self.dropped.clear()

    def cutting(self) -> bool:
        return bool(self.skips or self.dropped)


def usage_summary(state: StreamState) -> dict[str, Any]:
    """The stream's usage summary as a single engine's: ``state.usage`` (the decoder's, each resumed
    choice's continuation adding its tokens), less what the decoder generated for choices dropped
    after contradicting their relayed token (none of it reached the client) plus the relayed tokens
    the client got for them; when the decoder's own summary never came (every choice was dropped
    before it), the first continuation's is the base: the prompt is then the client's (the
    ledger's), not the continuation's longer one."""
    assert state.usage is not None
    if not state.contradicted:
        return state.usage
    obj = dict(state.usage)
    u = obj.get("usage")
    if not isinstance(u, dict):
        return obj
    u = dict(u)
    fix = sum(state.relayed_tokens.get(i, 1) for i in state.contradicted)
    if state.decoder_usage:
        fix -= sum(state.decoder_tokens.get(i, 0) for i in state.contradicted)
    else:
        prompt = state.ledger.prompt_tokens(min(state.contradicted))
        if prompt is not None and isinstance(u.get("prompt_tokens"), int):
            u["prompt_tokens"] = len(prompt)
    if isinstance(u.get("completion_tokens"), int) and isinstance(u.get("prompt_tokens"), int):
        u["completion_tokens"] += fix
        u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
    obj["usage"] = u
    return obj


class SseRelay:
    """``cfg``: deadlines, retries, ``max_resume_bytes``, ``prefill_first``; ``m``: the proxy's
    metrics; ``upstream``: the decoder calls (``Proxy``)."""

    def __init__(self, cfg: ProxyConfig, m: ProxyMetrics, upstream: Upstream) -> None:
        self.cfg = cfg
        self.m = m
        self.upstream = upstream

    async def stream(self, request: web.Request, req: ClientRequest, path: str,
                     deadline: float) -> web.StreamResponse:
        out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                      "Cache-Control": "no-cache"})
        held: list[int] = []  # choice indices the decoder ended with "recomputed"
        state = StreamState(rc.StreamLedger(req.chat, self.cfg.max_resume_bytes, req.n), token_ids.asks(req.body),
                            choices=req.children)
        relay = None
        if self.cfg.prefill_first:
            if relay_mod.eligible(req):
                relay = asyncio.get_running_loop().create_future()
            else:
                self.m.not_relayed.labels("request").inc()
        call: tuple[int, bytes, str] | DecoderCall | ProxyError
        rewrite = None  # a continuation's stream: its events are choice 0's (``_filter``)
        try:
            async with asyncio.timeout_at(deadline):
                if relay is None:
                    call = await self.upstream.decode(req, path, read=False)
                elif self.upstream.continues_stream(req):
                    call, rewrite = await self._continue_relaying(request, req, path, out, state)
                else:
                    call = await self._decode_relaying(request, req, path, relay, out, state)
        except TimeoutError:
            if not out.prepared:
                raise deadline_error(self.cfg) from None
            call = deadline_error(self.cfg)
        except ProxyError as e:
            if not out.prepared:
                raise
            call = e
        if isinstance(call, tuple) and out.prepared:  # refused after the relayed first token went out
            call = ProxyError(502, f"the decoder answered HTTP {call[0]} after the prefiller's first token was "
                              f"relayed: {call[1][:300].decode(errors='replace')}", kind="upstream_status")
        if isinstance(call, ProxyError):
            await self._end_stream(request, out, call, state)
            return out
        if isinstance(call, tuple):  # the decoder refused (4xx/500): pass its error through as-is
            status, data, ctype = call
            return web.Response(status=status, body=data, headers={"Content-Type": ctype})
        ok: Literal[True] | ProxyError
        try:
            async with asyncio.timeout_at(deadline):
                try:
                    if not out.prepared:
                        await out.prepare(request)
                    ok = await self._pump(call, out, held, state, rewrite)
                finally:
                    self.upstream.finish(call)
                state.stop_cutting()  # a resumed choice continues after what the client got
                if ok is True and held:
                    ok = await self._resume_stream(req, path, out, held, state)
        except TimeoutError:
            ok = deadline_error(self.cfg)
        except ProxyError as e:  # a resubmission found no decoder: the stream has started, so end it with the error
            ok = e
        await self._end_stream(request, out, ok, state)
        return out

    async def _decode_relaying(self, request: web.Request, req: ClientRequest, path: str, relay: asyncio.Future,
                               out: web.StreamResponse, state: StreamState) -> tuple[int, bytes, str] | DecoderCall:
        """``decode`` while the prefill runs: if the prefill answers first with a relayable token
        (lw_proxy.relay), start the client's stream with it; then wait for the decoder's call."""
        task = asyncio.create_task(self.upstream.decode(req, path, read=False, relay=relay))
        try:
            await asyncio.wait({task, relay}, return_when=asyncio.FIRST_COMPLETED)
            pre: relay_mod.Prefilled | None = None if task.done() else relay.result()
            first = None if pre is None else self._first(req, pre, roles=True)
            if pre is not None and first is not None and not self._relayable(req, pre):
                pre = await self._settle(task, pre)
            if pre is None:
                self.m.not_relayed.labels("decoder_first").inc()
            elif first is None:
                self.m.not_relayed.labels("token").inc()
            elif not self._relayable(req, pre):
                self.m.not_relayed.labels("not_forced").inc()
            else:
                await out.prepare(request)
                await out.write(first.block)
                if req.chat and pre.only is not None:  # every choice's role event went out
                    for i in range(req.n):
                        state.skips[i] = Skip(role=True)
                self._relayed(req, first, state)
                state.created = first.created
                if pre.more is not None:
                    state.more = (req, pre.more)
                self.m.relayed_first.inc()
            return await task
        except BaseException:
            if not task.done():
                task.cancel()
            elif not task.cancelled() and task.exception() is None:
                result = task.result()
                if not isinstance(result, tuple):
                    self.upstream.finish(result)
            raise

    async def _continue_relaying(self, request: web.Request, req: ClientRequest, path: str, out: web.StreamResponse,
                                 state: StreamState) -> tuple[tuple[int, bytes, str] | DecoderCall, int | None]:
        """A stream continued after its prefill (``prefill_continue.applies_stream``): the prefill
        goes out alone; its first token's event(s) go to the client, and the decoder gets the
        prompt's token ids plus that token (``lw_prefilled``: it loads the prompt from the pool and
        computes from the token on, no step spent on the prompt's last token again), whose stream
        continues the client's (``rewrite`` 0: renamed, its role event dropped). A prefill that
        failed, or whose answer cannot be relayed and continued (a first token that ended the
        answer or that a stop string could begin in, ids missing), leaves the request to the
        decoder's path with that parent, whose metaserver calls are answered from the prefill."""
        parent, pre = await self.upstream.prefill_alone(req)
        handed = False
        try:
            first = None if pre is None else self._first(req, pre, roles=True)
            got = None if pre is None or first is None else prefill_continue.plan(req, pre.data)
            cont = None if got is None else got.continuations.get(0)
            if pre is None or first is None or cont is None:
                self.m.not_relayed.labels("decoder_first" if pre is None else "token").inc()
                call = await self.upstream.decode(req, path, read=False, parent=parent)
                handed = isinstance(call, DecoderCall)
                return call, None
            await out.prepare(request)
            await out.write(first.block)
            self._relayed(req, first, state)
            state.stop_cutting()  # the continuation never sends the relayed token
            state.strip = not token_ids.client_asked(req.body)  # its ids are asked even with echo
            # Its events are the stream's (the relayed event's id and created), and its usage is
            # counted as a resumed choice's: the client's prompt, the relayed token added.
            state.id = f"{'chatcmpl' if req.chat else 'cmpl'}-{relay_mod.request_id(pre.parent_id)}"
            state.created = first.created
            state.contradicted.add(0)
            if 0 in state.held_text:  # text held back for stop strings: the continuation's first text begins with it
                state.prefix[0] = state.held_text.pop(0)
            if relay_mod.asks_usage(req):
                cont.body["stream_options"] = {"include_usage": True}
            self.m.relayed_first.inc()
            return await self.upstream.decode(cont, path, read=False), 0
        finally:
            if not handed:
                self.upstream.close_parent(parent, answered=pre is not None)

    @staticmethod
    async def _settle(task: asyncio.Task, pre: relay_mod.Prefilled) -> relay_mod.Prefilled | None:
        """``pre`` once its decoder requests all said whether they continue from its tokens (their
        metaserver POSTs can come after a short prefill answered): relayed only to those that do,
        a sampled or parsed stream's first token waits for them, not for the decoder's own token.
        None when the decoder's answer started first."""
        if pre.settle is None:
            return pre
        settle = asyncio.ensure_future(pre.settle())
        try:
            await asyncio.wait({task, settle}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not settle.done():
                settle.cancel()
        return None if task.done() else pre._replace(forced=settle.result())

    @staticmethod
    def _relayable(req: ClientRequest, pre: relay_mod.Prefilled) -> bool:
        """A parsed chat's first event only to a decoder that continues from its token (its delta
        must be the relayed one); others as ``relay.relayable`` says."""
        return pre.forced if pre.parsed is not None else relay_mod.relayable(req, pre.forced)

    @staticmethod
    def _first(req: ClientRequest, pre: relay_mod.Prefilled, roles: bool) -> relay_mod.First | None:
        if pre.parsed is not None:
            return parsed_relay.first_event(pre.parsed, pre.parent_id, req, roles)
        return relay_mod.first_event(pre.data, pre.parent_id, req.chat, relay_mod.asks_logprobs(req), req.n,
                                     ids=token_ids.client_asked(req.body),
                                     usage=relay_mod.continuous_usage(req) is True,
                                     hold=relay_mod.held_back(req) or 0, only=pre.only, roles=roles,
                                     echo=relay_mod.echo_text(req))

    @staticmethod
    def _relayed(req: ClientRequest, first: relay_mod.First, state: StreamState) -> None:
        """What ``first`` relayed is fed to the ledger and cut from the decoder's stream."""
        for i, r in first.choices.items():
            state.ledger.feed(i, r.text, r.token_ids, first.prompt_ids, ids_follow=r.token_ids is None)
            state.relayed_tokens[i] = len(r.token_ids) if r.token_ids else 1
            if r.held:
                state.held_text[i] = r.held
            had = state.skips.get(i)
            state.skips[i] = Skip("" if r.delta is not None else r.text, r.token_ids,
                                  req.chat and (had is None or had.role), r.logprobs,
                                  prompt=token_ids.client_asked(req.body) or relay_mod.echo_text(req) is not None,
                                  delta=r.delta)

    async def _relay_more(self, out: web.StreamResponse, state: StreamState) -> None:
        """A streamed prefill's later choices that came in since (``relay.Prefilled.more``): each
        relayable one's first events go out before the decoder's events, which are cut by them (the
        decoder cannot send a choice's token before the prefill's came: its request waits for it)."""
        assert state.more is not None
        req, more = state.more
        while not more.empty():
            pre: relay_mod.Prefilled = more.get_nowait()
            first = self._first(req, pre, roles=False)
            if first is None or not self._relayable(req, pre):
                continue  # the decoder's own events of that choice go out as they come
            await out.write(first.block)
            self._relayed(req, first, state)

    async def _end_stream(self, request: web.Request, out: web.StreamResponse, ok: Literal[True] | ProxyError,
                          state: StreamState) -> None:
        if not out.prepared:  # the deadline passed before the response started
            assert isinstance(ok, ProxyError)
            raise ok
        try:
            # A client that stopped reading must not hold this handler: the last writes are bounded too.
            async with asyncio.timeout(5.0):
                if ok is not True:
                    self.m.errors.labels(ok.kind).inc()
                    await out.write(b"data: " + ok.body() + b"\n\n")
                elif state.usage is not None:
                    await out.write(self._stamped(rc.sse_encode(usage_summary(state)), state))
                await out.write(_DONE)
                await out.write_eof()
        except TimeoutError:
            if request.transport is not None:
                request.transport.close()

    async def _pump(self, call: DecoderCall, out: web.StreamResponse, held: list[int], state: StreamState,
                    rewrite: int | None) -> Literal[True] | ProxyError:
        """Forward whole SSE events from the decoder to ``out`` until [DONE].

        Fast path: blocks without "recomputed" pass through as bytes (token ids the client did not
        ask for turned into null, ``token_ids.strip``). Once a choice is recomputed (or when
        ``rewrite`` is set, i.e. a continuation stream whose choice index must become ``rewrite``),
        while relayed text is cut, and for chat events with an empty delta (sent only for their token
        ids), events are parsed (``_filter``). The decoder's events feed ``state.ledger`` (what a resume
        needs, the token ids included) before anything is stripped; nothing else is kept.
        Returns True at [DONE], else the error saying how the decoder's stream broke or stalled.
        """
        buf = call.first
        content = call.resp.content
        idle = self.cfg.stream_idle_timeout
        parse = rewrite is not None
        while True:
            if state.more is not None and rewrite is None and not state.more[1].empty():
                await self._relay_more(out, state)
            cut = buf.rfind(b"\n\n")
            if cut >= 0:
                block, buf = buf[:cut + 2], buf[cut + 2:]
                done = block.endswith(_DONE)
                if done:  # the caller ends the stream itself, after any resumed choices and the usage summary
                    block = block[: -len(_DONE)]
                if parse or held or b'"recomputed"' in block:
                    parse = True
                if parse or state.cutting() or (state.strip and b'"delta":{}' in block):
                    block = self._filter(block, held, state, rewrite)
                    if state.dropped and len(state.dropped) == state.choices:
                        # Every choice contradicted its relayed token: nothing more of this answer is
                        # wanted (its usage summary included); each choice is resumed.
                        held.extend(state.dropped)
                        state.stop_cutting()
                        return True
                else:
                    state.ledger.feed_block(block)
                    if state.strip:
                        block = token_ids.strip(block)
                if block:
                    await out.write(self._stamped(block, state))
                if done:
                    held.extend(state.dropped)
                    state.dropped.clear()
                    return True
            if len(buf) > MAX_EVENT_BYTES:  # no event boundary in sight: not an SSE stream we can forward
                return ProxyError(502, f"the decoder sent {len(buf)} bytes without ending an SSE event",
                                  kind="upstream_died")
            try:
                async with asyncio.timeout(idle):
                    chunk = await content.readany()
            except TimeoutError:
                return ProxyError(504, f"the decoder's stream sent nothing for {idle:g} s (--stream-idle-timeout)",
                                  kind="timeout")
            except UPSTREAM_ERRORS as e:
                return ProxyError(502, f"decoder stream broke: {e!r}", kind="upstream_died")
            if not chunk:
                return ProxyError(502, "decoder closed the stream before [DONE]", kind="upstream_died")
            buf += chunk

    @staticmethod
    def _stamped(block: bytes, state: StreamState) -> bytes:
        """The decoder's events as one stream with the relayed event (``relay.same_created``)."""
        return block if state.created is None else relay_mod.same_created(block, state.created)

    def _filter(self, block: bytes, held: list[int], state: StreamState, rewrite: int | None) -> bytes:
        """The parsed path of ``_pump``: cut relayed text, rename a continuation's choice, hold back
        recomputed finishes and the usage summary, feed the ledger, strip the ids the client did not
        ask for. An event is dropped only when none of its choices carries anything any more
        (``recompute.carries``): tool-call deltas, reasoning, token ids or logprobs alone go out."""
        keep = []
        for ev in rc.sse_events(block):
            obj = rc.sse_json(ev)
            if obj is None:
                if ev.strip() != _DONE.strip():
                    keep.append(ev)
                continue
            if state.id is None:
                state.id = obj.get("id")
            choices = obj.get("choices")
            if not choices:
                if obj.get("usage") is not None:  # usage summary: sent once, at the end (usage_summary)
                    if state.usage is None:
                        if rewrite is not None and state.id is not None:
                            obj["id"] = state.id  # a continuation's: named as the stream
                        state.usage = obj
                        state.decoder_usage = rewrite is None
                    else:
                        rc.add_usage(state.usage.get("usage"), obj["usage"])
                else:  # not a choice event (an error event): as it came
                    keep.append(ev)
                continue
            kept = []
            for ch in choices:
                idx = ch.get("index", 0)
                if rewrite is None and isinstance(ch.get("token_ids"), list):
                    state.decoder_tokens[idx] = state.decoder_tokens.get(idx, 0) + len(ch["token_ids"])
                if idx in state.dropped:
                    continue
                skip = state.skips.get(idx)
                if skip is not None and self._cut(ch, skip, state):
                    del state.skips[idx]
                if idx in state.dropped:
                    continue
                if rewrite is not None:
                    ch["index"] = rewrite
                    delta = ch.get("delta")
                    # the continuation's opening event repeats the stream's: its role (and the empty
                    # content beside it) goes, and a prefix waits for the first token's event
                    opening = isinstance(delta, dict) and delta.pop("role", None) is not None
                    if rewrite in state.prefix and not opening:
                        _prepend(ch, state.prefix, rewrite, state.ledger.chat)
                    if ch.get("prompt_token_ids") is not None:  # the continuation's prompt: not the client's
                        ch["prompt_token_ids"] = None
                if rc.is_recomputed(ch):
                    held.append(ch.get("index", 0))
                    ch["finish_reason"] = ch["stop_reason"] = None
                state.ledger.feed_choice(ch, obj.get("prompt_token_ids"))
                if state.strip:
                    token_ids.strip_choice(ch)
                if rc.carries(ch):
                    kept.append(ch)
            if not kept:
                continue
            if (state.strip or rewrite is not None) and obj.get("prompt_token_ids") is not None:
                obj["prompt_token_ids"] = None
            if rewrite is not None and state.id is not None:
                obj["id"] = state.id
            obj["choices"] = kept
            keep.append(rc.sse_encode(obj))
        return b"".join(keep)

    def _cut(self, ch: dict[str, Any], skip: Skip, state: StreamState) -> bool:
        """Cut what choice ``ch`` relayed from its event; whether nothing is left to cut. A decoder
        whose text contradicts the relayed token has none of this choice reach the client (the
        mismatch is in the text that stood for the relayed token): the choice is dropped and resumed
        after the relayed token, as a recomputed choice is: the prefiller's token is the one a single
        engine gives, so the rest must follow from it."""
        chat = state.ledger.chat
        delta = ch.get("delta")
        if skip.prompt:  # the choice's first event: its prompt ids went out with the relayed one
            if ch.get("prompt_token_ids") is not None:
                ch["prompt_token_ids"] = None
            skip.prompt = False
        if skip.role and isinstance(delta, dict) and "role" in delta:
            del delta["role"]  # the relayed events opened the choice already
            skip.role = False
        try:
            if skip.delta is not None:
                assert skip.ids is not None
                if parsed_relay.cut(ch, skip.delta, skip.ids[0]):
                    skip.delta = skip.ids = None
            elif skip.text or skip.ids:
                skip.text, skip.ids = relay_mod.cut(ch, skip.text, skip.ids, chat)
        except relay_mod.Mismatch as e:
            idx = ch.get("index", 0)
            log.warning("lw-proxy --prefill-first: choice %s: %s; resuming after the relayed token", idx, e)
            self.m.errors.labels("relay_mismatch").inc()
            if skip.ids is None:  # ids the decoder sent before the mismatch are not ours
                state.ledger.drop_tokens(idx)
            state.dropped.append(idx)
            state.contradicted.add(idx)
            return True
        if skip.logprobs:
            skip.logprobs = relay_mod.cut_logprobs(ch, skip.logprobs, chat)
        return skip.done()

    async def _resume_stream(self, req: ClientRequest, path: str, out: web.StreamResponse, held: list[int],
                             state: StreamState) -> Literal[True] | ProxyError:
        while held:
            idx = held.pop(0)
            if idx in state.contradicted and idx in state.held_text:
                state.prefix[idx] = state.held_text.pop(idx)
            for _ in range(self.cfg.max_retries + 1):
                if state.ledger.overflowed:
                    return ProxyError(502, f"choice {idx} was recomputed after the stream passed "
                                      f"{self.cfg.max_resume_bytes} bytes of output (--max-resume-bytes); "
                                      "it cannot be resumed", kind="recompute_exhausted")
                ledger = state.ledger
                cont = rc.continuation(req, idx, ledger.text(idx) + state.prefix.get(idx, ""), ledger.tokens(idx),
                                       ledger.generated(idx), ledger.prompt_tokens(idx))
                if cont is None:
                    rest = state.prefix.pop(idx, "")
                    await out.write(rc.sse_encode({"id": state.id, "object": "chat.completion.chunk" if req.chat
                                                   else "text_completion", "choices": [
                                                       {"index": idx, "finish_reason": "length", "stop_reason": None,
                                                        **({"delta": {"content": rest} if rest else {}} if req.chat
                                                           else {"text": rest})}]}))
                    break
                self.m.recomputes.inc()
                if state.usage is not None or relay_mod.asks_usage(req):
                    cont.body["stream_options"] = {"include_usage": True}  # its tokens go into the summary
                call = await self.upstream.decode(cont, path, read=False)
                if isinstance(call, tuple):
                    return ProxyError(502, f"resubmitting recomputed choice {idx} failed with HTTP {call[0]}")
                again: list[int] = []
                try:
                    ok = await self._pump(call, out, again, state, idx)
                finally:
                    self.upstream.finish(call)
                if ok is not True:
                    return ok
                if not again:
                    break
            else:
                return ProxyError(502, f"choice {idx} was recomputed {self.cfg.max_retries + 1} times; giving up",
                                  kind="recompute_exhausted")
        return True


def _prepend(ch: dict[str, Any], prefix: dict[int, str], idx: int, chat: bool) -> None:
    """Begin choice ``ch``'s text with ``prefix[idx]`` (taken out) when this event carries text or
    ends the choice (the text a single engine flushes at its end)."""
    ends = ch.get("finish_reason") is not None
    if chat:
        delta = ch.get("delta")
        if isinstance(delta, dict) and (isinstance(delta.get("content"), str) or ends):
            delta["content"] = prefix.pop(idx) + (delta.get("content") or "")
    elif isinstance(ch.get("text"), str) or ends:
        ch["text"] = prefix.pop(idx) + (ch.get("text") or "")
