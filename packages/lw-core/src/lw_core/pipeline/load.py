"""One step's loads: pool objects -> KV blocks, layer by layer, on the load workers.

Safety rule (the reason for most of this file): once a layer's wait has given up, or the step has
finished, no byte may land in the KV cache, because vLLM may already have handed those blocks to
another request. Every copy into the KV therefore happens under ``self.lock`` right after checking
the cancel flags, and the caller sets those flags under the same lock. Backend calls that can stall
(``open``, ``read``) never target KV memory: ``read`` fills a staging buffer (``read_lent`` memory
the backend lends), and only the bounded host->KV copy runs under the lock. A backend ``view`` is host memory already (a memcpy from it
cannot stall), so the zero-copy path hands the view straight to ``copier.to_kv`` under the lock.
Reading straight into ``copier.kv_views()`` would save one copy on a CPU KV cache, but a read that
returns after its deadline would then write into blocks vLLM has reused, so it is not done.

Copies from views may run on after ``to_kv`` returns (a device copier reading registered pool
memory itself): a view's bytes are the object's only while its lease holds, so ``finish`` waits
(bounded by ``layer_timeout_s``) for those copies before asking the backend whether the objects
stayed ``intact``, fails the items whose copy is still running then, and the step's leases are
released only once every such copy has completed (``StepContext.release_after``).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from lw_core.backend import BackendError, Lent
from lw_core.pipeline.context import LazyAddressTable, StepContext
from lw_core.pipeline.pool import ErrorLog, describe, log
from lw_core.pipeline.results import LoadResult
from lw_core.plan import ReqLoad, flatten, stagger_delay_us
from lw_core.tp_split import HeadSplit


class At:
    """A batch's sources given by host addresses (``StepContext.addresses``), not buffers."""

    __slots__ = ("addrs",)

    def __init__(self, addrs: Any):
        self.addrs = addrs

    def __len__(self) -> int:
        return len(self.addrs)


