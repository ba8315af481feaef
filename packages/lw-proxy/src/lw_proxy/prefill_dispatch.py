"""A parent's one prefill (docs/design/architecture.md §6): ``PrefillDispatcher``, owned by
``proxy.Proxy``, builds the prefill request, picks a prefiller, sends it, retries another prefiller
on a failure and turns the answer into the outcome the held metaserver POSTs get
(``fanin.ParentRegistry`` calls ``run`` once per parent). It also holds the rules of when the
prefill goes out (``--prefill-dispatch early``: ``start_early``) and of ``--prefill-first``
(``relay``: the prefill's 200 answer is handed to the stream, lw_proxy.relay), and learns from the
answers whether the prefillers run a reasoning parser (``reasoning``: such chats' first events come
from a streamed two-token prefill, lw_proxy.parsed_relay).

Built from the proxy's config and metrics, the prefiller pool, the client session's getter and the
headers every backend call carries; it holds no state across parents but what it learned (``reasoning``)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec

from lw_core.wire import MetaserverResponse, PrefillTransferParams, prompt_digest

from . import parsed_relay
from .backends import Backend, BackendPool
from .config import PREFILL_DISPATCH, ProxyConfig
from .errors import ProxyError
from .fanin import OK_BODY, Outcome, Parent, ParentRegistry
from .metrics import ProxyMetrics
from .prefill_continue import prompt_list
from .prefill_stream import PrefillStream
from .relay import Prefilled, continues, echo_ok, first_tokens_of, prefill_min_tokens
from .relay import request_id as relay_request_id
from .upstream import CHAT, COMPLETIONS, RETRY_STATUSES, UPSTREAM_ERRORS
from .validate import ClientRequest

_encode = msgspec.json.encode
log = logging.getLogger("lw_proxy")


def prefill_body(req: ClientRequest, parent_id: str, token_ids: bool = False, stream: bool = False,
                 n: int | None = None, tokens: int = 1) -> dict[str, Any]:
    """The prefill's request: the client's, one token, not streamed; one choice, or the client's
    ``n`` when the decoder may continue from each choice's first token (``relay.continues``), or
    ``n`` when given (a prompt list continued after its prefill: every choice of every prompt).
    ``token_ids``: ask for the prompt's and the first tokens' ids (a relayed first token's).
    ``stream``: streamed, with continuous usage (each event carries the prompt's count), so each
    choice is known as soon as the prefiller has it (``prefill_stream``). An ``echo`` the relay and
    the continuation put in themselves (``relay.echo_ok``) is left out: the answer is the
    generated text's alone, as the first token's is read from it. ``tokens``: how many it asks (a
    parsed chat's two, ``parsed_relay``; never more than the client's)."""
    body = dict(req.body)
    for k in ("stream_options", "min_tokens", "best_of", *(("echo",) if echo_ok(req) else ())):
        body.pop(k, None)
    if prefill_min_tokens(req):  # the client's first token is never EOS nor a stop token: nor is the prefill's
        body["min_tokens"] = 1
    if req.max_tokens is not None:
        tokens = max(min(tokens, req.max_tokens), 1)
    one = continues(req) and len(req.prompts) <= 1  # a list's choices are drawn only when asked (``n``)
    body.update(max_tokens=tokens, stream=stream, n=n if n is not None else req.n if one else 1)
    if stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if req.chat:
        body["max_completion_tokens"] = tokens
    if token_ids:
        body["return_token_ids"] = True
    kv = msgspec.structs.asdict(PrefillTransferParams(lw_parent_id=parent_id))
    if req.prompt_ids is not None:  # a resumed chat choice: the prompt the decoder is given too
        kv["prompt_token_ids"] = req.prompt_ids
    body["kv_transfer_params"] = kv
    return body


def metaserver_answers(data: bytes, req: ClientRequest) -> dict[int, bytes]:
    """The metaserver answer of each choice of prefill answer ``data`` that carries its first token
    (``relay.first_tokens_of``) with its prompt's digest (a completion's choices each carry their
    prompt's ids: a prompt list's differ); empty when none does."""
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return {}
    firsts = first_tokens_of(obj, req.chat)
    if firsts is None:
        return {}
    pids = {i: firsts[1] for i in firsts[0]}
    if not req.chat:
        for ch in obj["choices"]:
            own = ch.get("prompt_token_ids") if isinstance(ch, dict) else None
            if isinstance(own, list) and own and all(type(t) is int for t in own):
                pids[ch.get("index", 0)] = own
    return {i: _encode(MetaserverResponse(first_token=t, prompt_digest=prompt_digest(pids[i])))
            for i, t in firsts[0].items() if i < req.children}


class PrefillDispatcher:
    """``cfg``: ``prefill_dispatch``, ``prefill_timeout``, ``connect_timeout``, ``max_retries``,
    ``retry_delay``; ``m``: the proxy's metrics; ``prefillers``: the pool it picks from; ``client``:
    the proxy's client session (called per request, so the session the proxy holds then is used);
    ``headers``: what every backend call carries (content type, the backends' API key)."""

    def __init__(self, cfg: ProxyConfig, m: ProxyMetrics, prefillers: BackendPool,
                 client: Callable[[], aiohttp.ClientSession], headers: dict[str, str]) -> None:
        if cfg.prefill_dispatch not in PREFILL_DISPATCH:
            raise ValueError(f"prefill_dispatch: {cfg.prefill_dispatch!r} is not one of {PREFILL_DISPATCH}")
        self.cfg = cfg
        self.m = m
        self.prefillers = prefillers
        self.client = client
        self.headers = headers
        self.early = cfg.prefill_dispatch == "early"
        self.timeout = aiohttp.ClientTimeout(total=cfg.prefill_timeout, sock_connect=cfg.connect_timeout)
        self.retries = m.retries.labels("prefiller")
        # A prefiller answered a chat as a server with a reasoning parser does: from then on every
        # streamed chat's first event comes from a streamed two-token prefill (parsed_relay).
        self.reasoning = False

    # ---------------------------------------------------------------- when it goes out
    async def start_early(self, registry: ParentRegistry, parent: Parent) -> None:
        """``--prefill-dispatch early``: start the parent's prefill before its decoder call (once
        per parent; a no-op otherwise), and let the prefill's request go out before the decoder's:
        the prefill is the critical path (a streamed first token relayed from it, or the KV the
        decoder waits for), and the decoder has nothing to do until it runs."""
        if self.early and parent.task is None:
            registry.dispatch(parent)
            await asyncio.sleep(0)

    @staticmethod
    def relay(parent: Parent, relay: asyncio.Future, headers: dict[str, str]) -> dict[str, str]:
        """``--prefill-first``: the prefill's 200 answer goes to ``relay``; returns the decoder's
        headers, which name the request as the relayed first event did (``X-Request-Id``)."""
        parent.relay = relay
        return {**headers, "X-Request-Id": relay_request_id(parent.id)}

    # ---------------------------------------------------------------- the prefill itself
    async def run(self, parent: Parent) -> Outcome:
        """Send the parent's prefill; its outcome for the held metaserver POSTs, or ``ProxyError``
        (kind ``prefill_failed``) when no prefiller completed it."""
        req: ClientRequest = parent.request
        path = CHAT if req.chat else COMPLETIONS
        # A relayed chat whose first event a parser shapes: its first token's event, from a stream.
        parsed = parent.relay is not None and continues(req) and parsed_relay.parsed(req, self.reasoning)
        # A relayed stream of several choices (or prompts): each choice's token is relayed as it comes.
        streamed = parent.relay is not None and req.stream and continues(req) and (req.children > 1 or parsed)
        # A prompt list continued after its prefill (lw_proxy.prefill_continue): each choice of each
        # prompt is continued from its own first token, so the prefill draws them all.
        listed = parent.relay is not None and not req.stream and prompt_list(req)
        payload = _encode(prefill_body(req, parent.id, token_ids=parent.relay is not None or continues(req),
                                       stream=streamed, n=req.n if listed or streamed else None,
                                       tokens=parsed_relay.PREFILL_TOKENS if parsed else 1))
        headers = {**self.headers, "X-Request-Id": f"lw-prefill-{parent.id}"}
        # Each prefiller is tried at most once per parent: one that answered 503 is overloaded, and
        # asking it again only adds load; the decoders recompute instead.
        last, tried = "no prefiller configured", set[Backend]()
        attempts = min(self.cfg.max_retries + 1, len(self.prefillers.backends))
        for attempt in range(attempts):
            if attempt:
                self.retries.inc()
                await asyncio.sleep(self.cfg.retry_delay)
            pf = self.prefillers.pick(tried)
            if pf is None:
                break
            tried.add(pf)
            got = await self._send(pf, path, payload, headers, req.prompt_tokens, parent if streamed else None, parsed)
            if isinstance(got, str):
                last = got
                continue
            status, data = got
            return self._answer(parent, pf, status, data, parsed)
        self.m.errors.labels("prefill_failed").inc()
        raise ProxyError(502, f"no prefiller completed the prefill after {attempts} attempt(s) (each prefiller "
                         f"at most once); last error: {last}", kind="prefill_failed")

    async def _send(self, pf: Backend, path: str, payload: bytes, headers: dict[str, str],
                    work: int, streamed: Parent | None = None, parsed: bool = False) -> tuple[int, bytes] | str:
        """One prefiller's answer (status, body), or why it cannot serve now (it is marked failed).
        ``streamed``: the parent of a streamed prefill, read by ``_read_stream``; once it handed a
        choice on, a failure is the parent's (``ProxyError``), not a reason to ask another
        prefiller: a sampled choice drawn again could differ from the one already out. ``parsed``:
        a parsed chat's (``parsed_relay``), each choice handed on at its first token."""
        pf.acquire(work)
        t0 = time.perf_counter()
        handed = [0]  # choices a streamed prefill handed on
        try:
            async with self.client().post(pf.url + path, data=payload, headers=headers, timeout=self.timeout) as r:
                status = r.status
                if streamed is not None and status == 200:
                    data = await self._read_stream(r, streamed, handed, parsed)
                else:
                    data = await r.read()
        except (*UPSTREAM_ERRORS, ProxyError) as e:
            pf.mark_failed(repr(e))
            if handed[0]:
                self.m.errors.labels("prefill_failed").inc()
                raise ProxyError(502, f"prefiller {pf.url} failed after {handed[0]} choice(s) were handed on: {e!r}",
                                 kind="prefill_failed") from None
            return f"{pf.url}: {e!r}"
        finally:
            pf.release(work, t0)
        if status in RETRY_STATUSES:
            pf.mark_failed(f"HTTP {status}")
            return f"{pf.url}: HTTP {status}"
        return status, data

    async def _read_stream(self, r: aiohttp.ClientResponse, parent: Parent, handed: list[int],
                           parsed: bool = False) -> bytes:
        """A streamed prefill's events, each choice handed on as it comes (``_choice``, counted in
        ``handed[0]``); returns the whole stream's answer in the non-streamed answer's shape."""
        ps = PrefillStream(parent.request.chat, first_events=parsed)
        async for chunk in r.content.iter_any():
            for i in ps.feed(chunk):
                if parsed:
                    self._parsed_choice(parent, ps, i)
                else:
                    self._choice(parent, ps, i)
                handed[0] += 1
        if not ps.done:
            raise aiohttp.ClientPayloadError("the prefiller's stream ended before [DONE]")
        return ps.answer(ps.choices)

    def _choice(self, parent: Parent, ps: PrefillStream, i: int) -> None:
        """Choice ``i`` of a streamed prefill is in: its engine request's held POSTs are answered
        with its token (``Parent.answer_choice``), and with ``--prefill-first`` it goes to the
        stream (the first choice through ``parent.relay``, later ones through the queue that one
        carries), relayed when its decoder request continues from it."""
        req: ClientRequest = parent.request
        if i >= req.children:
            return
        data = ps.answer([i])
        answer = metaserver_answers(data, req).get(i)
        if answer is not None:
            parent.answer_choice(i, answer)
        if parent.relay is not None:
            self._to_relay(parent, self._prefilled(parent, data, frozenset({i}), only=(i,)))

    def _parsed_choice(self, parent: Parent, ps: PrefillStream, i: int) -> None:
        """``_choice`` for a parsed chat's prefill (``parsed_relay``): choice ``i``'s first token's
        event came; its held POSTs get the token, and the stream its opening events."""
        if i >= parent.request.children:
            return
        answer = ps.first_answer(i)
        if answer is not None:
            parent.answer_choice(i, answer)
        self._to_relay(parent, self._prefilled(parent, b"", frozenset({i}), only=(i,), parsed=ps.parsed_first(i)))

    @staticmethod
    def _to_relay(parent: Parent, pre: Prefilled) -> None:
        """Hand a streamed prefill's choice to the stream: the first through ``parent.relay``, later
        ones through the queue that one carries."""
        relay = parent.relay
        if relay is None:
            return
        if not relay.done():
            parent.relay_more = asyncio.Queue()
            relay.set_result(pre._replace(more=parent.relay_more))
        elif parent.relay_more is not None:
            parent.relay_more.put_nowait(pre)

    def _answer(self, parent: Parent, pf: Backend, status: int, data: bytes, parsed: bool = False) -> Outcome:
        """The held POSTs' outcome; each choice of a request the decoder may continue from the
        prefill's tokens (``relay.continues``) is answered with its choice's token and the prompt's
        digest (``Parent.answers``). With ``--prefill-first`` the answer also goes to the stream,
        with whether the decoder continues from the tokens: every choice's request said so
        (``forces_first``) and its POST is answered with its token."""
        pf.mark_ok()
        if status != 200:  # the prefiller refused this request: another prefiller would too
            self.m.errors.labels("prefill_failed").inc()
            raise ProxyError(502, f"prefiller {pf.url} answered HTTP {status}: {data[:500].decode(errors='replace')}",
                             kind="prefill_failed")
        req: ClientRequest = parent.request
        if req.chat and not parsed and not self.reasoning and parsed_relay.reasoning_server(data):
            self.reasoning = True
            log.info("lw-proxy --prefill-first: prefiller %s runs a reasoning parser: streamed chats now take "
                     "their first event from a streamed two-token prefill", pf.url)
        if continues(req) and not parsed:
            parent.answers = metaserver_answers(data, req) or parent.answers
        if parent.relay is not None and not parent.relay.done():  # a parsed prefill that handed nothing on: none
            parent.relay.set_result(self._prefilled(parent, b"" if parsed else data, frozenset(range(req.children))))
        return 200, OK_BODY

    def _prefilled(self, parent: Parent, data: bytes, choices: frozenset[int], **kw: Any) -> Prefilled:
        """What goes to the stream for ``choices``: whether their decoder continues from their
        tokens now, and how to wait until every one of them said so (``Parent.settle``, bounded by
        the metaserver timeout)."""
        return Prefilled(parent.id, data, parent.forced(choices),
                         settle=functools.partial(parent.settle, choices, self.cfg.metaserver_timeout), **kw)
