"""One step's saves: KV blocks -> reserved pool objects, layer by layer, on the save workers.

An object is committed only when every layer of it was written; anything else is aborted, so a
reader never sees a partial object. After ``finish`` has cancelled the step (under ``self.lock``)
no copy into a backend ``view`` starts any more: an aborted object's memory may already belong to
another object. A ``backend.write`` that stalls past the deadline cannot be recalled; the backend
must ignore or refuse writes to handles that were aborted meanwhile.

A background step (``SaveFinisher``) may also be cancelled before its ``finish`` when its caller
takes its KV blocks back (``cancel_reads``: a preempted request's blocks). The cancel is checked
under ``self.lock`` right before every copy out of the KV cache, and a layer's objects count as
written only if its copy ended before the cancel, so what a copy still running then reads (the
blocks' next owner's KV) is never committed: those objects are aborted.

A copy into a view may run on after ``from_kv`` returns (a device copier writing registered pool
memory itself): its batch is ``pending`` until its token completes, and only then are its objects'
layers ``done``. ``finish`` settles every pending copy (same deadline) before it commits; an object
whose copy is still running then is neither committed nor aborted at once: it is aborted once the
copy has completed (``StepContext.after_copies``), so a late copy never writes space that another
object was given meanwhile. The same holds for a copy into the reservations' own buffers
(``backend.write_buffers``, then ``write``, which sends from them): one still running at its
deadline leaves its objects in flight, aborted once it completed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from lw_core.backend import BackendError
from lw_core.pipeline.context import LazyAddressTable, StepContext
from lw_core.pipeline.pool import ErrorLog, describe, log
from lw_core.pipeline.results import SaveResult
from lw_core.plan import ReqSave, flatten


class SaveStep:
    def __init__(self, ctx: StepContext, saves: Sequence[ReqSave]):
        self.ctx = ctx
        keys, blocks, owners = flatten(saves)
        first: dict[str, int] = {}
        self.owners_of: dict[str, list[str]] = {}
        for k, b, o in zip(keys, blocks, owners):
            first.setdefault(k, b)  # the same chunk twice in a step: one copy is enough
            self.owners_of.setdefault(k, [])
            if o not in self.owners_of[k]:
                self.owners_of[k].append(o)
        self.all_keys = list(first)
        self.first_block = first
        nl = ctx.layout.num_layers
        self.lock = threading.Lock()
        self.cancelled = False
        self.errors = ErrorLog()
        self.skipped: list[str] = []
        self.keys: list[str] = []
        self.blocks: list[int] = []
        self.handles: list[Any] = []
        self.block_arr = np.zeros(0, dtype=np.int64)
        self.table = LazyAddressTable()  # the backend's address table of the handles
        self.failed_early: list[str] = []  # keys that failed before any copy (reserve errors)
        self.submitted = [False] * nl
        self.events = [threading.Event() for _ in range(nl)]
        self.misses: list[int] = []
        self.commit_unknown: set[int] = set()  # commit timed out: neither committed nor abortable
        # Copies into views not yet known complete: (token, layer, items); under self.lock.
        self.pending: list[tuple[Any, int, list[int]]] = []
        self.settling: list[tuple[Any, int, list[int]]] = []  # pending copies ``_settle`` waits for now
        self.running: list[Any] = []  # tokens of those found still running at their deadline
        self.in_flight: set[int] = set()  # their items: aborted only once the copies completed
        # Copies into the reservations' own buffers (``write_buffers``) a save worker waits for
        # before its write: (token, layer, items); under self.lock. ``finish`` takes any still
        # there when it cancels into ``running``/``in_flight``.
        self.filling: list[tuple[Any, int, list[int]]] = []
        self.n = 0
        self.failed = np.zeros(0, dtype=bool)
        self.done = np.zeros((nl, 0), dtype=bool)
        self.batches: list[list[range]] = []
        # Streaming (limits.stream_publish): layers whose saves ended, and how many leading layers
        # were published; under pub_lock, so a prefix is published in layer order.
        self.pub_lock = threading.Lock()
        self.layer_ended = [False] * nl
        self.published = 0

    # --- caller side ---
    def reserve(self) -> None:
        if not self.all_keys:
            return
        ctx, keys = self.ctx, self.all_keys
        call = ctx.call(ctx.reserve_pool, lambda: ctx.backend.reserve(keys, ctx.layout.nbytes), on_late=self._abort_late)
        if not call.wait(ctx.limits.save_timeout_s):
            ctx.reserve_pool.unstick()  # the next step's reserve gets a fresh thread
            self.failed_early = list(keys)
            self.errors.add(f"backend.reserve of {len(keys)} objects missed its {ctx.limits.save_timeout_s}s deadline")
            return
        if call.error is not None:
            self.failed_early = list(keys)
            self.errors.add(f"backend.reserve: {describe(call.error)}")
            return
        handles = list(call.value)
        if len(handles) != len(keys):
            self.failed_early = list(keys)
            self.errors.add(f"backend.reserve returned {len(handles)} handles for {len(keys)} keys")
            self._abort_late(handles)
            return
        for k, h in zip(keys, handles):
            if h is None:
                self.skipped.append(k)
            else:
                self.keys.append(k)
                self.blocks.append(self.first_block[k])
                self.handles.append(h)
        self.n = len(self.keys)
        nl = ctx.layout.num_layers
        self.failed = np.zeros(self.n, dtype=bool)
        self.done = np.zeros((nl, self.n), dtype=bool)
        self.block_arr = np.asarray(self.blocks, dtype=np.int64)  # per-layer work indexes arrays, not lists
        self.batches = ctx.split(self.n)

    def _abort_late(self, handles: Any) -> None:
        hs = [h for h in handles or () if h is not None]
        if hs:
            self.ctx.backend.abort(hs)

    def submit(self, layer: int, token: Any) -> None:
        if self.submitted[layer] or not self.n:
            return
        self.submitted[layer] = True
        self.ctx.save_pool.submit(lambda: self.run_layer(layer, token))

    def reads_over(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for every submitted layer's copies out of the KV cache (and
        their writes) to end; ``True`` when none runs or will start any more."""
        deadline = time.monotonic() + timeout_s
        return all(self.events[layer].wait(max(0.0, deadline - time.monotonic()))
                   for layer, sub in enumerate(self.submitted) if sub)

    def cancel_reads(self, why: str) -> None:
        """The caller takes the step's KV blocks back: no copy out of them starts after this, and
        only objects every layer of which was written before it may still be committed (by
        ``finish``); a copy running now leaves its objects incomplete, so they are aborted."""
        with self.lock:
            if self.cancelled:
                return  # finish got here first: its commit only takes objects complete before
            self.cancelled = True
            late = int((~self.failed & ~self.done.all(axis=0)).sum()) if self.n else 0
            if late:
                self.errors.add(f"{late} objects not saved: {why}")

    def copies_in_flight(self) -> list[Any]:
        """Tokens of copies out of the KV cache that may still run on a device: enqueued and not
        settled yet, or settled as still running after the deadline."""
        with self.lock:
            return [tok for tok, _, _ in (*self.pending, *self.settling, *self.filling) if tok is not None] + list(self.running)

    def fail_all(self, msg: str) -> None:
        with self.lock:
            self.failed[:] = True
            self.errors.add(msg)

    def finish(self) -> SaveResult:
        ctx = self.ctx
        deadline = time.monotonic() + ctx.limits.save_timeout_s
        for layer, sub in enumerate(self.submitted):
            if sub and not self.events[layer].wait(max(0.0, deadline - time.monotonic())):
                self.misses.append(layer)
        if self.misses:
            ctx.save_pool.unstick()
        with self.lock:
            self.cancelled = True  # nothing more goes into the objects' memory
            for tok, lay, idx in self.filling:  # their workers gave up or will not write: the copies may run on
                self._in_flight_locked(tok, lay, idx)
            self.filling.clear()
        self._settle(deadline)
        with self.lock:
            running, in_flight = list(self.running), set(self.in_flight)
            if self.n:
                for layer, sub in enumerate(self.submitted):
                    if not sub:
                        self.errors.add(f"layer {layer} was never saved (save_layer not called); its objects are aborted")
                for layer in self.misses:
                    late = int((~self.done[layer] & ~self.failed).sum())
                    self.errors.add(f"layer {layer}: save missed its {ctx.limits.save_timeout_s}s deadline ({late} objects)")
            complete = np.flatnonzero(~self.failed & self.done.all(axis=0)) if self.n else np.zeros(0, dtype=np.intp)
        committed = self._commit([int(i) for i in complete])
        to_abort = [self.handles[i] for i in range(self.n)
                    if i not in committed and i not in self.commit_unknown and i not in in_flight]
        if to_abort:
            ctx.background.run(ctx.save_pool, "abort", lambda: ctx.backend.abort(to_abort))
        if in_flight:
            stuck = [self.handles[i] for i in sorted(in_flight)]
            ctx.after_copies("abort", running, ctx.limits.save_timeout_s, lambda: ctx.backend.abort(stuck),
                             f"{len(stuck)} reservations are left to the backend's reservation timeout")
        committed_keys = [self.keys[i] for i in range(self.n) if i in committed]
        failed_keys = [*self.failed_early, *(self.keys[i] for i in range(self.n) if i not in committed)]
        failed_req = list(dict.fromkeys(o for k in failed_keys for o in self.owners_of[k]))
        return SaveResult(
            committed_keys=committed_keys,
            failed_keys=failed_keys,
            skipped_keys=list(self.skipped),
            failed_req_ids=failed_req,
            saved_bytes=len(committed_keys) * ctx.layout.nbytes,
            deadline_misses=list(self.misses),
            errors=self.errors.out(),
        )

    def _settle(self, deadline: float, layer: int | None = None) -> None:
        """Wait (until ``deadline``) for the pending copies into views (of ``layer``, or all) and
        mark their objects' layers done; the items of copies still running are failed and kept in
        ``in_flight``."""
        with self.lock:
            mine = [p for p in self.pending if layer is None or p[1] == layer]
            self.pending = [p for p in self.pending if not (layer is None or p[1] == layer)]
            self.settling.extend(mine)
        for entry in mine:
            tok, lay, idx = entry
            done = self.ctx.copier.wait(tok, max(0.0, deadline - time.monotonic()))
            with self.lock:
                self.settling = [p for p in self.settling if p is not entry]
                if done:
                    self.done[lay, idx] = True
                    continue
                self._in_flight_locked(tok, lay, idx)

    def _in_flight_locked(self, tok: Any, layer: int, idx: list[int]) -> None:
        """A copy into the objects of ``idx`` may still run: they fail, and are aborted only once it
        completed (``finish``). Under self.lock."""
        if tok is not None:
            self.running.append(tok)
        self.in_flight.update(idx)
        self.failed[idx] = True
        self.errors.add(f"layer {layer}: copy out of the KV cache did not finish in {self.ctx.limits.save_timeout_s}s")

    def _commit(self, idx: list[int]) -> set[int]:
        """Commit complete objects; on a batch error retry one by one to find the bad ones."""
        if not idx:
            return set()
        ctx = self.ctx
        backend = ctx.backend

        def commit() -> tuple[set[int], list[str]]:
            try:
                backend.commit([self.handles[i] for i in idx])
                return set(idx), []
            except BackendError as e:
                if len(idx) == 1:
                    return set(), [f"commit of {self.keys[idx[0]]}: {describe(e)}"]
            ok, errs = set(), []
            for i in idx:
                try:
                    backend.commit([self.handles[i]])
                    ok.add(i)
                except BackendError as e:
                    errs.append(f"commit of {self.keys[i]}: {describe(e)}")
            return ok, errs

        call = ctx.call(ctx.save_pool, commit)
        if not call.wait(ctx.limits.save_timeout_s):
            # It may still land (the data is complete, so that is harmless); aborting would race it.
            self.commit_unknown = set(idx)
            self.errors.add(f"backend.commit of {len(idx)} objects missed its {ctx.limits.save_timeout_s}s deadline (state unknown)")
            return set()
        if call.error is not None:
            if not isinstance(call.error, BackendError):
                log.error("commit raised", exc_info=call.error)
            self.errors.add(f"backend.commit: {describe(call.error)}")
            return set()
        ok, errs = call.value
        self.errors.extend(errs)
        return ok

    # --- worker side ---
    def run_layer(self, layer: int, token: Any) -> None:
        try:
            for rng in self.batches[layer]:
                with self.lock:
                    if self.cancelled:
                        return
                    idx = (np.flatnonzero(~self.failed[rng.start : rng.stop]) + rng.start).tolist()
                if idx:
                    self._store_isolating(layer, idx, token)
        except Exception as e:
            log.exception("save of layer %d failed", layer)
            with self.lock:
                bad = np.flatnonzero(~self.done[layer])
                self.failed[bad] = True
                self.errors.add(f"layer {layer}: {describe(e)}")
        finally:
            if self.ctx.limits.stream_publish:  # a published layer must be in the objects
                self._settle(time.monotonic() + self.ctx.limits.save_timeout_s, layer)
                self._publish_ready(layer)
            self.events[layer].set()

    def _publish_ready(self, layer: int) -> None:
        """Streaming: publish the longest run of leading layers whose saves ended, for the objects
        with every layer of it written. Runs before the layer's event is set, so every publish is
        over before ``finish`` commits; a failed publish only costs the reader a recompute."""
        ctx = self.ctx
        with self.pub_lock:
            self.layer_ended[layer] = True
            while self.published < len(self.layer_ended) and self.layer_ended[self.published]:
                top = self.published
                self.published += 1
                with self.lock:
                    if self.cancelled or not self.n:
                        return
                    ok = np.flatnonzero(~self.failed & self.done[: top + 1].all(axis=0))
                if not len(ok):
                    continue
                upto = ctx.layout.offsets[top] + ctx.layout.layer_nbytes[top]
                try:
                    ctx.backend.publish([self.handles[int(i)] for i in ok], upto)  # type: ignore[attr-defined]
                except BackendError as e:
                    self.errors.add(f"layer {top}: publish of {len(ok)} objects: {describe(e)}")

    def _fail(self, idx: list[int], msg: str) -> None:
        with self.lock:
            self.failed[idx] = True
            self.errors.add(msg)

    def _store_isolating(self, layer: int, idx: list[int], token: Any) -> None:
        """Store a batch; if the store refuses it, retry item by item so only the bad objects fail."""
        try:
            self._store(layer, idx, token)
            return
        except BackendError as e:
            if len(idx) == 1:
                self._fail(idx, f"layer {layer}: save of {self.keys[idx[0]]}: {describe(e)}")
                return
        for i in idx:
            try:
                self._store(layer, [i], token)
            except BackendError as e:
                self._fail([i], f"layer {layer}: save of {self.keys[i]}: {describe(e)}")

    def _store(self, layer: int, idx: list[int], token: Any) -> None:
        ctx = self.ctx
        copier, backend = ctx.copier, ctx.backend
        off, n = ctx.layout.offsets[layer], ctx.layout.layer_nbytes[layer]
        if ctx.views.save:
            table = self.table.get(self.ctx, self.handles)
            rows = np.asarray(idx, dtype=np.int64)  # once: numpy indexes with a list slowly
            addrs = ctx.addresses(layer, None if table is not None else [self.handles[i] for i in idx], off, n, table, rows)
            if addrs is not None:  # the copier writes the objects by address
                with self.lock:
                    if self.cancelled:
                        return
                    tok = copier.from_kv_at(layer, self.block_arr[rows], addrs, after=token)  # type: ignore[attr-defined]
                    self.pending.append((tok, layer, idx))  # done once it completes (``_settle``)
                return
        hs = [self.handles[i] for i in idx]
        blocks = [self.blocks[i] for i in idx]
        views = None
        if ctx.views.save:
            views = [backend.view(h, off, n) for h in hs]
            if all(v is None for v in views):
                ctx.views.save = False
            if any(v is None for v in views):
                views = None
        if views is not None:
            with self.lock:
                if self.cancelled:
                    return
                tok = copier.from_kv(layer, blocks, views, after=token)
                if tok is not None:  # done once it completes (``_settle``)
                    self.pending.append((tok, layer, idx))
                    return
            ok = idx
        else:
            buf = None
            srcs: list[Any] | None = copier.kv_views(layer, blocks)  # memoryviews, or staging slices
            if srcs is not None:  # host KV: the store copies straight out of it
                if not copier.wait(token, ctx.limits.save_timeout_s):
                    self._fail(idx, f"layer {layer}: compute did not reach the save point in {ctx.limits.save_timeout_s}s")
                    return
            elif (own := self._write_buffers(hs, off, n)) is not None:  # the reservations' own memory
                srcs = own
                with self.lock:
                    if self.cancelled:
                        return
                    tok = copier.from_kv(layer, blocks, srcs, after=token)
                    entry = (tok, layer, idx)
                    self.filling.append(entry)
                done = copier.wait(tok, ctx.limits.save_timeout_s)
                with self.lock:
                    if not any(e is entry for e in self.filling):
                        return  # finish cancelled the step meanwhile and took the copy over
                    self.filling = [e for e in self.filling if e is not entry]
                    if not done:  # the device may still write into the reservations: aborted once it completed
                        self._in_flight_locked(tok, layer, idx)
                        return
            else:
                buf = ctx.staging.get(len(idx) * n)
                srcs = [buf[j * n : (j + 1) * n] for j in range(len(idx))]
                with self.lock:
                    if self.cancelled:
                        ctx.staging.put(buf)
                        return
                    tok = copier.from_kv(layer, blocks, srcs, after=token)
                if not copier.wait(tok, ctx.limits.save_timeout_s):
                    # the device may still write into buf: drop it rather than reuse it
                    self._fail(idx, f"layer {layer}: copy out of the KV cache did not finish in {ctx.limits.save_timeout_s}s")
                    return
            with self.lock:
                if self.cancelled:
                    ctx.staging.put(buf)
                    return
            try:
                ok = self._write_isolating(layer, idx, hs, off, srcs)
            finally:
                ctx.staging.put(buf)
        with self.lock:
            if not self.cancelled:  # a copy that ended after the cancel may hold the next owner's KV
                self.done[layer, ok] = True

    def _write_buffers(self, hs: list[Any], off: int, n: int) -> list[Any] | None:
        """``backend.write_buffers`` of one layer of ``hs`` (the reservations' own memory, which
        ``write`` then sends with no copy), or None where the backend has none."""
        fn = getattr(self.ctx.backend, "write_buffers", None)
        if fn is None:
            return None
        out: list[Any] | None = fn(hs, [off] * len(hs), n)
        if out is not None and len(out) != len(hs):
            raise BackendError(f"write_buffers answered {len(out)} buffers for {len(hs)} objects")
        return out

    def _write_isolating(self, layer: int, idx: list[int], hs: list[Any], off: int, srcs: list[Any]) -> list[int]:
        backend = self.ctx.backend
        try:
            backend.write(hs, [off] * len(hs), srcs)
            return idx
        except BackendError as e:
            if len(idx) == 1:
                self._fail(idx, f"layer {layer}: write of {self.keys[idx[0]]}: {describe(e)}")
                return []
        ok = []
        for j, i in enumerate(idx):
            with self.lock:
                if self.cancelled:  # srcs may be the KV cache itself: no read of it after a cancel
                    break
            try:
                backend.write([hs[j]], [off], [srcs[j]])
                ok.append(i)
            except BackendError as e:
                self._fail([i], f"layer {layer}: write of {self.keys[i]}: {describe(e)}")
        return ok
