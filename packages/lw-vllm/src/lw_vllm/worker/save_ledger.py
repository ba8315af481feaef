"""A worker's saves across steps (``SaveLedger``, built by ``WorkerSide`` with its pipeline).

Each step's saves end in ``finish``: in the step, or with background saves
(``pool.saves_in_background``: kv_both, dense models) handed to the pipeline's background
finisher, their results collected in a later pass. Either way a result is credited to its requests
through the step's ``SaveBook`` as a running total per request (``SaveBook.credit``) in the
worker's report.

Background saves also hold blocks: a finished request that had saves planned is freed late by
vLLM (the scheduler part lists it in ``LayerwiseMeta.free_late``), once this worker reports it in
``finished_sending`` (``take_finished``), i.e. once none of its saves is running any more. A
preempted request's blocks are freed at once, so before the step's forward may reuse them
(``wait_preempted``) its saves' copies out of them are waited for, at most ``save_timeout_s``,
and then cancelled: what they did not write whole by then is aborted, never committed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

from lw_core.pipeline import LayerPipeline, SaveResult
from lw_vllm.meta import LayerwiseMeta
from lw_vllm.metrics import Collector
from lw_vllm.pd.stream_recv import IDLE_WAIT_S
from lw_vllm.worker.save_book import SaveBook
from lw_vllm.worker.worker_report import WorkerReport

log = logging.getLogger(__name__)


class SaveLedger:
    """``background``: whether saves may outlive their step (see the module docstring);
    ``save_timeout_s``: a save's deadline, which bounds the wait for a preempted request's saves."""

    def __init__(self, pipe: LayerPipeline, background: bool, report: WorkerReport, stats: Collector,
                 save_timeout_s: float) -> None:
        self.pipe, self.background, self.report, self.stats = pipe, background, report, stats
        self.save_timeout_s = save_timeout_s
        self._free_late: set[str] = set()  # finished requests vLLM frees once we report them
        self._saved_total: dict[str, int] = {}  # chunks committed per request so far (save_book)

    def finish(self, book: SaveBook, in_step: bool) -> None:
        """End the step's saves (booked in ``book``): in the step unless they may run in the
        background and the step does not need them in it (``LayerwiseMeta.saves_in_step``)."""
        if self.background and not in_step:
            self.pipe.finish_save_in_background(book)
        else:
            t0 = time.monotonic()
            res = self.pipe.finish_save()
            if res.committed_keys or res.failed_keys:
                self.stats.observe("save_wait_s", [time.monotonic() - t0])
            self._credit(res, book)
        self.collect()

    def collect(self) -> None:
        """Credit the background saves that ended since the last call."""
        if self.background:
            for res, book in self.pipe.take_background_saves():
                self._credit(res, book)

    def _credit(self, res: SaveResult, book: SaveBook) -> None:
        book.credit(res, self.report.meta, self._saved_total)
        self.stats.add(saved_objects=len(res.committed_keys), saved_bytes=res.saved_bytes,
                       save_failed_objects=len(res.failed_keys), save_errors=1 if res.errors else 0,
                       save_deadline_misses=len(res.deadline_misses))
        if res.errors:
            log.warning("lw-vllm: saves failed (those chunks are not published; the requests go on): %s",
                        "; ".join(res.errors[:3]))

    def _busy_requests(self) -> set[str]:
        busy: set[str] = set()
        for book in self.pipe.pending_background_saves():
            busy |= book.reqs
        return busy

    def forget(self, finished_req_ids: set[str], meta: LayerwiseMeta | None) -> None:
        """Drop the running totals of requests vLLM finished, unless they are freed late (kept
        until reported) or a save of theirs still runs."""
        busy = self._busy_requests() if self.background else set()
        late = self._free_late | set(meta.free_late if meta is not None else ())
        for rid in finished_req_ids - busy - late:
            self._saved_total.pop(rid, None)

    def take_finished(self, meta: LayerwiseMeta | None) -> set[str] | None:
        """Background saves: the requests vLLM frees late (``meta.free_late``) with no save running
        any more; their saves' results go into this same pass's report. On an idle step a running
        save is waited for a little instead of letting vLLM spin through empty steps."""
        if not self.background:
            return None
        if meta is not None and meta.free_late:
            self._free_late |= set(meta.free_late)
            meta.free_late = []
        if not self._free_late:
            self.collect()
            return None
        busy = self._busy_requests()
        if busy & self._free_late and meta is not None and meta.idle:
            self.pipe.wait_background_saves(IDLE_WAIT_S)
            busy = self._busy_requests()
        done = self._free_late - busy
        self._free_late -= done
        self.collect()  # after the busy check: every save of ``done`` is in
        for rid in done:
            self._saved_total.pop(rid, None)
        return done or None

    def wait_preempted(self, preempted: Collection[str]) -> None:
        """vLLM frees a preempted request's blocks at once: before this step's forward may reuse
        them, the background saves holding the request stop reading them (``save_timeout_s`` at
        most; then they are cancelled, ``LayerPipeline.stop_background_reads``). Other saves go on."""
        if not preempted or not self.background:
            return
        gone = set(preempted)
        if self._busy_requests() & gone:
            t0 = time.monotonic()
            cancelled = self.pipe.stop_background_reads(lambda book: bool(book.reqs & gone), self.save_timeout_s)
            if cancelled:
                log.warning("lw-vllm: %d background saves of preempted requests %s still ran after %ss: cancelled "
                            "(chunks they had not written whole are not published)",
                            cancelled, sorted(gone), self.save_timeout_s)
            self.stats.observe("save_wait_s", [time.monotonic() - t0])
