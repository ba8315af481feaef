"""Recurrent-state loads off the forward thread (worker side of ``state_layout``).

Why not per layer through the connector's layer hooks: vLLM calls ``wait_for_layer_load`` and
``save_kv_layer`` around attention layers only (``maybe_transfer_kv_layer`` decorates
``unified_attention_with_output``; a gated delta-net layer has no hook), and a hybrid's load is
asynchronous anyway: vLLM refuses block-level load failures for models with several KV cache groups
(``Scheduler._handle_invalid_blocks``), so the connector loads a hybrid's prompt asynchronously and
vLLM parks the request in ``WAITING_FOR_REMOTE_KVS`` until the workers report it in
``finished_recving``. The loading request runs no forward, and no layer hook fires for it, before
its whole load is reported; its attention chunks already move layer by layer on the receiver's
threads (``stream_recv``), off the forward pass. Its state does the same here: read on a thread of
its own beside the receive of its chunks, instead of in ``start_load_kv`` where it held up the
forward of every request of that step.

A request is reported only once both its receive and its state load ended (a receive that ends
first is held): vLLM must neither run it nor free its blocks while its state is being written. A
state that does not land fails the request's load (vLLM recomputes it), never a wrong hit.

Deadlines, as for chunks (``layer_wait_timeout_s``, from the load's start, time spent queued
included): a load still running past its deadline fails (the request is reported, vLLM recomputes
it). The read goes into buffers of its own and is copied into the state's block under the load's
lock only while its deadline has not been called, so a read that returns late never lands in a
block vLLM may have handed to another request. The loads run on a few threads
(``stream_recv_threads``, as the receives beside them); a thread stuck in a pool call past a
deadline is replaced (``lw_core.pipeline.pool.WorkerPool.unstick``), so one stuck load does not
park the loads queued after it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from lw_core.pipeline.pool import WorkerPool
from lw_vllm.hybrid.state_store import StateStore
from lw_vllm.metrics import Collector

log = logging.getLogger(__name__)


class _Load:
    """One state load. ``result`` is set once, under ``lock``, when ``ended``: ``None`` when it
    landed, else why not (a deadline, a failed read)."""

    __slots__ = ("deadline", "lock", "ended", "result")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.lock = threading.Lock()
        self.ended = threading.Event()
        self.result: str | None = None


class StateLoads:
    """``timeout_s``: a load's deadline (``layer_wait_timeout_s``); ``stats``: where deadline
    misses are counted (``load_deadline_misses``); ``threads``: the loads' worker threads."""

    def __init__(self, store: StateStore, timeout_s: float, stats: Collector | None = None,
                 threads: int = 1) -> None:
        self.store, self.timeout_s = store, timeout_s
        self.stats = stats if stats is not None else Collector()
        self._pool = WorkerPool("lw-state-load", size=max(1, threads))
        self._ended = threading.Condition()  # notified whenever a load ends
        self._pending: dict[str, _Load] = {}
        self._held: list[Any] = []  # ended receives whose state is still loading

    def start(self, req_id: str, chunk_hash: bytes, blocks: Sequence[int]) -> None:
        """Read the state after ``chunk_hash`` into ``blocks`` (one per state group), in the background."""
        self._pending[req_id] = self._submit(chunk_hash, blocks, self.timeout_s)

    def load_now(self, chunk_hash: bytes, blocks: Sequence[int]) -> str | None:
        """Read the state and wait for it, at most its deadline: ``None`` when it landed, else why
        not (a streamed receive's tail, on the receive's thread)."""
        job = self._submit(chunk_hash, blocks, self.timeout_s)
        job.ended.wait(max(0.0, job.deadline - time.monotonic()))
        self._expire(job)
        return job.result

    def _submit(self, chunk_hash: bytes, blocks: Sequence[int], timeout_s: float) -> _Load:
        job = _Load(time.monotonic() + max(0.0, timeout_s))
        self._pool.submit(functools.partial(self._run, job, chunk_hash, list(blocks)))
        return job

    def _run(self, job: _Load, chunk_hash: bytes, blocks: list[int]) -> None:
        if job.ended.is_set():  # its deadline passed while it was queued
            return
        try:
            got: list[Any] | str = self.store.fetch(chunk_hash)
        except Exception as e:  # a bug costs a recompute, never a request parked for good
            log.exception("lw-vllm: state load crashed")
            got = f"state load crashed: {e!r}"
        with job.lock:
            if job.ended.is_set():  # past its deadline: the block may be another request's now
                return
            if isinstance(got, str):
                job.result = got
            else:
                try:
                    self.store.land(blocks, got)
                except Exception as e:
                    log.exception("lw-vllm: copying a state into its block failed")
                    job.result = f"state copy failed: {e!r}"
            job.ended.set()
        with self._ended:
            self._ended.notify_all()

    def _expire(self, job: _Load) -> None:
        """End ``job`` as failed if it has not ended (it never lands after this)."""
        with job.lock:
            if job.ended.is_set():
                return
            job.result = f"state load missed its {self.timeout_s}s deadline"
            job.ended.set()
        log.warning("lw-vllm: a recurrent-state load missed its %ss deadline; its request is recomputed",
                    self.timeout_s)
        self.stats.add(load_deadline_misses=1)
        self._pool.unstick()  # the loads queued behind a stuck read get a fresh thread

    def _expire_late(self) -> None:
        now = time.monotonic()
        for job in list(self._pending.values()):
            if not job.ended.is_set() and now >= job.deadline:
                self._expire(job)

    def failed_running(self) -> set[str]:
        """Requests whose state already failed to land (or is past its deadline) while their
        receive is still running (their receive can stop: the load fails whole)."""
        self._expire_late()
        held = {d.req_id for d in self._held}
        return {rid for rid, j in self._pending.items() if rid not in held and j.ended.is_set() and j.result is not None}

    def settle(self, done: Sequence[Any], wait_s: float = 0.0) -> tuple[list[Any], dict[str, str | None]]:
        """Of the ended receives ``done`` (``RecvDone``) and those held before, the ones that can be
        reported now, and for those that had a state, how it went (``None``: landed, else why not).
        With ``wait_s``, first wait that long for a held one's state (never past its deadline)."""
        todo = self._held + list(done)
        jobs = [self._pending[d.req_id] for d in todo if d.req_id in self._pending]
        if wait_s > 0 and jobs:
            end = min(time.monotonic() + wait_s, min(j.deadline for j in jobs))
            with self._ended:
                while not any(j.ended.is_set() for j in jobs) and (left := end - time.monotonic()) > 0:
                    self._ended.wait(left)
        self._expire_late()
        ready: list[Any] = []
        outcome: dict[str, str | None] = {}
        self._held = []
        for d in todo:
            job = self._pending.get(d.req_id)
            if job is None:
                ready.append(d)
            elif not job.ended.is_set():
                self._held.append(d)
            else:
                del self._pending[d.req_id]
                outcome[d.req_id] = job.result
                ready.append(d)
        return ready, outcome

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def close(self) -> None:
        for job in self._pending.values():  # nothing lands after this
            with job.lock:
                if not job.ended.is_set():
                    job.result = "the worker is shutting down"
                    job.ended.set()
        self._pool.close(timeout_s=1.0)
