"""The decoder's metaserver calls (docs/design/architecture.md §6 step 3), off vLLM's scheduler loop.

A kv_consumer engine request carrying ``do_remote_prefill`` and a ``metaserver`` URL POSTs
``{lw_parent_id, request_id}`` once; the proxy holds the POST until the prefiller has committed the
prompt's KV to the pool, then answers 200. The POSTs run on one asyncio loop in a daemon thread
(aiohttp, which vLLM itself depends on): they are long-held, possibly hundreds at once, so a thread
per call would not scale. The scheduler only polls: ``poll`` is a dict read, never a wait.

Every call has a deadline (``metaserver_timeout_s``), enforced twice: by aiohttp on the call, and by
``poll`` from the scheduler's clock, so a wedged loop can never keep a request waiting.

The URL comes with the request, from whoever sent it: the client calls only URLs its allow list
(``pd_allowed_metaservers``, ``lw_core.metaserver_allow``) accepts (the coordinator asks first; ``post``
refuses any other, so no path makes an outbound call to an unlisted URL), follows no redirect, and
holds at most ``max_connections`` connections open (``pd_metaserver_max_connections``): further calls
wait for one, within their deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import TYPE_CHECKING

import msgspec

from lw_core.metaserver_allow import MetaserverAllowList
from lw_core.wire import DecodeTransferParams, MetaserverRequest, MetaserverResponse, decode_transfer_params
from lw_vllm.request.request_state import Outcome

if TYPE_CHECKING:  # imported when the first call is made
    import aiohttp

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 5.0
_response_decoder = msgspec.json.Decoder(MetaserverResponse)


def remote_prefill_params(raw: object) -> DecodeTransferParams | str | None:
    """The request's remote-prefill params, an error text when they are ours but malformed, or
    ``None`` for a request that is not a layerwise remote prefill.

    Only params with a ``metaserver`` key are ours: other connectors' PD protocols (NIXL's
    ``remote_engine_id`` …) also set ``do_remote_prefill`` and must be left alone."""
    if not isinstance(raw, dict) or not raw.get("do_remote_prefill") or "metaserver" not in raw:
        return None
    try:
        params = decode_transfer_params(raw)
    except msgspec.ValidationError as e:
        return f"bad kv_transfer_params: {e}"
    assert isinstance(params, DecodeTransferParams)
    if not params.metaserver.startswith(("http://", "https://")):
        return f"bad kv_transfer_params.metaserver={params.metaserver!r}: accepted: an http:// or https:// URL"
    return params


class _Call:
    __slots__ = ("future", "started", "outcome")

    def __init__(self, future: concurrent.futures.Future, started: float) -> None:
        self.future = future
        self.started = started
        self.outcome: Outcome | None = None


class MetaserverClient:
    """Starts its loop thread on first use (the engine core forks before any request arrives).
    ``allow``: the URLs it may call (``None``: the default rule, a proxy on loopback);
    ``max_connections``: calls open at once."""

    def __init__(self, timeout_s: float, allow: MetaserverAllowList | None = None, max_connections: int = 1024) -> None:
        self.timeout_s = timeout_s
        self.allow = allow if allow is not None else MetaserverAllowList(None)
        self.max_connections = max_connections
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._session: aiohttp.ClientSession | None = None  # made on the loop thread, on first use
        self._calls: dict[str, _Call] = {}
        self._answered = threading.Event()  # set by the loop thread whenever a call completes

    # --- scheduler thread ---
    def post(self, request_id: str, params: DecodeTransferParams, needs_prefill: bool | None = None,
             forces_first: bool | None = None) -> None:
        """Start the call for ``request_id`` unless one exists (vLLM asks again after preemption).
        ``needs_prefill``, ``forces_first``: see ``lw_core.wire.MetaserverRequest``."""
        if request_id in self._calls:
            return
        refused = self.allow.why_refused(params.metaserver)
        if refused is not None:  # the coordinator asks first: reaching here is a bug, never a call
            raise ValueError(f"metaserver {params.metaserver!r} is not allowed: {refused}")
        body = msgspec.json.encode(MetaserverRequest(lw_parent_id=params.lw_parent_id, request_id=request_id,
                                                     needs_prefill=needs_prefill, forces_first=forces_first))
        loop = self._ensure_loop()
        fut = asyncio.run_coroutine_threadsafe(self._post(params.metaserver, body, params.lw_token), loop)
        fut.add_done_callback(lambda _f: self._answered.set())
        self._calls[request_id] = _Call(fut, time.monotonic())

    def wait_for_answer(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for any call to complete (returns at once if one has since
        the last wait). For an engine with nothing else to do; see SchedulerSide."""
        got = self._answered.wait(timeout_s)
        self._answered.clear()
        return got

    def poll(self, request_id: str) -> Outcome | None:
        """The call's outcome, or ``None`` while it is still within its deadline."""
        call = self._calls.get(request_id)
        if call is None:
            return None
        if call.outcome is None:
            waited = time.monotonic() - call.started
            if call.future.done():
                try:
                    call.outcome = call.future.result()
                except BaseException as e:  # cancelled or a bug in _post: recompute, never fail the request
                    call.outcome = Outcome(False, f"metaserver call failed: {e!r}", waited)
            elif waited > self.timeout_s + 1.0:
                # aiohttp's own deadline should have fired by now; do not depend on it.
                call.future.cancel()
                call.outcome = Outcome(False, f"no metaserver answer within {self.timeout_s:g} s", waited)
        return call.outcome

    def forget(self, request_id: str, *, cancel: bool = True) -> None:
        """Drop the call's state. ``cancel``: also abort a call still in flight (the proxy sees the
        connection close); without it the call runs to its answer or deadline, because the proxy
        dispatches a parent's prefill only once every child has called."""
        call = self._calls.pop(request_id, None)
        if cancel and call is not None and not call.future.done():
            call.future.cancel()

    def close(self) -> None:
        for rid in list(self._calls):
            self.forget(rid)
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if self._session is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._session.close(), loop).result(_CLOSE_TIMEOUT_S)
            except Exception as e:
                log.debug("lw-vllm: closing the metaserver session: %r", e)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(_CLOSE_TIMEOUT_S)
        self._loop = self._thread = self._session = None

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                t = threading.Thread(target=loop.run_forever, name="lw-metaserver", daemon=True)
                t.start()
                self._loop, self._thread = loop, t
            return self._loop

    # --- loop thread ---
    async def _post(self, url: str, body: bytes, token: str | None = None) -> Outcome:
        import aiohttp

        t0 = time.monotonic()
        if self._session is None:
            # Each call is held until its prefill is done: many may be open at once, but never
            # more than max_connections (the rest wait for a connection, within their deadline).
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
                limit=self.max_connections, limit_per_host=self.max_connections))
        headers = {"Content-Type": "application/json"}
        if token is not None:  # the per-parent token the proxy handed us: it authenticates this call
            headers["Authorization"] = f"Bearer {token}"
        try:
            async with self._session.post(
                url, data=body, headers=headers, allow_redirects=False,  # only the URL that was allowed
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            ) as r:
                raw = await r.read()
                waited = time.monotonic() - t0
                if r.status != 200:
                    return Outcome(False, f"metaserver answered {r.status}: {raw[:300].decode(errors='replace')}", waited)
                try:
                    answer = _response_decoder.decode(raw)
                except msgspec.DecodeError as e:
                    return Outcome(False, f"metaserver answered 200 with an unexpected body ({e})", waited)
                return Outcome(True, "ok", waited, answer.first_token, answer.prompt_digest)
        except asyncio.TimeoutError:
            return Outcome(False, f"no metaserver answer within {self.timeout_s:g} s", time.monotonic() - t0)
        except aiohttp.ClientError as e:
            return Outcome(False, f"metaserver {url} unreachable: {e!r}", time.monotonic() - t0)
