"""The decoder-first PD flow (docs/design/architecture.md §6): decoder call with retries and
non-streaming recompute resumption. The proxy coordinates what it owns: the parent registry
(``fanin``), the ``PrefillDispatcher`` that sends each parent's one prefill (``prefill_dispatch``),
and the ``SseRelay`` streams go through (``sse_relay``), which calls back only ``decode`` and
``finish`` (``upstream.Upstream``). HTTP routing and lifecycle live in ``app``."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Literal, overload

import aiohttp
import msgspec
from aiohttp import web

from lw_core.wire import DecodeTransferParams

from . import prefill_continue, token_ids
from . import recompute as rc
from . import relay as relay_mod
from .backends import BackendPool
from .config import ProxyConfig
from .errors import ProxyError
from .fanin import Parent, ParentRegistry
from .metrics import ProxyMetrics
from .prefill_dispatch import PrefillDispatcher
from .relay import Prefilled
from .sse_relay import SseRelay, deadline_error
from .upstream import RETRY_STATUSES, UPSTREAM_ERRORS, DecoderCall
from .validate import ClientRequest

log = logging.getLogger("lw_proxy")

_encode = msgspec.json.encode


class Proxy:
    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self.m = ProxyMetrics()
        self.prefillers = BackendPool("prefiller", cfg.prefillers, self.m)
        self.decoders = BackendPool("decoder", cfg.decoders, self.m)
        self.session: aiohttp.ClientSession | None = None
        self.headers = {"Content-Type": "application/json"}
        if cfg.backend_api_key is not None:
            self.headers["Authorization"] = f"Bearer {cfg.backend_api_key}"
        self.prefill = PrefillDispatcher(cfg, self.m, self.prefillers, self.client, self.headers)
        self.registry = ParentRegistry(self.prefill.run, self.m, cfg.metaserver_timeout,
                                       require_token=cfg.api_key is not None, api_key=cfg.api_key)
        self._metaserver = cfg.metaserver_url
        self._retry_dec = self.m.retries.labels("decoder")
        self.sse = SseRelay(cfg, self.m, upstream=self)

    async def start(self) -> None:
        conn = aiohttp.TCPConnector(limit=self.cfg.max_connections, limit_per_host=0, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout,
                                        sock_read=self.cfg.backend_timeout)
        self.session = aiohttp.ClientSession(connector=conn, timeout=timeout, auto_decompress=False)

    def client(self) -> aiohttp.ClientSession:
        """The backends' client session (``start`` opens it)."""
        if self.session is None:
            raise RuntimeError("lw-proxy: Proxy.start() was not awaited before the first backend call")
        return self.session

    async def close(self) -> None:
        await self.registry.shutdown()
        if self.session is not None:
            await self.session.close()

    # ---------------------------------------------------------------- payloads
    def _decoder_payload(self, req: ClientRequest, parent: Parent) -> bytes:
        """The client's request plus ``kv_transfer_params`` and, unless the client asked for them
        itself, ``return_token_ids: true`` (see lw_proxy.token_ids)."""
        params = _encode(DecodeTransferParams(metaserver=self._metaserver, lw_parent_id=parent.id,
                                              lw_children=req.children, lw_token=parent.token,
                                              lw_first_token=relay_mod.offers_first(req, self.cfg.prefill_first),
                                              lw_prefilled=req.prefilled))
        ids = token_ids.asks(req.body)
        if req.raw is not None and req.prompt_ids is None and not (ids and "return_token_ids" in req.body):
            # Splice our fields into the client's own bytes: a validated JSON object without
            # kv_transfer_params (nor, when added, return_token_ids), so inserting before its
            # closing brace is valid JSON.
            raw = req.raw.rstrip()
            return b"".join((raw[:-1], b',"kv_transfer_params":', params, b',"return_token_ids":true}' if ids else b"}"))
        kv = msgspec.json.decode(params)
        if req.prompt_ids is not None:
            kv["prompt_token_ids"] = req.prompt_ids
        body = {**req.body, "kv_transfer_params": kv}
        if ids:
            body["return_token_ids"] = True
        return _encode(body)

    # ---------------------------------------------------------------- decoder calls
    @overload
    async def decode(self, req: ClientRequest, path: str, read: Literal[True],
                     relay: asyncio.Future | None = None, parent: Parent | None = None) -> tuple[int, bytes, str]: ...

    @overload
    async def decode(self, req: ClientRequest, path: str, read: bool,
                     relay: asyncio.Future | None = None,
                     parent: Parent | None = None) -> tuple[int, bytes, str] | DecoderCall: ...

    async def decode(self, req: ClientRequest, path: str, read: bool, relay: asyncio.Future | None = None,
                     parent: Parent | None = None) -> tuple[int, bytes, str] | DecoderCall:
        """Send ``req`` to a decoder, retrying other decoders on connect errors and 502/503/504.

        ``read``: read the whole body inside the retry loop (a decoder dying mid-body is retried)
        and return (status, body, content type). Otherwise return the open ``DecoderCall`` once a 200's
        first body bytes arrived (within ``first_byte_timeout``: a decoder silent that long counts as
        hung); a non-200 is read and returned as a tuple.

        One parent serves every attempt: a retried decoder's metaserver calls are answered from the
        prefill the first attempt started, never by a second prefill. ``parent``: one the caller
        opened (and closes), whose prefill it started (``read`` only).
        """
        last, exclude, timed_out = "no decoder configured", None, False
        work = req.decode_tokens
        owns = parent is None
        if parent is None:
            parent = self.registry.open(req.children, req)
        headers = self.headers
        if relay is not None:
            headers = self.prefill.relay(parent, relay, headers)
        handed_over = answered = False
        try:
            for attempt in range(self.cfg.max_retries + 1):
                if attempt:
                    self._retry_dec.inc()
                    self.registry.retry(parent)
                    await asyncio.sleep(self.cfg.retry_delay)
                dec = self.decoders.pick(exclude)
                if dec is None:
                    break
                await self.prefill.start_early(self.registry, parent)  # --prefill-dispatch early
                dec.acquire(work)
                t0 = time.perf_counter()
                resp = None
                first_byte = asyncio.timeout(None if read else self.cfg.first_byte_timeout)
                try:
                    async with first_byte:
                        resp = await self.client().post(dec.url + path, data=self._decoder_payload(req, parent),
                                                       headers=headers)
                        status = resp.status
                        if status == 200 and not read:
                            data = await resp.content.readany()
                            if data:
                                handed_over = True
                                return DecoderCall(dec, parent, resp, work, t0, data)
                        else:
                            data = await resp.read()
                except UPSTREAM_ERRORS as e:
                    timed_out = first_byte.expired()
                    why = (f"no first byte within {self.cfg.first_byte_timeout:g} s (--first-byte-timeout)"
                           if timed_out else repr(e))
                    dec.mark_failed(why)
                    self.m.errors.labels("timeout" if timed_out else "upstream_connect" if resp is None
                                         else "upstream_died").inc()
                    last, exclude = f"{dec.url}: {why}", dec
                    continue
                finally:
                    if not handed_over:
                        if resp is not None:
                            resp.close()  # unread body: drop the connection, which tells vLLM to abort
                        dec.release(work, t0)
                timed_out = False
                if status in RETRY_STATUSES or (status == 200 and not data.strip()):
                    why = f"HTTP {status}" + (" with an empty body" if status == 200 else "")
                    dec.mark_failed(why)
                    self.m.errors.labels("upstream_status").inc()
                    last, exclude = f"{dec.url}: {why}", dec
                    continue
                dec.mark_ok()
                answered = status == 200
                return status, data, resp.headers.get("Content-Type", "application/json")
        finally:
            if not handed_over and owns:
                self.registry.close(parent, answered=answered)
        raise ProxyError(504 if timed_out else 502,
                         f"no decoder completed the request after {self.cfg.max_retries + 1} attempts; "
                         f"last error: {last}", kind="timeout" if timed_out else "upstream")

    def deadline_error(self) -> ProxyError:
        return deadline_error(self.cfg)

    def finish(self, call: DecoderCall) -> None:
        if call.resp.content.at_eof():
            call.resp.release()
        else:
            call.resp.close()  # unread body: drop the connection, which tells vLLM to abort
        call.dec.release(call.work, call.t0)
        self.registry.close(call.parent, answered=True)  # the decoder sent a 200 and its first bytes

    # ---------------------------------------------------------------- streaming (the SSE relay) and not
    async def stream(self, request: web.Request, req: ClientRequest, path: str,
                     deadline: float) -> web.StreamResponse:
        return await self.sse.stream(request, req, path, deadline)

    def continues_stream(self, req: ClientRequest) -> bool:
        """A stream continued after its prefill (``--continue-streams``,
        ``prefill_continue.applies_stream``; early dispatch only, and not once a prefiller showed a
        reasoning parser: such chats take their first events from a streamed prefill,
        ``parsed_relay``)."""
        return (self.cfg.prefill_first and self.cfg.continue_after_prefill and self.cfg.continue_streams
                and self.prefill.early and not self.prefill.reasoning and prefill_continue.applies_stream(req))

    async def prefill_alone(self, req: ClientRequest) -> tuple[Parent, Prefilled | None]:
        """Send ``req``'s prefill alone (a parent of its own, its answer handed to the parent's
        relay) and wait for it, bounded by --prefill-timeout; the parent, which the caller closes
        (``close_parent``), and the prefill's 200 answer, or None when no prefiller gave one."""
        parent = self.registry.open(req.children, req)
        pre: asyncio.Future[Prefilled] = asyncio.get_running_loop().create_future()
        parent.relay = pre  # given the prefill's 200 answer (prefill_dispatch)
        try:
            self.registry.dispatch(parent)
            assert parent.task is not None
            await asyncio.shield(parent.task)  # a client gone cancels this wait; close() then cancels the prefill
        except BaseException:
            self.registry.close(parent)
            raise
        return parent, pre.result() if pre.done() else None

    def close_parent(self, parent: Parent, answered: bool) -> None:
        self.registry.close(parent, answered=answered)

    async def complete(self, req: ClientRequest, path: str) -> web.Response:
        # Early dispatch only: with on-metaserver the decoders decide whether a prefill is needed at all.
        if prefill_continue.applies(req, self.cfg.prefill_first and self.cfg.continue_after_prefill and self.prefill.early):
            return await self._complete_after_prefill(req, path)
        pre = asyncio.get_running_loop().create_future() if relay_mod.assembles(req) else None
        status, data, ctype = await self.decode(req, path, read=True, relay=pre)
        return await self._respond(req, path, status, data, ctype, pre.result() if pre is not None and pre.done() else None)

    async def _respond(self, req: ClientRequest, path: str, status: int, data: bytes, ctype: str,
                       pre: Prefilled | None) -> web.Response:
        """The decoder's non-streamed answer as the client gets it: the first log-prob entry the
        prefill's (``pre``, when log-probs were asked), recomputed choices resumed, token ids the
        client did not ask for stripped."""
        if status == 200 and pre is not None:
            data = relay_mod.with_prefill_logprobs(data, pre, req.chat)
        if status == 200 and b'"recomputed"' in data:
            data = await self._resume(req, path, data)
        if status == 200 and token_ids.asks(req.body):
            data = token_ids.strip(data)
        return web.Response(status=status, body=data, headers={"Content-Type": ctype})

    async def _complete_after_prefill(self, req: ClientRequest, path: str) -> web.Response:
        """A non-streamed answer continued after its prefill (``lw_proxy.prefill_continue``): the
        prefill goes out alone; once it answered, each choice it did not end goes to a decoder as the
        prompt plus its first token. A request it cannot continue (or whose prefill failed) goes to
        the decoder's path with this parent, whose metaserver calls are answered from that prefill."""
        parent, pre = await self.prefill_alone(req)
        answered = False
        try:
            got = prefill_continue.plan(req, pre.data) if pre is not None else None
            if got is None:
                self.m.not_relayed.labels("token" if pre is not None else "decoder_first").inc()
                status, data, ctype = await self.decode(req, path, read=True, parent=parent)
                answered = status == 200
                prefilled = (pre._replace(forced=parent.forced(set(range(req.n))))
                             if pre is not None and relay_mod.assembles(req) else None)
                return await self._respond(req, path, status, data, ctype, prefilled)
            self.m.relayed_first.inc()
            subs = await asyncio.gather(*(self.decode(c, path, read=True, parent=parent)
                                          for c in got.continuations.values()))
            answers = {}
            for (i, cont), (status, sub, ctype) in zip(got.continuations.items(), subs):
                if status != 200:  # the decoder refused the rest (e.g. max_tokens past the context): as it said
                    return web.Response(status=status, body=sub, headers={"Content-Type": ctype})
                if b'"recomputed"' in sub:
                    sub = await self._resume(cont, path, sub)
                try:
                    answers[i] = msgspec.json.decode(sub)
                except msgspec.DecodeError:
                    raise ProxyError(502, f"the decoder answered choice {i}'s continuation with a body that is not "
                                     f"JSON: {sub[:200].decode(errors='replace')!r}", kind="upstream") from None
            answered = True
            data = _encode(prefill_continue.assemble(got, parent.id, req.chat, answers, relay_mod.echo_text(req)))
            if not token_ids.client_asked(req.body):  # the prefill and the continuations were asked for them
                data = token_ids.strip(data)
            return web.Response(status=200, body=data, headers={"Content-Type": "application/json"})
        finally:
            self.registry.close(parent, answered=answered)

    async def _resume(self, req: ClientRequest, path: str, data: bytes) -> bytes:
        try:
            obj = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return data
        choices = obj.get("choices") or []
        usage = obj.get("usage")
        for ch in choices:
            if not rc.is_recomputed(ch):
                continue
            idx = ch.get("index", 0)
            text = rc.choice_text(ch, req.chat)
            toks = ch.get("token_ids")
            prompt_ids = ch.get("prompt_token_ids") or obj.get("prompt_token_ids")  # completions, chat
            generated = rc.generated_tokens(ch, usage, len(choices))
            for _ in range(self.cfg.max_retries + 1):
                cont = rc.continuation(req, idx, text, toks, generated, prompt_ids)
                if cont is None:
                    ch["finish_reason"], ch["stop_reason"] = "length", None
                    break
                self.m.recomputes.inc()
                status, sub, _ = await self.decode(cont, path, read=True)
                if status != 200:
                    raise ProxyError(502, f"resubmitting a recomputed choice failed with HTTP {status}: "
                                     f"{sub[:300].decode(errors='replace')}", kind="recompute_exhausted")
                sobj = msgspec.json.decode(sub)
                sch = (sobj.get("choices") or [{}])[0]
                rc.splice(ch, sch, req.chat)
                rc.add_usage(usage, sobj.get("usage"))
                text = rc.choice_text(ch, req.chat)
                toks = ch.get("token_ids")
                generated += rc.generated_tokens(sch, sobj.get("usage"), 1)
                if not rc.is_recomputed(sch):
                    break
            else:
                raise ProxyError(502, f"choice {idx} was recomputed {self.cfg.max_retries + 1} times; giving up",
                                 kind="recompute_exhausted")
        return _encode(obj)
