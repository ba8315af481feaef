"""The layer pipeline (docs/design/architecture.md §4): per step, load pool objects into KV blocks layer by layer
ahead of the forward pass, and save KV blocks into pool objects layer by layer behind it.

The vLLM connector drives it from the forward thread::

    pipe.start_load(plan.loads)          # start_load_kv
    for each attention layer L:
        pipe.wait_layer(L)               # wait_for_layer_load
        ... attention ...
        pipe.save_layer(L)               # save_kv_layer
    load = pipe.finish_load()            # failed blocks -> kv_load_failure_policy
    save = pipe.finish_save()            # wait_for_save: commit complete objects
    # or pipe.finish_save_in_background(tag), then later pipe.take_background_saves()
    # (pipe.stop_background_reads(holds, timeout_s) before blocks such a save reads are reused)

Nothing here raises for pool failures or blocks past a deadline: errors, stuck stores and missed
deadlines come back in ``LoadResult`` / ``SaveResult``. Programming errors (a layer out of range,
a step started twice) raise ``ValueError`` / ``RuntimeError``. Work runs on two small fixed pools
of daemon threads (loads, saves); see ``lw_core.pipeline.load`` for the rule that keeps late transfers out
of the KV cache.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from lw_core.backend import Backend
from lw_core.pipeline.context import LIMIT_NOTES, PipelineLimits, StepContext
from lw_core.pipeline.copier import Copier
from lw_core.pipeline.load import LoadStep
from lw_core.pipeline.pool import StagingPool, WorkerPool, describe, log
from lw_core.pipeline.results import LoadResult, SaveResult
from lw_core.pipeline.save import SaveStep
from lw_core.pipeline.save_finisher import SaveFinisher
from lw_core.plan import ObjectLayout, ReqLoad, ReqSave
from lw_core.validation import convert_strict

__all__ = ["LayerPipeline", "LoadResult", "SaveResult"]


class LayerPipeline:
    def __init__(
        self,
        backend: Backend[Any],
        copier: Copier,
        layout: ObjectLayout,
        *,
        layerwise: bool = True,
        sleep: Callable[[float], None] = time.sleep,
        **limits: Any,
    ):
        """``limits``: the fields of ``PipelineLimits`` (prefetch_depth, max_transfer_blocks,
        max_transfer_bytes, h2d_stagger_us, tp_rank, tp_size, layer_timeout_s, save_timeout_s,
        load_threads, save_threads, max_stuck_threads), checked once against the same field types
        as the config keys they come from. ``sleep``: the stagger's clock (tests record it)."""
        lim = convert_strict(limits, PipelineLimits, prefix="LayerPipeline: ", notes=LIMIT_NOTES)
        if lim.tp_rank >= lim.tp_size:
            raise ValueError(f"LayerPipeline: tp_rank={lim.tp_rank} must be < tp_size={lim.tp_size}")
        for layer, n in enumerate(layout.layer_nbytes):
            got = copier.block_nbytes(layer)
            if got != n:
                raise ValueError(
                    f"LayerPipeline: layout.layer_nbytes[{layer}]={n} but the KV cache's block of layer "
                    f"{layer} has {got} bytes; the object layout must match the KV cache"
                )
        self.layerwise = bool(layerwise)  # the connector switches it for one step (bulk loads)
        self.ctx = StepContext(
            backend=backend,
            copier=copier,
            layout=layout,
            limits=lim,
            load_pool=WorkerPool("lw-load", lim.load_threads, lim.max_stuck_threads),
            save_pool=WorkerPool("lw-save", lim.save_threads, lim.max_stuck_threads),
            reserve_pool=WorkerPool("lw-reserve", 1, lim.max_stuck_threads),
            staging=StagingPool(copier.wait, alloc=getattr(copier, "host_buffer", None)),
            sleep=sleep,
        )
        self._regions_epoch: Any = None  # the backend's host_regions_epoch() when last registered
        self._registering: threading.Thread | None = None
        self._register_host()
        self._load: LoadStep | None = None
        self._save: SaveStep | None = None
        self._finisher = SaveFinisher()
        self._closed = False

    def _register_host(self) -> None:
        """Hand the backend's host memory to a copier that registers it with its device."""
        regions = getattr(self.ctx.backend, "host_regions", None)
        register = getattr(self.ctx.copier, "register_host", None)
        if regions is None or register is None:
            return
        self._regions_epoch = self._host_epoch()
        try:
            register(regions())
        except Exception:
            log.exception("registering the pool's host memory with the device failed; copies go through staging")

    def _host_epoch(self) -> Any:
        epoch = getattr(self.ctx.backend, "host_regions_epoch", None)
        try:
            return None if epoch is None else epoch()
        except Exception:
            log.exception("backend.host_regions_epoch failed")
            return self._regions_epoch

    def _follow_host_regions(self) -> None:
        """As each step starts: when the backend's host memory has moved since it was registered
        (``host_regions_epoch``: the embedded pool re-attached to a pool made anew at its path),
        register the new memory on a thread of its own (pinning a large arena takes seconds; the
        step does not wait). Until it is registered, copies from the new memory are staged; the
        copier lets the old memory go once no copy of it is left."""
        if self._regions_epoch is None:
            return  # nothing registered, or a backend whose host memory never moves
        t = self._registering
        if t is not None and t.is_alive():
            return  # the next step looks again
        epoch = self._host_epoch()
        if epoch == self._regions_epoch:
            return
        self._regions_epoch = epoch
        log.info("the pool's host memory moved (backend epoch %s): registering it with the device again", epoch)
        self._registering = threading.Thread(target=self._register_host, name="lw-register-host", daemon=True)
        self._registering.start()

    @property
    def backend(self) -> Backend[Any]:
        return self.ctx.backend

    @property
    def copier(self) -> Copier:
        return self.ctx.copier

    @property
    def layout(self) -> ObjectLayout:
        return self.ctx.layout

    @property
    def limits(self) -> PipelineLimits:
        return self.ctx.limits

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"LayerPipeline.{what}: the pipeline is closed")

    def _check_layer(self, what: str, layer: Any) -> None:
        nl = self.layout.num_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < nl:
            raise ValueError(f"LayerPipeline.{what}: layer={layer!r} out of range; accepted 0..{nl - 1}")

    # --- loads ---
    def start_load(self, loads: Sequence[ReqLoad]) -> None:
        """Lease every object once and plan per-layer batches; layerwise: prefetch the first
        ``prefetch_depth`` layers; bulk: load every layer now (each wait bounded)."""
        self._check_open("start_load")
        if self._load is not None:
            raise RuntimeError("LayerPipeline.start_load: the previous step's loads were not finished (call finish_load)")
        self._follow_host_regions()
        step = LoadStep(self.ctx, loads)
        if not step.n:
            return
        self._load = step
        begin = getattr(self.copier, "begin_load", None)  # device: order loads after compute so far
        if begin is not None:
            try:
                begin()
            except Exception as e:
                log.exception("copier.begin_load failed")
                step._fail(range(step.n), f"copier.begin_load: {describe(e)}")
                return
        step.open()
        if self.layerwise:
            step.submit_upto(self.limits.prefetch_depth - 1)
        else:
            step.submit_upto(self.layout.num_layers - 1)
            for layer in range(self.layout.num_layers):
                step.wait(layer, self.limits.layer_timeout_s)

    def wait_layer(self, layer: int) -> None:
        """Layerwise: submit layers ``layer..layer+depth-1`` and wait for ``layer`` (deadline
        ``layer_timeout_s``); failures and misses become load errors. No-op when nothing loads."""
        self._check_open("wait_layer")
        self._check_layer("wait_layer", layer)
        step = self._load
        if step is None or not self.layerwise or step.waited[layer]:
            return
        step.submit_upto(layer + self.limits.prefetch_depth - 1)
        step.wait(layer, self.limits.layer_timeout_s)

    def finish_load(self) -> LoadResult:
        """End the step's loads: nothing lands in the KV after this; leases are released."""
        step, self._load = self._load, None
        if step is None:
            return LoadResult(layer_wait_s=[0.0] * self.layout.num_layers, errors=self.ctx.background.take())
        res = step.finish(self.layerwise)
        res.errors += self.ctx.background.take()
        return res

    # --- saves ---
    def start_save(self, saves: Sequence[ReqSave]) -> None:
        """Reserve the step's objects (existing ones are skipped)."""
        self._check_open("start_save")
        if self._save is not None:
            raise RuntimeError("LayerPipeline.start_save: the previous step's saves were not finished (call finish_save)")
        self._follow_host_regions()
        step = SaveStep(self.ctx, saves)
        self._save = step
        step.reserve()

    def save_layer(self, layer: int) -> None:
        """Queue the copy of ``layer``'s blocks into the reserved objects; returns at once."""
        self._check_open("save_layer")
        self._check_layer("save_layer", layer)
        step = self._save
        if step is None or not step.n or not self.layerwise:
            return
        self._submit_save(step, layer)

    def _submit_save(self, step: SaveStep, layer: int) -> None:
        if step.submitted[layer]:
            return
        try:
            token = self.copier.compute_event()
        except Exception as e:
            log.exception("compute_event failed")
            step.submitted[layer] = True
            step.events[layer].set()
            step.fail_all(f"layer {layer}: compute_event: {describe(e)}")
            return
        step.submit(layer, token)

    def finish_save(self) -> SaveResult:
        """Wait (deadline ``save_timeout_s``) for every layer, commit complete objects, abort the
        rest. Bulk mode copies every layer here."""
        step, self._save = self._save, None
        if step is None:
            return SaveResult(errors=self.ctx.background.take())
        if not self.layerwise and step.n:
            for layer in range(self.layout.num_layers):
                self._submit_save(step, layer)
        res = step.finish()
        res.errors += self.ctx.background.take()
        return res

    def finish_save_in_background(self, tag: Any) -> None:
        """Like ``finish_save``, but the wait and the commit run on a background thread; the
        result comes back with ``tag`` from ``take_background_saves``. The caller must leave the
        step's KV blocks alone until then. Bulk mode queues every layer's copy here."""
        step, self._save = self._save, None
        if step is None:
            return
        if not self.layerwise and step.n:
            for layer in range(self.layout.num_layers):
                self._submit_save(step, layer)
        self._finisher.submit(step, tag)

    def take_background_saves(self) -> list[tuple[SaveResult, Any]]:
        """Results of the background saves finished since the last call, with their tags."""
        return self._finisher.take()

    def pending_background_saves(self) -> list[Any]:
        """Tags of the background saves not finished yet."""
        return self._finisher.pending_tags()

    def stop_background_reads(self, holds: Callable[[Any], bool], timeout_s: float) -> int:
        """The caller takes back KV blocks that background saves may still read: the saves whose
        tag ``holds`` (e.g. those of a preempted request). Waits at most ``timeout_s`` for their
        copies out of the KV cache to end (not for their commits, nor for other saves); those still
        running then are cancelled: no copy out of the KV cache starts any more, objects written
        whole before are still committed, the others are aborted (an error in their result).
        Returns how many saves were cancelled. Either way, nothing read from those blocks after
        this returns is ever committed."""
        steps = [step for step, tag in self._finisher.pending() if holds(tag)]
        deadline = time.monotonic() + timeout_s
        late = [step for step in steps if not step.reads_over(deadline - time.monotonic())]
        for step in late:
            step.cancel_reads(f"their KV blocks were taken back while the save still ran (after {timeout_s}s)")
        # A device copy enqueued before this (its worker is done, the copy may not be) can still
        # read the blocks: the caller's stream -- the compute stream, this runs on the forward
        # thread -- waits for it before it reuses them, so the copy reads the old owner's bytes.
        for step in steps:
            for tok in step.copies_in_flight():
                self.copier.make_visible(tok)
        return len(late)

    def wait_background_saves(self, timeout_s: float) -> bool:
        """Block until every background save finished (``True``) or ``timeout_s`` passed."""
        return self._finisher.wait_idle(timeout_s)

    # --- lifecycle ---
    def close(self, timeout_s: float = 2.0) -> None:
        """Finish open steps (no late copies; leases released, reservations aborted) and stop the
        threads. Idempotent. Threads stuck in a backend call are daemons and are left behind."""
        if self._closed:
            return
        load, self._load = self._load, None
        save, self._save = self._save, None
        # Background saves end first: they hold their own deadlines (save_timeout_s per wait).
        if not self._finisher.close(max(timeout_s, 3 * self.limits.save_timeout_s)):
            log.warning("close: background saves still running after the deadline; their objects stay uncommitted")
        for finish in (lambda: load and load.finish(self.layerwise), lambda: save and save.finish()):
            try:
                res = finish()
                if res and res.errors:
                    log.warning("close: %s", "; ".join(res.errors))
            except Exception:
                log.exception("close: finishing an open step failed")
        self._closed = True
        stuck = (self.ctx.load_pool.close(timeout_s) + self.ctx.save_pool.close(timeout_s)
                 + self.ctx.reserve_pool.close(timeout_s))
        if stuck:
            log.warning("close: %d worker threads are stuck in backend calls: %s", len(stuck), [t.name for t in stuck])

    def threads(self) -> list[threading.Thread]:
        """Live worker threads (for tests and metrics)."""
        pools = (self.ctx.load_pool, self.ctx.save_pool, self.ctx.reserve_pool)
        return [t for p in pools for t in p.threads() if t.is_alive()]

    def __enter__(self) -> LayerPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
