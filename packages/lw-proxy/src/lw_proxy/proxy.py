"""The decoder-first PD flow (ARCHITECTURE §6): decoder call with retries, streaming, prefill dispatch,
recompute resumption. HTTP routing and lifecycle live in ``app``."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from lw_core.wire import DecodeTransferParams, PrefillTransferParams

from . import recompute as rc
from .backends import Backend, BackendPool
from .config import ProxyConfig
from .errors import ProxyError
from .fanin import OK_BODY, Outcome, Parent, ParentRegistry
from .metrics import ProxyMetrics
from .validate import ClientRequest

log = logging.getLogger("lw_proxy")

# Statuses that say "this backend cannot serve now" (not "this request is wrong"): try another one.
RETRY_STATUSES = frozenset({502, 503, 504})
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
_DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.encode


class _Call:
    """An open decoder response whose body the caller streams; ``finish`` frees everything."""

    __slots__ = ("dec", "parent", "resp", "work", "t0")

    def __init__(self, dec: Backend, parent: Parent, resp: aiohttp.ClientResponse, work: int, t0: float) -> None:
        self.dec, self.parent, self.resp, self.work, self.t0 = dec, parent, resp, work, t0


class Proxy:
    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self.m = ProxyMetrics()
        self.prefillers = BackendPool("prefiller", cfg.prefillers, self.m)
        self.decoders = BackendPool("decoder", cfg.decoders, self.m)
        self.registry = ParentRegistry(self._prefill, self.m, cfg.metaserver_timeout)
        self.session: aiohttp.ClientSession | None = None
        self.headers = {"Content-Type": "application/json"}
        if cfg.backend_api_key:
            self.headers["Authorization"] = f"Bearer {cfg.backend_api_key}"
        self._metaserver = cfg.metaserver_url
        self._prefill_timeout = aiohttp.ClientTimeout(total=cfg.prefill_timeout, sock_connect=cfg.connect_timeout)
        self._retry_dec = self.m.retries.labels("decoder")
        self._retry_pf = self.m.retries.labels("prefiller")

    async def start(self) -> None:
        conn = aiohttp.TCPConnector(limit=self.cfg.max_connections, limit_per_host=0, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout,
                                        sock_read=self.cfg.backend_timeout)
        self.session = aiohttp.ClientSession(connector=conn, timeout=timeout, auto_decompress=False)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    # ---------------------------------------------------------------- payloads
    def _decoder_payload(self, req: ClientRequest, parent: Parent) -> bytes:
        params = _encode(DecodeTransferParams(metaserver=self._metaserver, lw_parent_id=parent.id,
                                              lw_children=req.children))
        if req.raw is not None:
            # Splice our field into the client's own bytes: a validated JSON object without
            # kv_transfer_params, so inserting before its closing brace is valid JSON.
            raw = req.raw.rstrip()
            return b"".join((raw[:-1], b',"kv_transfer_params":', params, b"}"))
        return _encode({**req.body, "kv_transfer_params": msgspec.json.decode(params)})

    @staticmethod
    def prefill_body(req: ClientRequest, parent_id: str) -> dict[str, Any]:
        body = dict(req.body)
        for k in ("stream_options", "min_tokens", "best_of"):
            body.pop(k, None)
        body.update(max_tokens=1, stream=False, n=1)
        if req.chat:
            body["max_completion_tokens"] = 1
        body["kv_transfer_params"] = msgspec.structs.asdict(PrefillTransferParams(lw_parent_id=parent_id))
        return body

    # ---------------------------------------------------------------- prefill (dispatched by the fan-in)
    async def _prefill(self, parent: Parent) -> Outcome:
        req: ClientRequest = parent.request
        path = CHAT if req.chat else COMPLETIONS
        payload = _encode(self.prefill_body(req, parent.id))
        headers = {**self.headers, "X-Request-Id": f"lw-prefill-{parent.id}"}
        last, exclude = "no prefiller configured", None
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                self._retry_pf.inc()
                await asyncio.sleep(self.cfg.retry_delay)
            pf = self.prefillers.pick(exclude)
            if pf is None:
                break
            pf.acquire(req.prompt_tokens)
            t0 = time.perf_counter()
            try:
                async with self.session.post(pf.url + path, data=payload, headers=headers,
                                             timeout=self._prefill_timeout) as r:
                    data = await r.read()
                    status = r.status
            except UPSTREAM_ERRORS as e:
                pf.mark_failed(repr(e))
                last, exclude = f"{pf.url}: {e!r}", pf
                continue
            finally:
                pf.release(req.prompt_tokens, t0)
            if status in RETRY_STATUSES:
                pf.mark_failed(f"HTTP {status}")
                last, exclude = f"{pf.url}: HTTP {status}", pf
                continue
            pf.mark_ok()
            if status != 200:  # the prefiller refused this request: another prefiller would too
                self.m.errors.labels("prefill_failed").inc()
                raise ProxyError(502, f"prefiller {pf.url} answered HTTP {status}: {data[:500].decode(errors='replace')}",
                                 kind="prefill_failed")
            return 200, OK_BODY
        self.m.errors.labels("prefill_failed").inc()
        raise ProxyError(502, f"no prefiller completed the prefill after {self.cfg.max_retries + 1} attempts; "
                         f"last error: {last}", kind="prefill_failed")

    # ---------------------------------------------------------------- decoder calls
    async def _decode(self, req: ClientRequest, path: str, read: bool) -> tuple[int, bytes, str] | _Call:
        """Send ``req`` to a decoder, retrying other decoders on connect errors and 502/503/504.

        ``read``: read the whole body inside the retry loop (a decoder dying mid-body is retried)
        and return (status, body, content type). Otherwise return the open ``_Call`` once a 200's
        headers arrived; a non-200 is read and returned as a tuple.
        """
        last, exclude = "no decoder configured", None
        work = req.decode_tokens
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                self._retry_dec.inc()
                await asyncio.sleep(self.cfg.retry_delay)
            dec = self.decoders.pick(exclude)
            if dec is None:
                break
            parent = self.registry.open(req.children, req)
            dec.acquire(work)
            t0 = time.perf_counter()
            resp = None
            handed_over = False
            try:
                resp = await self.session.post(dec.url + path, data=self._decoder_payload(req, parent),
                                               headers=self.headers)
                status = resp.status
                if status == 200 and not read:
                    handed_over = True
                    return _Call(dec, parent, resp, work, t0)
                data = await resp.read()
            except UPSTREAM_ERRORS as e:
                dec.mark_failed(repr(e))
                self.m.errors.labels("upstream_connect" if resp is None else "upstream_died").inc()
                last, exclude = f"{dec.url}: {e!r}", dec
                continue
            finally:
                if not handed_over:
                    if resp is not None:
                        resp.close()  # unread body: drop the connection, which tells vLLM to abort
                    dec.release(work, t0)
                    self.registry.close(parent)
            if status in RETRY_STATUSES or (status == 200 and not data.strip()):
                why = f"HTTP {status}" + (" with an empty body" if status == 200 else "")
                dec.mark_failed(why)
                self.m.errors.labels("upstream_status").inc()
                last, exclude = f"{dec.url}: {why}", dec
                continue
            dec.mark_ok()
            return status, data, resp.headers.get("Content-Type", "application/json")
        raise ProxyError(502, f"no decoder completed the request after {self.cfg.max_retries + 1} attempts; "
                         f"last error: {last}", kind="upstream")

    def _finish(self, call: _Call) -> None:
        if call.resp.content.at_eof():
            call.resp.release()
        else:
            call.resp.close()  # unread body: drop the connection, which tells vLLM to abort
        call.dec.release(call.work, call.t0)
        self.registry.close(call.parent)

    # ---------------------------------------------------------------- non-streaming
    async def complete(self, req: ClientRequest, path: str) -> web.Response:
        status, data, ctype = await self._decode(req, path, read=True)
        if status == 200 and b'"recomputed"' in data:
            data = await self._resume(req, path, data)
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
            generated = rc.generated_tokens(ch, usage, len(choices))
            for _ in range(self.cfg.max_retries + 1):
                cont = rc.continuation(req, idx, text, toks, generated)
                if cont is None:
                    ch["finish_reason"], ch["stop_reason"] = "length", None
                    break
                self.m.recomputes.inc()
                status, sub, _ = await self._decode(cont, path, read=True)
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

    # ---------------------------------------------------------------- streaming
    async def stream(self, request: web.Request, req: ClientRequest, path: str) -> web.StreamResponse:
        call = await self._decode(req, path, read=False)
        if isinstance(call, tuple):  # the decoder refused (4xx/500): pass its error through as-is
            status, data, ctype = call
            return web.Response(status=status, body=data, headers={"Content-Type": ctype})
        out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                      "Cache-Control": "no-cache"})
        held: list[int] = []  # choice indices the decoder ended with "recomputed"
        state: dict[str, Any] = {"usage": None, "id": None}
        seen: list[bytes] = []
        try:
            await out.prepare(request)
            ok = await self._pump(call.resp, out, held, state, seen, None)
        finally:
            self._finish(call)
        if ok and held:
            ok = await self._resume_stream(req, path, out, held, state, seen)
        if ok is not True:
            self.m.errors.labels("upstream_died").inc()
            await out.write(b"data: " + ProxyError(502, ok or "decoder stream ended early").body() + b"\n\n")
        elif state["usage"] is not None:
            await out.write(rc.sse_encode(state["usage"]))
        await out.write(_DONE)
        await out.write_eof()
        return out

    async def _pump(self, resp: aiohttp.ClientResponse, out: web.StreamResponse, held: list[int],
                    state: dict[str, Any], seen: list[bytes] | None, rewrite: int | None) -> bool | str:
        """Forward whole SSE events from ``resp`` to ``out`` until [DONE].

        Fast path: blocks without "recomputed" pass through as bytes. Once a choice is recomputed
        (or when ``rewrite`` is set, i.e. a continuation stream whose choice index must become
        ``rewrite``), events are parsed: recomputed finishes and usage/[DONE] are held back.
        Returns True at [DONE], else a message saying how the decoder's stream broke.
        """
        buf = b""
        parse = rewrite is not None
        while True:
            try:
                chunk = await resp.content.readany()
            except UPSTREAM_ERRORS as e:
                return f"decoder stream broke: {e!r}"
            if not chunk:
                return "decoder closed the stream before [DONE]"
            buf += chunk
            cut = buf.rfind(b"\n\n")
            if cut < 0:
                continue
            block, buf = buf[:cut + 2], buf[cut + 2:]
            done = block.endswith(_DONE)
            if done:  # the caller ends the stream itself, after any resumed choices and the usage summary
                block = block[: -len(_DONE)]
            if parse or held or b'"recomputed"' in block:
                parse = True
                block = self._filter(block, held, state, rewrite)
            if block:
                if seen is not None:
                    seen.append(block)
                await out.write(block)
            if done:
                return True

    def _filter(self, block: bytes, held: list[int], state: dict[str, Any], rewrite: int | None) -> bytes:
        keep = []
        for ev in rc.sse_events(block):
            obj = rc.sse_json(ev)
            if obj is None:
                if ev.strip() != _DONE.strip():
                    keep.append(ev)
                continue
            if state["id"] is None:
                state["id"] = obj.get("id")
            choices = obj.get("choices") or []
            if not choices and obj.get("usage") is not None:  # usage summary: sent once, at the end
                if state["usage"] is None:
                    state["usage"] = obj
                else:
                    rc.add_usage(state["usage"].get("usage"), obj["usage"])
                continue
            for ch in choices:
                if rewrite is not None:
                    ch["index"] = rewrite
                if rc.is_recomputed(ch):
                    held.append(ch.get("index", 0))
                    ch["finish_reason"] = ch["stop_reason"] = None
            if rewrite is not None and state["id"] is not None:
                obj["id"] = state["id"]
            if any(rc.choice_text(ch, "delta" in ch) or ch.get("finish_reason") for ch in choices):
                keep.append(rc.sse_encode(obj))
        return b"".join(keep)

    async def _resume_stream(self, req: ClientRequest, path: str, out: web.StreamResponse, held: list[int],
                             state: dict[str, Any], seen: list[bytes]) -> bool | str:
        ledger = rc.StreamLedger(req.chat)
        for block in seen:
            for ev in rc.sse_events(block):
                obj = rc.sse_json(ev)
                if obj is not None:
                    ledger.feed(obj)
        while held:
            idx = held.pop(0)
            for _ in range(self.cfg.max_retries + 1):
                cont = rc.continuation(req, idx, ledger.text.get(idx, ""), ledger.tokens.get(idx),
                                       ledger.generated(idx))
                if cont is None:
                    await out.write(rc.sse_encode({"id": state["id"], "object": "chat.completion.chunk" if req.chat
                                                   else "text_completion", "choices": [
                                                       {"index": idx, "finish_reason": "length", "stop_reason": None,
                                                        **({"delta": {}} if req.chat else {"text": ""})}]}))
                    break
                self.m.recomputes.inc()
                call = await self._decode(cont, path, read=False)
                if isinstance(call, tuple):
                    return f"resubmitting recomputed choice {idx} failed with HTTP {call[0]}"
                again: list[int] = []
                part: list[bytes] = []
                try:
                    ok = await self._pump(call.resp, out, again, state, part, idx)
                finally:
                    self._finish(call)
                if ok is not True:
                    return ok
                for block in part:
                    for ev in rc.sse_events(block):
                        obj = rc.sse_json(ev)
                        if obj is not None:
                            ledger.feed(obj)
                if not again:
                    break
            else:
                self.m.errors.labels("recompute_exhausted").inc()
                return f"choice {idx} was recomputed {self.cfg.max_retries + 1} times; giving up"
        return True
