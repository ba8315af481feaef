"""Metaserver fan-in (docs/design/architecture.md §6 steps 3-5).

A *parent* is one client request (one call of ``Proxy.decode``), across every decoder it is tried
on. Its decoder POSTs one metaserver call per engine request (``children`` of them), and every held
POST is answered with the outcome of the parent's ONE prefill. That prefill is dispatched either
when the client request arrives, in parallel with the decoder call (``dispatch``, the proxy's
``--prefill-dispatch early``), or once all distinct request ids are in (``on-metaserver``: the
fan-in below, which also skips the prefill when every child says ``needs_prefill: false``). With
early dispatch a child that says ``needs_prefill: false`` is answered 200 at once and the prefill
runs on: it is already under way, saves the prompt's KV for other requests and a retried decoder
may still need it. The prefill is dispatched at most once per parent: when the decoder fails and the
request is retried on another decoder (``retry``), that decoder's calls are answered from the
prefill already running or finished, never by a second one. Every wait is bounded: a held POST gets
504 after ``timeout``; a parent that is closed answers its held POSTs with 410. Its prefill, if still
running, is cancelled when no decoder answered (client gone, retries exhausted) or when a held POST
already timed out on it (a stalled prefiller); once a decoder answered, the prefill is left to
finish within ``--prefill-timeout`` (its KV is nearly saved, and cancelling makes the prefiller log
an abort) and counted ``ok``/``error`` when it ends.

Each parent carries a random ``token`` the proxy hands its decoder (``lw_token`` in
``kv_transfer_params``); with ``require_token`` a POST must send it back as ``Authorization: Bearer``.
The registry indexes the open parents' tokens, so a POST's header can be judged (``token_refusal``)
before a byte of its body is read: the body names the parent, the header alone says whether the
caller holds a token the proxy issued and still honours.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from lw_core.wire import MetaserverResponse

from .auth import same_secret
from .errors import ProxyError
from .metrics import ProxyMetrics
from .relay import engine_choice

log = logging.getLogger("lw_proxy")

OK_BODY = msgspec.json.encode(MetaserverResponse())
Outcome = tuple[int, bytes]  # HTTP status and JSON body for the held metaserver POSTs


class Parent:
    __slots__ = ("id", "token", "children", "request", "ids", "waiters", "result", "task", "attempts", "wanted",
                 "early", "stalled", "relay", "forcing", "answers", "choice_waiters", "relay_more", "said",
                 "said_waiters")

    def __init__(self, children: int, request: Any) -> None:
        self.id = uuid.uuid4().hex
        self.token = secrets.token_urlsafe(24)
        self.attempts = 1  # decoder attempts so far
        self.wanted = False  # some child of this attempt needs the prefill (needs_prefill true or unsaid)
        self.children = children
        self.request = request  # what the dispatcher needs to build the prefill (a ClientRequest)
        self.ids: set[str] = set()
        self.waiters: list[asyncio.Future[Outcome]] = []
        self.result: Outcome | None = None
        self.task: asyncio.Task[None] | None = None
        self.early = False  # the prefill was dispatched with the client request, not by the fan-in
        self.stalled = False  # a held POST timed out waiting for the prefill
        self.relay: Any = None  # --prefill-first: a future given the prefill's 200 answer (relay.Prefilled)
        # The choices (indices) whose decoder request continues from the first token its answer carries.
        self.forcing: set[int] = set()
        # The 200 answer's body per choice when it carries that choice's first token (prefill_dispatch):
        # a choice's engine request gets its own (``relay.engine_choice``), others the plain answer.
        self.answers: dict[int, bytes] = {}
        # A streamed prefill (prefill_stream) answers each choice as its token comes: the held POSTs
        # of each choice's engine request, and the further choices' relays after the first.
        self.choice_waiters: dict[int, list[asyncio.Future[Outcome]]] = {}
        self.relay_more: asyncio.Queue[Any] | None = None
        # The choices whose engine request POSTed (so said whether it continues from its token), and
        # who waits for more of them (``settle``).
        self.said: set[int] = set()
        self.said_waiters: list[asyncio.Future[None]] = []

    def forced(self, choices: set[int] | frozenset[int]) -> bool:
        """Every one of ``choices`` continues on the decoder from the first token its answer
        carries: its engine request said ``forces_first`` and its answer has the token, and no held
        POST timed out waiting for the prefill."""
        return choices <= self.answers.keys() and choices <= self.forcing and not self.stalled

    def answer_choice(self, i: int, answer: bytes) -> None:
        """Choice ``i``'s token came (a streamed prefill): its held POSTs are answered now with
        ``answer`` (``ParentRegistry._for`` picks it), and later ones at once."""
        self.answers[i] = answer
        for f in self.choice_waiters.pop(i, ()):
            if not f.done():
                f.set_result((200, OK_BODY))

    def say(self, choice: int, forces_first: bool | None) -> None:
        """Choice ``choice``'s engine request POSTed, saying ``forces_first``: wake ``settle``."""
        if forces_first:
            self.forcing.add(choice)
        self.said.add(choice)
        waiters, self.said_waiters = self.said_waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    async def settle(self, choices: frozenset[int], timeout: float) -> bool:
        """``forced(choices)`` once it is known: wait until every one of ``choices``' engine requests
        POSTed (at most ``timeout`` s; a decoder's POST can come after the prefill answered, when
        the prefill is short and the decoder's intake is not). A decoder produces nothing before
        its POST is answered, so a stream waiting here waits no longer than the decoder would."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.forced(choices) and not choices <= self.said and loop.time() < deadline:
            fut: asyncio.Future[None] = loop.create_future()
            self.said_waiters.append(fut)
            try:
                await asyncio.wait_for(fut, deadline - loop.time())
            except TimeoutError:
                break
            finally:
                if fut in self.said_waiters:
                    self.said_waiters.remove(fut)
        return self.forced(choices)


class ParentRegistry:
    def __init__(self, dispatch: Callable[[Parent], Awaitable[Outcome]], metrics: ProxyMetrics,
                 timeout: float, require_token: bool = False, api_key: str | None = None) -> None:
        self._dispatch = dispatch
        self._require_token = require_token
        self._api_key = api_key.encode() if api_key is not None else None  # also accepted in place of a parent's token
        self._reused = metrics.prefill_reused
        self._parents: dict[str, Parent] = {}
        self._tokens: dict[str, Parent] = {}  # open parents by token
        self._running: set[asyncio.Task[None]] = set()  # prefills, closed parents' included
        self._m = metrics
        self._timeout = timeout
        self._wait_ok = metrics.metaserver_wait.labels("ok")
        self._prefill_ok = metrics.prefills.labels("ok")
        self._prefill_err = metrics.prefills.labels("error")

    def __len__(self) -> int:
        return len(self._parents)

    def open(self, children: int, request: Any) -> Parent:
        p = Parent(children, request)
        self._parents[p.id] = p
        self._tokens[p.token] = p
        self._m.parents.inc()
        return p

    def dispatch(self, p: Parent) -> None:
        """Start the parent's prefill now (early dispatch), unless it was already dispatched."""
        if p.task is None and p.result is None:
            p.early = True
            self._start(p)

    def _start(self, p: Parent) -> None:
        p.task = t = asyncio.create_task(self._run(p))
        self._running.add(t)
        t.add_done_callback(self._running.discard)

    def retry(self, p: Parent) -> None:
        """The parent's request moves to another decoder. Before its prefill was dispatched, the
        request ids that arrived belong to the abandoned attempt: forget them (their held POSTs get
        410) so the new decoder's ids fill the fan-in. After, the prefill stands for every attempt."""
        p.attempts += 1
        if p.task is None:  # not dispatched (or skipped: the new decoder may not hold the prompt)
            p.ids.clear()
            p.forcing.clear()
            p.said.clear()
            p.result = None
            p.wanted = False
            self._answer_gone(p, "the decoder attempt was abandoned")

    def _answer_gone(self, p: Parent, why: str) -> None:
        if p.waiters:
            gone = ProxyError(410, f"parent {p.id} is finished ({why}); recompute locally")
            for f in p.waiters:
                if not f.done():
                    f.set_result((410, gone.body()))

    def close(self, p: Parent, answered: bool = False) -> None:
        """The parent's request is over. ``answered``: a decoder answered it (200); then a running
        prefill is left to finish (bounded by the prefill timeout) unless a POST already timed out
        on it; otherwise it is cancelled."""
        if self._parents.pop(p.id, None) is None:
            return
        self._tokens.pop(p.token, None)
        self._m.parents.dec()
        if p.task is not None and not p.task.done() and (not answered or p.stalled):
            p.task.cancel()
            self._m.prefills.labels("cancelled").inc()
        self._answer_gone(p, "its decoder request ended")

    async def shutdown(self) -> None:
        """Cancel every prefill still running (closed parents' included) and wait for them."""
        tasks = [t for t in self._running if not t.done()]
        for t in tasks:
            t.cancel()
            self._m.prefills.labels("cancelled").inc()
        await asyncio.gather(*tasks, return_exceptions=True)

    def known_token(self, token: str | None) -> bool:
        """``token`` is an open parent's token, or the API key."""
        if token is None:
            return False
        return token in self._tokens or (self._api_key is not None and same_secret(token, self._api_key))

    def token_refusal(self, token: str | None) -> ProxyError | None:
        """Why a metaserver POST with this bearer token is refused before its body is read, or None.

        A token the proxy never issued, or whose request already ended, is refused at any time; no
        token at all only when the proxy has an API key (an older connector sends none)."""
        if token is None:
            if not self._require_token:
                return None
            return ProxyError(401, "metaserver calls need 'Authorization: Bearer <lw_token>' (the lw_token the proxy "
                              "put in kv_transfer_params) because the proxy has an API key; this decoder sent "
                              "none: upgrade its lw-vllm connector", kind="auth")
        if self.known_token(token):
            return None
        return ProxyError(401, "the metaserver bearer token is no open request's lw_token (wrong, or its request "
                          "already ended); recompute locally", kind="auth")

    def _refuse_token(self, p: Parent | None, token: str | None) -> Outcome | None:
        if token is None:
            e = self.token_refusal(None)
            return None if e is None else (e.status, e.body())
        if p is None:
            return None  # 404 below
        ok = same_secret(token, p.token.encode()) or (self._api_key is not None and same_secret(token, self._api_key))
        if ok:
            return None
        e = ProxyError(401, f"wrong metaserver token for parent {p.id}", kind="auth")
        return e.status, e.body()

    async def arrive(self, parent_id: str, request_id: str, token: str | None = None,
                     needs_prefill: bool | None = None, forces_first: bool | None = None) -> Outcome:
        """A decoder's metaserver POST; returns when the parent's prefill is done, or at the deadline.

        ``needs_prefill`` False: the decoder already holds the prompt. When every child of the
        attempt says so, no prefill is dispatched and the POSTs are answered 200 at once.
        ``forces_first``: the decoder continues from the first token the answer carries (each
        choice's engine request is answered with its choice's token: ``_for``)."""
        p = self._parents.get(parent_id)
        out = await self._arrive(p, parent_id, request_id, token, needs_prefill, forces_first)
        return out if p is None else self._for(p, request_id, out)

    @staticmethod
    def _for(p: Parent, request_id: str, out: Outcome) -> Outcome:
        """The outcome for engine request ``request_id``: a 200 carries its choice's first token
        when the prefill's answer has one (``Parent.answers``)."""
        if out[0] != 200 or not p.answers:
            return out
        i = engine_choice(p.request, p.id, request_id)
        return (200, p.answers.get(i, out[1])) if i is not None else out

    async def _arrive(self, p: Parent | None, parent_id: str, request_id: str, token: str | None,
                      needs_prefill: bool | None, forces_first: bool | None) -> Outcome:
        t0 = time.perf_counter()
        refused = self._refuse_token(p, token)
        if refused is not None:
            return refused
        if p is None:
            self._m.metaserver_wait.labels("unknown_parent").observe(0)
            e = ProxyError(404, f"unknown lw_parent_id {parent_id!r} (never issued, or already finished)",
                           param="lw_parent_id")
            return e.status, e.body()
        choice = engine_choice(p.request, p.id, request_id)  # which choice's engine request
        if choice is not None:
            p.say(choice, forces_first)
        if p.task is not None or p.result is not None:
            # dispatched: a repeated POST, or a retried decoder's, shares that prefill. Each decoder
            # attempt brings at most ``children`` new ids: past that, refused as before dispatch.
            if request_id not in p.ids:
                if len(p.ids) >= p.children * p.attempts:
                    return self._too_many(p, request_id)
                p.ids.add(request_id)
                if p.attempts > 1:
                    self._reused.inc()
            if p.early and needs_prefill is False:
                self._wait_ok.observe(0)
                return 200, OK_BODY  # the decoder holds the prompt; the prefill runs on (see above)
            if p.result is not None:  # finished before this POST (early dispatch, or a retried decoder)
                self._observe(p.result, t0)
                return p.result
            if choice is not None and choice in p.answers:  # a streamed prefill already answered this choice
                self._wait_ok.observe(0)
                return 200, OK_BODY
        elif request_id not in p.ids:
            if len(p.ids) >= p.children:
                return self._too_many(p, request_id)
            p.ids.add(request_id)
            if needs_prefill is not False:
                p.wanted = True
        if len(p.ids) == p.children and p.task is None and p.result is None and not p.wanted:
            self._m.prefills.labels("skipped").inc()
            p.result = (200, OK_BODY)
            self._answer(p, p.result)
            return p.result
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        p.waiters.append(fut)
        if choice is not None:
            p.choice_waiters.setdefault(choice, []).append(fut)
        if len(p.ids) == p.children and p.task is None:
            self._start(p)
        try:
            out = await asyncio.wait_for(asyncio.shield(fut), self._timeout)
        except TimeoutError:
            p.stalled = True
            self._m.metaserver_wait.labels("timeout").observe(time.perf_counter() - t0)
            have = len(p.ids)
            e = ProxyError(504, f"prefill for parent {parent_id} not done within {self._timeout:g} s "
                           f"({have}/{p.children} request ids arrived); recompute locally", kind="timeout")
            return e.status, e.body()
        finally:
            if fut in p.waiters:
                p.waiters.remove(fut)
            if choice is not None and fut in p.choice_waiters.get(choice, ()):
                p.choice_waiters[choice].remove(fut)
        self._observe(out, t0)
        return out

    @staticmethod
    def _too_many(p: Parent, request_id: str) -> Outcome:
        have = f"{p.children} request ids" + (f" per decoder attempt ({p.attempts} so far)" if p.attempts > 1 else "")
        e = ProxyError(409, f"parent {p.id} expects {have} and already has them; {request_id!r} is one too many",
                       param="request_id")
        return e.status, e.body()

    def _observe(self, out: Outcome, t0: float) -> None:
        if out[0] == 200:
            self._wait_ok.observe(time.perf_counter() - t0)
        else:
            self._m.metaserver_wait.labels("error").observe(time.perf_counter() - t0)

    async def _run(self, p: Parent) -> None:
        try:
            out = await self._dispatch(p)
        except asyncio.CancelledError:
            raise
        except ProxyError as e:
            out = (e.status, e.body())
        except Exception as e:  # a bug must still answer the decoders, not leave them to their timeout
            log.exception("prefill dispatch for %s failed", p.id)
            err = ProxyError(502, f"prefill dispatch failed: {e!r}")
            out = (err.status, err.body())
        (self._prefill_ok if out[0] == 200 else self._prefill_err).inc()
        p.result = out
        self._answer(p, out)

    @staticmethod
    def _answer(p: Parent, out: Outcome) -> None:
        for f in p.waiters:
            if not f.done():
                f.set_result(out)
