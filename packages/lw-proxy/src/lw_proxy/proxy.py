"""The decoder-first PD flow (docs/design/architecture.md §6): decoder call with retries, prefill dispatch,
non-streaming recompute resumption. Streams go through the ``SseRelay`` this proxy owns (``sse_relay``),
which calls back only ``decode`` and ``finish`` (``upstream.Upstream``). HTTP routing and lifecycle
live in ``app``."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Literal, overload

import aiohttp
import msgspec
from aiohttp import web

from lw_core.wire import DecodeTransferParams, PrefillTransferParams

from . import recompute as rc
from . import token_ids
from .backends import Backend, BackendPool
from .config import PREFILL_DISPATCH, ProxyConfig
from .errors import ProxyError
from .fanin import OK_BODY, Outcome, Parent, ParentRegistry
from .metrics import ProxyMetrics
from .relay import request_id as relay_request_id
from .sse_relay import SseRelay, deadline_error
from .upstream import RETRY_STATUSES, UPSTREAM_ERRORS, DecoderCall
from .validate import ClientRequest

log = logging.getLogger("lw_proxy")

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
_encode = msgspec.json.encode


class Proxy:
    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self.m = ProxyMetrics()
        self.prefillers = BackendPool("prefiller", cfg.prefillers, self.m)
        self.decoders = BackendPool("decoder", cfg.decoders, self.m)
        self.registry = ParentRegistry(self._prefill, self.m, cfg.metaserver_timeout,
                                       require_token=cfg.api_key is not None, api_key=cfg.api_key)
        self.session: aiohttp.ClientSession | None = None
        self.headers = {"Content-Type": "application/json"}
        if cfg.backend_api_key is not None:
            self.headers["Authorization"] = f"Bearer {cfg.backend_api_key}"
        self._metaserver = cfg.metaserver_url
        if cfg.prefill_dispatch not in PREFILL_DISPATCH:
            raise ValueError(f"prefill_dispatch: {cfg.prefill_dispatch!r} is not one of {PREFILL_DISPATCH}")
        self._early = cfg.prefill_dispatch == "early"
        self._prefill_timeout = aiohttp.ClientTimeout(total=cfg.prefill_timeout, sock_connect=cfg.connect_timeout)
        self._retry_dec = self.m.retries.labels("decoder")
        self._retry_pf = self.m.retries.labels("prefiller")
        self.sse = SseRelay(cfg, self.m, upstream=self)

    async def start(self) -> None:
        conn = aiohttp.TCPConnector(limit=self.cfg.max_connections, limit_per_host=0, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout,
                                        sock_read=self.cfg.backend_timeout)
        self.session = aiohttp.ClientSession(connector=conn, timeout=timeout, auto_decompress=False)

    def _client(self) -> aiohttp.ClientSession:
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
                                              lw_children=req.children, lw_token=parent.token))
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

    @staticmethod
    def prefill_body(req: ClientRequest, parent_id: str, token_ids: bool = False) -> dict[str, Any]:
        """``token_ids``: ask for the prompt's and the first token's ids (a relayed first token's)."""
        body = dict(req.body)
        for k in ("stream_options", "min_tokens", "best_of"):
            body.pop(k, None)
        body.update(max_tokens=1, stream=False, n=1)
        if req.chat:
            body["max_completion_tokens"] = 1
        if token_ids:
            body["return_token_ids"] = True
        kv = msgspec.structs.asdict(PrefillTransferParams(lw_parent_id=parent_id))
        if req.prompt_ids is not None:  # a resumed chat choice: the prompt the decoder is given too
            kv["prompt_token_ids"] = req.prompt_ids
        body["kv_transfer_params"] = kv
        return body

    # ---------------------------------------------------------------- prefill (dispatched early or by the fan-in)
    async def _prefill(self, parent: Parent) -> Outcome:
        req: ClientRequest = parent.request
        path = CHAT if req.chat else COMPLETIONS
        payload = _encode(self.prefill_body(req, parent.id, token_ids=parent.relay is not None))
        headers = {**self.headers, "X-Request-Id": f"lw-prefill-{parent.id}"}
        # Each prefiller is tried at most once per parent: one that answered 503 is overloaded, and
        # asking it again only adds load; the decoders recompute instead.
        last, tried = "no prefiller configured", set[Backend]()
        attempts = min(self.cfg.max_retries + 1, len(self.prefillers.backends))
        for attempt in range(attempts):
            if attempt:
                self._retry_pf.inc()
                await asyncio.sleep(self.cfg.retry_delay)
            pf = self.prefillers.pick(tried)
            if pf is None:
                break
            tried.add(pf)
            pf.acquire(req.prompt_tokens)
            t0 = time.perf_counter()
            try:
                async with self._client().post(pf.url + path, data=payload, headers=headers,
                                             timeout=self._prefill_timeout) as r:
                    data = await r.read()
                    status = r.status
            except UPSTREAM_ERRORS as e:
                pf.mark_failed(repr(e))
                last = f"{pf.url}: {e!r}"
                continue
            finally:
                pf.release(req.prompt_tokens, t0)
            if status in RETRY_STATUSES:
                pf.mark_failed(f"HTTP {status}")
                last = f"{pf.url}: HTTP {status}"
                continue
            pf.mark_ok()
            if status == 200 and parent.relay is not None and not parent.relay.done():
                parent.relay.set_result((parent.id, data))
            if status != 200:  # the prefiller refused this request: another prefiller would too
                self.m.errors.labels("prefill_failed").inc()
                raise ProxyError(502, f"prefiller {pf.url} answered HTTP {status}: {data[:500].decode(errors='replace')}",
                                 kind="prefill_failed")
            return 200, OK_BODY
        self.m.errors.labels("prefill_failed").inc()
        raise ProxyError(502, f"no prefiller completed the prefill after {attempts} attempt(s) (each prefiller "
                         f"at most once); last error: {last}", kind="prefill_failed")

    # ---------------------------------------------------------------- decoder calls
    @overload
    async def decode(self, req: ClientRequest, path: str, read: Literal[True],
                     relay: asyncio.Future | None = None) -> tuple[int, bytes, str]: ...

    @overload
    async def decode(self, req: ClientRequest, path: str, read: bool,
                     relay: asyncio.Future | None = None) -> tuple[int, bytes, str] | DecoderCall: ...

    async def decode(self, req: ClientRequest, path: str, read: bool,
                     relay: asyncio.Future | None = None) -> tuple[int, bytes, str] | DecoderCall:
        """Send ``req`` to a decoder, retrying other decoders on connect errors and 502/503/504.

        ``read``: read the whole body inside the retry loop (a decoder dying mid-body is retried)
        and return (status, body, content type). Otherwise return the open ``DecoderCall`` once a 200's
        first body bytes arrived (within ``first_byte_timeout``: a decoder silent that long counts as
        hung); a non-200 is read and returned as a tuple.

        One parent serves every attempt: a retried decoder's metaserver calls are answered from the
        prefill the first attempt started, never by a second prefill.
        """
        last, exclude, timed_out = "no decoder configured", None, False
        work = req.decode_tokens
        parent = self.registry.open(req.children, req)
        headers = self.headers
        if relay is not None:
            parent.relay = relay
            headers = {**self.headers, "X-Request-Id": relay_request_id(parent.id)}
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
                if self._early and parent.task is None:  # the prefill runs alongside the decoder call (once per parent)
                    self.registry.dispatch(parent)
                    # Let the prefill's request go out before the decoder's: the prefill is the
                    # critical path (a streamed first token relayed from it, or the KV the
                    # decoder waits for), and the decoder has nothing to do until it runs.
                    await asyncio.sleep(0)
                dec.acquire(work)
                t0 = time.perf_counter()
                resp = None
                first_byte = asyncio.timeout(None if read else self.cfg.first_byte_timeout)
                try:
                    async with first_byte:
                        resp = await self._client().post(dec.url + path, data=self._decoder_payload(req, parent),
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
            if not handed_over:
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

    async def complete(self, req: ClientRequest, path: str) -> web.Response:
        status, data, ctype = await self.decode(req, path, read=True)
        if status == 200 and b'"recomputed"' in data:
            data = await self._resume(req, path, data)
        if status == 200 and token_ids.asks(req.body):
            data = token_ids.strip(data)
        return web.Response(status=status, body=data, headers={"Content-Type": ctype})

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
