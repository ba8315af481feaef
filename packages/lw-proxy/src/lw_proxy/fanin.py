"""Metaserver fan-in (ARCHITECTURE §6 steps 3-5).

A *parent* is one decoder attempt of one client request. Its decoder POSTs one metaserver call per
engine request (``children`` of them); when all distinct request ids are in, ONE prefill is
dispatched, and every held POST is answered with that prefill's outcome. Every wait is bounded: a
held POST gets 504 after ``timeout``; a parent that is closed (decoder answered, client gone,
retry on another decoder) answers its held POSTs with 410 and cancels its prefill.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from lw_core.wire import MetaserverResponse

from .errors import ProxyError
from .metrics import ProxyMetrics

log = logging.getLogger("lw_proxy")

OK_BODY = msgspec.json.encode(MetaserverResponse())
Outcome = tuple[int, bytes]  # HTTP status and JSON body for the held metaserver POSTs


class Parent:
    __slots__ = ("id", "children", "request", "ids", "waiters", "result", "task")

    def __init__(self, children: int, request: Any) -> None:
        self.id = uuid.uuid4().hex
        self.children = children
        self.request = request  # what the dispatcher needs to build the prefill (a ClientRequest)
        self.ids: set[str] = set()
        self.waiters: list[asyncio.Future[Outcome]] = []
        self.result: Outcome | None = None
        self.task: asyncio.Task[None] | None = None


class ParentRegistry:
    def __init__(self, dispatch: Callable[[Parent], Awaitable[Outcome]], metrics: ProxyMetrics,
                 timeout: float) -> None:
        self._dispatch = dispatch
        self._parents: dict[str, Parent] = {}
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
        self._m.parents.inc()
        return p

    def close(self, p: Parent) -> None:
        if self._parents.pop(p.id, None) is None:
            return
        self._m.parents.dec()
        if p.task is not None and not p.task.done():
            p.task.cancel()
            self._m.prefills.labels("cancelled").inc()
        if p.waiters:
            gone = ProxyError(410, f"parent {p.id} is finished (its decoder request ended); recompute locally")
            for f in p.waiters:
                if not f.done():
                    f.set_result((410, gone.body()))

    async def arrive(self, parent_id: str, request_id: str) -> Outcome:
        """A decoder's metaserver POST; returns when the parent's prefill is done, or at the deadline."""
        t0 = time.perf_counter()
        p = self._parents.get(parent_id)
        if p is None:
            self._m.metaserver_wait.labels("unknown_parent").observe(0)
            e = ProxyError(404, f"unknown lw_parent_id {parent_id!r} (never issued, or already finished)",
                           param="lw_parent_id")
            return e.status, e.body()
        if p.result is not None:  # a repeated POST after the prefill finished
            return p.result
        if request_id not in p.ids:
            if len(p.ids) >= p.children:
                e = ProxyError(409, f"parent {parent_id} expects {p.children} request ids and already has them; "
                               f"{request_id!r} is one too many", param="request_id")
                return e.status, e.body()
            p.ids.add(request_id)
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        p.waiters.append(fut)
        if len(p.ids) == p.children and p.task is None:
            p.task = asyncio.create_task(self._run(p))
        try:
            out = await asyncio.wait_for(asyncio.shield(fut), self._timeout)
        except asyncio.TimeoutError:
            self._m.metaserver_wait.labels("timeout").observe(time.perf_counter() - t0)
            have = len(p.ids)
            e = ProxyError(504, f"prefill for parent {parent_id} not done within {self._timeout:g} s "
                           f"({have}/{p.children} request ids arrived); recompute locally", kind="timeout")
            return e.status, e.body()
        finally:
            if fut in p.waiters:
                p.waiters.remove(fut)
        if out[0] == 200:
            self._wait_ok.observe(time.perf_counter() - t0)
        else:
            self._m.metaserver_wait.labels("error").observe(time.perf_counter() - t0)
        return out

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
        for f in p.waiters:
            if not f.done():
                f.set_result(out)
