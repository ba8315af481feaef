"""A worker's asynchronous loads (``StreamLoads``, built by ``WorkerSide`` when it has a
receiver): a streaming PD decoder's receives (``cfg.pd_streaming``) and every load of a hybrid
model (several KV cache groups), which vLLM takes per request only and parks in
``WAITING_FOR_REMOTE_KVS`` until the workers report it in ``finished_recving``.

``start`` hands the step plan's ``stream_loads`` to the ``StreamReceiver`` (with a recurrent-state
model's state: ``recurrent_states``); ``finish`` reports the receives that ended, crediting their
blocks in the worker's report. A hybrid's failed load is reported per request
(``take_failed_recving``: vLLM cannot map a hybrid's block ids back and recomputes it whole);
another model's failed blocks go out through ``WorkerReport.failed_blocks``.
"""

from __future__ import annotations

import logging

from lw_core.keys import KeySpace
from lw_vllm.hybrid.group_copier import GroupCopier
from lw_vllm.meta import LayerwiseMeta, Xfer
from lw_vllm.metrics import Collector
from lw_vllm.pd.stream_recv import IDLE_WAIT_S, StreamReceiver
from lw_vllm.worker.recurrent_states import RecurrentStates
from lw_vllm.worker.worker_report import WorkerReport

log = logging.getLogger(__name__)


class StreamLoads:
    """``groups``: a hybrid model's copier (``None`` for one KV cache group); ``states``: the
    model's recurrent states, when the pool restores them."""

    def __init__(self, recv: StreamReceiver, keyspace: KeySpace, tag: str, groups: GroupCopier | None,
                 states: RecurrentStates | None, report: WorkerReport, stats: Collector) -> None:
        self.recv, self.keyspace, self.tag = recv, keyspace, tag
        self.groups, self.states, self.report, self.stats = groups, states, report, stats
        self._failed_recving: set[str] = set()
        self._empty_done: set[str] = set()  # failed before any receive started: reported next pass

    def start(self, meta: LayerwiseMeta) -> None:
        """The plan's cancels, new receives, then prefills done (``start_load_kv`` may run twice a
        step: each list is taken once)."""
        recv = self.recv
        if meta.stream_cancels:
            recv.cancel(set(meta.stream_cancels))
            meta.stream_cancels = []
        streams, meta.stream_loads = meta.stream_loads, []
        committed = set(meta.stream_prefilled)  # loads of committed objects (their state is there now)
        for x in streams:
            if self.groups is not None:
                if not x.hashes:  # the scheduler could not plan it: vLLM recomputes the request
                    self._failed_recving.add(x.req_id)
                    self._empty_done.add(x.req_id)
                    continue
                self.groups.add_rows(x.block_ids, x.more)
            if x.state and self.states is not None and x.req_id not in committed:
                # Streaming PD: the prefiller saves the state after its forward; it lands last.
                recv.start(x.req_id, self.keyspace.keys(self.tag, x.hashes), x.block_ids, self.states.tail(x),
                           self.states.nbytes, holds=x.holds)
                continue
            if x.state and not self._start_state(x):
                continue
            recv.start(x.req_id, self.keyspace.keys(self.tag, x.hashes), x.block_ids, holds=x.holds)
        if meta.stream_prefilled:  # after the starts: the answer may come in their step
            recv.prefilled(set(meta.stream_prefilled))
            meta.stream_prefilled = []

    def _start_state(self, x: Xfer) -> bool:
        """Start loading ``x``'s state beside its chunks; ``False`` (the request's load failed,
        vLLM recomputes it) when this worker keeps no states."""
        if self.states is not None:
            self.states.start_load(x)
            return True
        log.warning("lw-vllm: %s: recurrent state of its %d-chunk hit not loaded (this worker keeps no states); "
                    "vLLM recomputes it", x.req_id, len(x.hashes))
        self._failed_recving.add(x.req_id)
        self._empty_done.add(x.req_id)
        self.report.failed(x.req_id, len(x.block_ids))
        return False

    def finish(self, finished_req_ids: set[str], idle: bool) -> set[str] | None:
        """Receives that ended (``finished_recving``), the receives of ``finished_req_ids`` cancelled
        first; their failed blocks go out in this same pass (vLLM asks right after). On an idle
        step a running receive is waited for a little."""
        recv = self.recv
        if finished_req_ids:
            recv.cancel(finished_req_ids)
        done = recv.take_done(IDLE_WAIT_S if idle else 0.0)
        states: dict[str, str | None] = {}
        if self.states is not None:
            done, states = self.states.settle(recv, done, idle)
        empty, self._empty_done = self._empty_done, set()
        if not done:
            return empty or None
        failed_blocks = 0
        for d in done:
            bad = d.failed_blocks
            # One object per chunk received (the receiver reads this rank's objects only), and a
            # streamed state (the receive's tail) one more, as a state read beside it is below.
            objects, nbytes, good = d.good + d.tail_landed, d.nbytes, d.good
            if d.req_id in states:
                err = states[d.req_id]
                if err is None:  # one pool object more, counted like the chunks
                    assert self.states is not None
                    objects, nbytes = objects + 1, nbytes + self.states.nbytes
                else:  # the chunks are of no use without it: vLLM recomputes the request
                    log.warning("lw-vllm: %s: recurrent state of its %d-block hit not loaded (%s); vLLM recomputes it",
                                d.req_id, len(d.block_ids), err)
                    bad, good = d.block_ids, 0
            if self.groups is not None:
                if bad:
                    self._failed_recving.add(d.req_id)
            else:
                self.report.failed_blocks |= set(bad)
            self.report.loaded(d.req_id, d.span, good, nbytes)
            self.stats.add(loaded_objects=objects, loaded_bytes=nbytes)
            failed_blocks += len(bad)
            if bad:
                self.report.failed(d.req_id, len(bad))
                if len(d.failed_blocks):
                    log.warning("lw-vllm: %s: %d of %d streamed KV blocks did not arrive (%s); vLLM recomputes them",
                                d.req_id, len(d.failed_blocks), len(d.block_ids), d.error or "unknown")
        self.stats.add(load_failed_blocks=failed_blocks)
        return {d.req_id for d in done} | empty

    def take_failed_recving(self) -> set[str]:
        """Hybrid models: requests whose load failed (any block): vLLM recomputes them whole."""
        out, self._failed_recving = self._failed_recving, set()
        return out

    def close(self) -> None:
        self.recv.close()
