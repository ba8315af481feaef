"""What a pipeline step works with: ``StepContext``, built once per ``LayerPipeline`` and never
changed, plus the two small things steps do change, each with one owner: ``ViewFlags`` (whether
the backend answers ``view()``) and ``BackgroundErrors`` (fire-and-forget release/abort whose
failures show up in the next step's result). Steps get the context, never the pipeline."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from lw_core.backend import Backend, BackendError
from lw_core.config import PrefetchLayers, Seconds, StaggerUs, TransferBlocks, TransferBytes
from lw_core.pipeline.copier import Copier
from lw_core.pipeline.pool import DeadlineCall, ErrorLog, StagingPool, WorkerPool, describe, log
from lw_core.plan import ObjectLayout, split_batches


class PipelineLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``LayerPipeline``'s numeric arguments, checked once by msgspec with the same field types as
    the config keys they come from (``lw_core.config``)."""

    prefetch_depth: PrefetchLayers = 1
    max_transfer_blocks: TransferBlocks = 0
    max_transfer_bytes: TransferBytes = 0
    h2d_stagger_us: StaggerUs = 0
    tp_rank: Annotated[int, Meta(ge=0)] = 0
    tp_size: Annotated[int, Meta(ge=1)] = 1
    layer_timeout_s: Seconds = 5.0
    save_timeout_s: Seconds = 10.0
    load_threads: Annotated[int, Meta(ge=1)] = 1
    save_threads: Annotated[int, Meta(ge=1)] = 1
    max_stuck_threads: Annotated[int, Meta(ge=0)] = 4
    # Streaming PD: publish each layer's prefix of a step's reservations once it is written
    # (the backend must offer the streaming extension).
    stream_publish: bool = False


LIMIT_NOTES = {
    "prefetch_depth": "typical: 1-4",
    "max_transfer_blocks": "0 = unlimited",
    "max_transfer_bytes": "0 = unlimited",
    "h2d_stagger_us": "0 = off",
}


class ViewFlags:
    """Whether zero-copy ``view()`` is still worth asking for; a step turns a direction off the
    first time the backend answers ``None`` for a whole batch (not host-addressable)."""

    __slots__ = ("load", "save")

    def __init__(self) -> None:
        self.load = True
        self.save = True


class _Inline:
    """A ``WorkerPool`` stand-in that runs the job at once, in the calling thread."""

    def submit(self, job: Callable[[], None]) -> None:
        job()


_INLINE: Any = _Inline()