class LoadStep:
    def __init__(self, ctx: StepContext, loads: Sequence[ReqLoad]):
        self.ctx = ctx
        keys, blocks, owners = flatten(loads)
        if len(set(blocks)) != len(blocks):
            dup = sorted({b for b in blocks if blocks.count(b) > 1})
            raise ValueError(f"start_load: block ids {dup[:8]} appear more than once in the step's loads")
        nl = ctx.layout.num_layers
        self.keys, self.blocks, self.owners = keys, blocks, owners
        # Items saved at another TP size: their head split and every source object's key.
        self.splits: list[HeadSplit | None] = [r.split for r in loads for _ in r.keys]
        self.any_split = any(sp is not None for sp in self.splits)
        self.block_arr = np.asarray(blocks, dtype=np.int64)  # per-layer work indexes arrays, not lists
        # Every object block i reads from (one, ``keys[i]``, unless saved at another TP size).
        self.sources: list[list[str]] = [src for r in loads for src in (
            [r.sources(i) for i in range(len(r.keys))] if r.more_keys else [[k] for k in r.keys])]
        self.n = len(keys)
        self.lock = threading.Lock()
        self.cancelled = False
        self.failed = np.zeros(self.n, dtype=bool)
        self.done = np.zeros((nl, self.n), dtype=bool)
        self.events = [threading.Event() for _ in range(nl)]
        self.layer_cancelled = [False] * nl
        self.tokens: list[list[Any]] = [[] for _ in range(nl)]
        self.next_submit = 0
        self.waited = [False] * nl
        self.wait_s = [0.0] * nl
        self.misses: list[int] = []
        self.errors = ErrorLog()
        self.item_handle: list[Any] = [None] * self.n
        self.table = LazyAddressTable()  # the backend's address table of the handles
        self.item_sources: dict[int, list[Any]] = {}  # split items: the handles of their sources
        self.viewed = np.zeros(self.n, dtype=bool)  # items copied into the KV straight from a view()
        self.view_copies: list[tuple[Any, list[int]]] = []  # (token, items) of every copy from views
        self.handles: list[Any] = []
        self.batches = ctx.split(self.n)  # per layer, computed once per step

    # --- caller side ---
    def open(self) -> None:
        """Lease every distinct object once; items whose object is missing fail now."""
        if not self.n:
            return
        ctx = self.ctx
        uniq = list(dict.fromkeys(k for src in self.sources for k in src) if self.any_split else dict.fromkeys(self.keys))
        call = ctx.call(ctx.load_pool, lambda: ctx.backend.open(uniq), on_late=self._release_late)
        if not call.wait(ctx.limits.layer_timeout_s):
            self._fail(range(self.n), f"backend.open of {len(uniq)} objects missed its {ctx.limits.layer_timeout_s}s deadline")
            return
        if call.error is not None:
            self._fail(range(self.n), f"backend.open: {describe(call.error)}")
            return
        handles = list(call.value)
        if len(handles) != len(uniq):
            self._fail(range(self.n), f"backend.open returned {len(handles)} handles for {len(uniq)} keys")
            self._release_late([h for h in handles if h is not None])
            return
        by_key = dict(zip(uniq, handles))
        self.handles = [h for h in handles if h is not None]
        self.item_handle = [by_key[k] for k in self.keys]  # keys[i] is the first source of item i
        missing = [i for i, h in enumerate(self.item_handle) if h is None]
        if self.any_split:
            for i, src in enumerate(self.sources):
                if self.splits[i] is not None:
                    self.item_sources[i] = [by_key[k] for k in src]
            more = {i for i, hs in self.item_sources.items() if any(h is None for h in hs)}
            missing = sorted(more.union(missing))
        if missing:
            gone = next(k for k in self.sources[missing[0]] if by_key[k] is None)
            self._fail(missing, f"{len(missing)} objects to load are missing from the pool (e.g. {gone})")

    def _release_late(self, handles: Any) -> None:
        hs = [h for h in handles or () if h is not None]
        if hs:
            self.ctx.backend.release(hs)

    def submit_upto(self, last: int) -> None:
        last = min(last, len(self.events) - 1)
        while self.next_submit <= last:
            layer = self.next_submit
            self.next_submit += 1
            self.ctx.load_pool.submit(functools.partial(self.run_layer, layer))

    def wait(self, layer: int, timeout_s: float) -> None:
        """Wait for ``layer`` (submitting it if needed); on timeout cancel it and fail its blocks."""
        self.submit_upto(layer)
        t0 = time.perf_counter()
        with self.lock:
            needed = not self.failed.all()
        if needed and not self.events[layer].wait(timeout_s):
            self._miss(layer, timeout_s)
        self.wait_s[layer] = time.perf_counter() - t0
        self.waited[layer] = True
        with self.lock:
            tokens = list(self.tokens[layer])
        for tok in tokens:
            try:
                self.ctx.copier.make_visible(tok)
            except Exception as e:
                log.exception("make_visible failed")
                with self.lock:
                    self._fail_locked(np.flatnonzero(self.done[layer]), f"layer {layer}: make_visible: {describe(e)}")

    def _miss(self, layer: int, timeout_s: float) -> None:
        with self.lock:
            if self.events[layer].is_set():  # finished while we took the lock: keep the data
                return
            self.layer_cancelled[layer] = True
            late = np.flatnonzero(~self.done[layer] & ~self.failed)
            self._fail_locked(late, f"layer {layer}: load missed its {timeout_s}s deadline ({len(late)} blocks)")
            self.misses.append(layer)
        self.ctx.load_pool.unstick()

    def finish(self, layerwise: bool) -> LoadResult:
        with self.lock:
            self.cancelled = True  # from here on nothing may touch the KV cache
            if layerwise:
                for layer, w in enumerate(self.waited):
                    if not w:
                        todo = np.flatnonzero(~self.failed)
                        if len(todo):
                            self._fail_locked(todo, f"layer {layer} was never waited for (wait_layer not called); its blocks are not loaded")
            # Copies already enqueued for layers nobody waited for: order them before whatever the
            # compute stream does next with these blocks (a waited layer's were, in ``wait``).
            unfenced = [t for layer, w in enumerate(self.waited) if not w for t in self.tokens[layer] if t is not None]
            view_copies = list(self.view_copies)
        for tok in unfenced:
            try:
                self.ctx.copier.make_visible(tok)
            except Exception:
                log.exception("make_visible of an unwaited layer's copy failed")
        running = self._settle_view_copies(view_copies)
        with self.lock:
            self._fail_stale_views_locked()
            incomplete = np.flatnonzero(~self.failed & ~self.done.all(axis=0))
            if len(incomplete):
                self._fail_locked(incomplete, f"{len(incomplete)} blocks did not get every layer")
            failed = np.flatnonzero(self.failed)
        if self.handles:
            if running:
                self.ctx.release_after(self.handles, running, self.ctx.limits.layer_timeout_s)
            else:
                self.ctx.release_later(self.ctx.load_pool, self.handles)
        ok = self.n - len(failed)
        return LoadResult(
            failed_block_ids=[self.blocks[i] for i in failed],
            failed_req_ids=list(dict.fromkeys(self.owners[i] for i in failed)),
            loaded_objects=ok,
            loaded_bytes=ok * self.ctx.layout.nbytes,
            layer_wait_s=list(self.wait_s),
            deadline_misses=list(self.misses),
            errors=self.errors.out(),
        )

    def _settle_view_copies(self, copies: list[tuple[Any, list[int]]]) -> list[Any]:
        """Copies from views that may still read the pool: where the backend can say whether a view
        stayed ``intact``, wait for them (bounded by ``layer_timeout_s``) so the check covers every
        byte they read, and fail the items of those still running. Returns the tokens of the copies
        not known complete (the leases wait for them)."""
        copier, limit = self.ctx.copier, self.ctx.limits.layer_timeout_s
        bounded = getattr(self.ctx.backend, "intact", None) is not None
        deadline = time.monotonic() + limit
        running: list[Any] = []
        late: list[int] = []
        for tok, idx in copies:
            if tok is None:
                continue
            if not copier.wait(tok, max(0.0, deadline - time.monotonic()) if bounded else 0.0):
                running.append(tok)
                late += idx if bounded else []
        if late:
            self._fail(late, f"{len(late)} blocks: their copy out of the pool was still running {limit}s after "
                             "the step ended, so their bytes cannot be checked; they are recomputed")
        return running

    def _fail_stale_views_locked(self) -> None:
        """Fail items whose bytes came through ``view()`` from an object that was evicted or reused
        meanwhile (a reader stalled past its lease): those KV blocks may hold another object's bytes,
        so vLLM must recompute them. Runs after ``cancelled`` is set and after the copies of the
        items still checked here have completed, so none of them is in flight."""
        intact = getattr(self.ctx.backend, "intact", None)
        idx = np.flatnonzero(self.viewed & ~self.failed)  # their copies have completed (``_settle_view_copies``)
        if intact is None or not len(idx):
            return
        table = self.table.built()  # rows are items: the check on arrays, when the backend has it
        by_table = getattr(self.ctx.backend, "table_intact", None) if table is not None else None
        try:
            ok = np.asarray(by_table(table, idx) if by_table is not None else intact([self.item_handle[i] for i in idx]), dtype=bool)
        except Exception as e:
            ok = np.zeros(len(idx), dtype=bool)
            log.exception("backend.intact failed")
            self.errors.add(f"backend.intact: {describe(e)}")
        bad = idx[~ok].tolist()
        if bad:
            self._fail_locked(bad, f"{len(bad)} objects were evicted or reused while their view was being copied "
                                   f"(a reader ran past its lease, e.g. {self.keys[bad[0]]}); their blocks are recomputed")

    def _fail(self, idx: Any, msg: str) -> None:
        with self.lock:
            self._fail_locked(idx, msg)

    def _fail_locked(self, idx: Any, msg: str) -> None:
        idx = np.asarray(list(idx) if isinstance(idx, range) else idx, dtype=np.intp)
        if len(idx):
            self.failed[idx] = True
        self.errors.add(msg)

    # --- worker side ---
    def run_layer(self, layer: int) -> None:
        try:
            with self.lock:
                if self.cancelled or self.layer_cancelled[layer]:
                    return
            self._copy_layer(layer)
        except Exception as e:  # never lose a worker's error: it fails the layer's blocks
            log.exception("load of layer %d failed", layer)
            with self.lock:
                self._fail_locked(np.flatnonzero(~self.done[layer]), f"layer {layer}: {describe(e)}")
        finally:
            self.events[layer].set()

    def _copy_layer(self, layer: int) -> None:
        ctx = self.ctx
        staggered = False
        for rng in self.batches[layer]:
            with self.lock:
                if self.cancelled or self.layer_cancelled[layer]:
                    return
                live = np.flatnonzero(~self.failed[rng.start : rng.stop])
            if not len(live):
                continue
            rows = live + rng.start
            idx, srcs, bufs = self._fetch_isolating(layer, rows.tolist(), rows)
            if not idx:
                continue
            if len(idx) != len(rows):  # items the store refused were dropped (the order stays)
                rows = np.asarray(idx, dtype=np.int64)
            if not staggered:
                staggered = True
                delay = stagger_delay_us(ctx.limits.h2d_stagger_us, ctx.limits.tp_rank, ctx.limits.tp_size, layer)
                if delay:
                    ctx.sleep(delay / 1e6)
            token = None
            try:
                with self.lock:
                    if self.cancelled or self.layer_cancelled[layer]:
                        return  # too late: the data must not reach the KV
                    try:
                        if isinstance(srcs, At):
                            token = ctx.copier.to_kv_at(layer, self.block_arr[rows], srcs.addrs)  # type: ignore[attr-defined]
                        else:
                            token = ctx.copier.to_kv(layer, [self.blocks[i] for i in idx], srcs)
                    except Exception as e:
                        log.exception("to_kv of layer %d failed", layer)
                        self._fail_locked(idx, f"layer {layer}: copy into the KV cache: {describe(e)}")
                        continue
                    self.done[layer, rows] = True
                    if not bufs:
                        self.viewed[rows] = True
                        self.view_copies.append((token, idx))
                    self.tokens[layer].append(token)
            finally:
                for b in bufs:
                    ctx.staging.put(b, token)

    def _fetch(self, layer: int, idx: list[int], by_address: bool = True, rows: np.ndarray | None = None) -> tuple[Any, list[Any]]:
        """Host sources of one batch: the views' addresses when the copier moves them by address,
        zero-copy views when the backend has them, else a read into memory the backend lends
        (``read_lent``) or into staging. ``rows``: ``idx`` as an array, when the caller has it."""
        ctx = self.ctx
        off, n = ctx.layout.offsets[layer], ctx.layout.layer_nbytes[layer]
        if self.any_split and any(self.splits[i] is not None for i in idx):
            return self._fetch_split(layer, idx)
        if ctx.views.load and by_address:
            table = self.table.get(self.ctx, self.item_handle)
            hs = None if table is not None else [self.item_handle[i] for i in idx]
            addrs = ctx.addresses(layer, hs, off, n, table, idx if rows is None else rows)
            if addrs is not None:
                return At(addrs), []
        hs = [self.item_handle[i] for i in idx]
        if ctx.views.load:
            views = [ctx.backend.view(h, off, n) for h in hs]
            if all(v is not None for v in views):
                return views, []
            if all(v is None for v in views):
                ctx.views.load = False  # not host-addressable: stop asking
        lent = self._read_lent(hs, off, n)
        if lent is not None:
            return list(lent.views), [lent]
        buf = ctx.staging.get(len(idx) * n)
        dsts = [buf[j * n : (j + 1) * n] for j in range(len(idx))]
        try:
            ctx.backend.read(hs, [off] * len(hs), dsts)
        except BaseException:
            ctx.staging.put(buf)
            raise
        return dsts, [buf]

    def _read_lent(self, hs: list[Any], off: int, n: int) -> Lent | None:
        """``backend.read_lent`` of one layer of ``hs`` (memory the store lends: no staging), or None
        where the backend has none to lend. Lent memory whose copies are done goes back first."""
        ctx = self.ctx
        read_lent = getattr(ctx.backend, "read_lent", None)
        if read_lent is None:
            return None
        ctx.staging.reclaim()
        lent: Lent | None = read_lent(hs, [off] * len(hs), n)
        if lent is not None and len(lent.views) != len(hs):
            lent.give_back()
            raise BackendError(f"read_lent answered {len(lent.views)} views for {len(hs)} objects")
        return lent

    def _fetch_split(self, layer: int, idx: list[int]) -> tuple[list[Any], list[np.ndarray]]:
        """A staging read of a batch with items saved at another TP size: each such block's layer
        is put together from ranged reads of its source objects (one ``read`` call for the batch)."""
        ctx = self.ctx
        off, n = ctx.layout.offsets[layer], ctx.layout.layer_nbytes[layer]
        buf = ctx.staging.get(len(idx) * n)
        dsts = [buf[j * n : (j + 1) * n] for j in range(len(idx))]
        hs: list[Any] = []
        offs: list[int] = []
        parts: list[Any] = []
        for j, i in enumerate(idx):
            split = self.splits[i]
            if split is None:
                hs.append(self.item_handle[i])
                offs.append(off)
                parts.append(dsts[j])
                continue
            for src, src_off, dst_off, nbytes in split.layer_reads(n, off):
                hs.append(self.item_sources[i][src])
                offs.append(src_off)
                parts.append(dsts[j][dst_off : dst_off + nbytes])
        try:
            ctx.backend.read(hs, offs, parts)
        except BaseException:
            ctx.staging.put(buf)
            raise
        return dsts, [buf]

    def _fetch_isolating(self, layer: int, idx: list[int], rows: np.ndarray | None = None) -> tuple[list[int], Any, list[np.ndarray]]:
        """Fetch a batch; if the store refuses it, retry item by item so only the bad objects fail."""
        try:
            srcs, bufs = self._fetch(layer, idx, rows=rows)
            return idx, srcs, bufs
        except BackendError as e:
            if len(idx) == 1:
                self._fail(idx, f"layer {layer}: read of {self.keys[idx[0]]}: {describe(e)}")
                return [], [], []
        ok, srcs, bufs = [], [], []
        for i in idx:
            try:
                s, b = self._fetch(layer, [i], by_address=False)
            except BackendError as e:
                self._fail([i], f"layer {layer}: read of {self.keys[i]}: {describe(e)}")
                continue
            ok.append(i)
            srcs += s
            bufs += b
        return ok, srcs, bufs