class BackgroundErrors:
    """Runs fire-and-forget backend calls (release, abort) and keeps their failures for the next
    step's result."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._log = ErrorLog()

    def run(self, pool: WorkerPool, what: str, fn: Callable[[], None]) -> None:
        def job() -> None:
            try:
                fn()
            except Exception as e:
                if not isinstance(e, BackendError):
                    log.exception("background %s failed", what)
                with self._lock:
                    self._log.add(f"backend.{what} (previous step): {describe(e)}")

        pool.submit(job)

    def note(self, msg: str) -> None:
        with self._lock:
            self._log.add(msg)

    def take(self) -> list[str]:
        with self._lock:
            out, self._log = self._log.out(), ErrorLog()
        return out


_NOT_BUILT = object()


class LazyAddressTable:
    """A step's address table (``StepContext.address_table``), built by the first batch that asks
    (on a worker, off the forward thread); two workers building it at once build the same table."""

    __slots__ = ("_table",)

    def __init__(self) -> None:
        self._table: Any = _NOT_BUILT

    def get(self, ctx: StepContext, handles: list[Any]) -> Any:
        if self._table is _NOT_BUILT:
            self._table = ctx.address_table(handles)
        return self._table

    def built(self) -> Any:
        """The table when a batch has built it, else None."""
        t = self._table
        return None if t is _NOT_BUILT else t


@dataclass(frozen=True)
class StepContext:
    backend: Backend[Any]  # the pipeline never looks inside a handle
    copier: Copier
    layout: ObjectLayout
    limits: PipelineLimits
    load_pool: WorkerPool
    save_pool: WorkerPool
    # Reservations run apart from the save workers: a step's reserve (on the forward thread's path)
    # must not queue behind earlier steps' writes still running in the background.
    reserve_pool: WorkerPool
    staging: StagingPool
    sleep: Callable[[float], None]  # the stagger's clock (tests record it)
    views: ViewFlags = field(default_factory=ViewFlags)
    background: BackgroundErrors = field(default_factory=BackgroundErrors)

    def split(self, n_items: int) -> list[list[range]]:
        """Per layer, the transfer batches of ``n_items`` objects (``max_transfer_*`` limits)."""
        lim, cache, out = self.limits, {}, []
        for nbytes in self.layout.layer_nbytes:
            if nbytes not in cache:
                cache[nbytes] = split_batches(n_items, nbytes, lim.max_transfer_blocks, lim.max_transfer_bytes)
            out.append(cache[nbytes])
        return out

    def call(self, pool: WorkerPool, fn: Callable[[], Any], on_late: Callable[[Any], None] | None = None) -> DeadlineCall:
        return DeadlineCall(pool, fn, on_late)

    def moves_by_address(self) -> bool:
        """Whether batches may move by address at all: the backend gives addresses
        (``view_addresses``) and the copier may take them (``addressable``; a copier whose
        ``by_address`` is False, a CPU one, never does, so nothing is computed for it)."""
        return (getattr(self.backend, "view_addresses", None) is not None
                and getattr(self.copier, "addressable", None) is not None
                and getattr(self.copier, "by_address", True))

    def address_table(self, handles: list[Any]) -> Any:
        """The backend's table of a step's handles (``address_table``, optional), built once so
        ``addresses`` of each batch costs array work only; None where there is none."""
        make = getattr(self.backend, "address_table", None)
        return make(handles) if make is not None and self.moves_by_address() else None

    def addresses(self, layer: int, handles: list[Any] | None, offset: int, nbytes: int, table: Any = None, rows: Any = None) -> Any:
        """The host addresses of the batch's view windows when the backend gives them
        (``view_addresses``, or ``table_addresses`` of the step's ``table`` at ``rows``) and the
        copier can move them by address (``addressable``: a device copier, registered pool
        memory), else None (the caller takes views)."""
        if not self.moves_by_address():
            return None
        if table is not None:
            addrs = self.backend.table_addresses(table, rows, offset, nbytes)  # type: ignore[attr-defined]
        else:
            addrs = self.backend.view_addresses(handles, offset, nbytes)  # type: ignore[attr-defined]
        return addrs if addrs is not None and self.copier.addressable(layer, addrs) else None  # type: ignore[attr-defined]

    def release_later(self, pool: WorkerPool, handles: list[Any]) -> None:
        self.background.run(pool, "release", lambda: self.backend.release(handles))

    def release_after(self, handles: list[Any], tokens: list[Any], timeout_s: float) -> None:
        """Release ``handles`` once the copies of ``tokens`` (which may still read their objects)
        have completed, waiting on a thread of its own (never the forward thread, never a load
        worker). Copies still running after ``timeout_s`` keep the leases: the backend's lease
        timeout ends them, after the copy has had that long too."""
        self.after_copies("release", tokens, timeout_s, lambda: self.backend.release(handles),
                          f"{len(handles)} leases are kept until they expire")

    def after_copies(self, what: str, tokens: list[Any], timeout_s: float, fn: Callable[[], None], otherwise: str) -> None:
        """Run ``fn`` (a release or an abort) on a daemon thread once every copy of ``tokens`` has
        completed; if one has not after ``timeout_s``, log and record ``otherwise`` instead."""

        def job() -> None:
            deadline = time.monotonic() + timeout_s
            if all(self.copier.wait(t, max(0.0, deadline - time.monotonic())) for t in tokens):
                self.background.run(_INLINE, what, fn)
                return
            log.error("device copies still running %.1fs after their step ended: %s", timeout_s, otherwise)
            self.background.note(f"backend.{what} (previous step): device copies still running after {timeout_s}s; {otherwise}")

        threading.Thread(target=job, name=f"lw-{what}-after-copies", daemon=True).start()
