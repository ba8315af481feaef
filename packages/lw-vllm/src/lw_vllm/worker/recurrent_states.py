"""A worker's recurrent states (Mamba2, gated delta-net hybrids; ``RecurrentStates``, built by
``WorkerSide`` with its KV caches): the boundary states the step hands off are saved whole after
the forward (``state_store``); a hit's state is read beside the receive of its chunks
(``state_loads``), or, with streaming PD, landed last by the receive itself (``tail``) because the
prefiller saves it after its forward. ``stream_loads`` reports a request only once its state
settled (``settle``).

Deadlines, the chunks' own: a step's state saves are copied out of their blocks on the forward
thread and written on a thread of this class (``start_save``), and the step waits for them at most
``save_timeout_s`` (``finish_save``, beside the chunk saves, sharing their deadline); saves still
running then count as failed (``save_deadline_misses``; a late one may still publish its copy,
which holds the right bytes). A state load fails past ``layer_wait_timeout_s`` (``state_loads``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from lw_core.config import PoolConfig
from lw_core.keys import KeySpace
from lw_core.pipeline.pool import DeadlineCall, WorkerPool
from lw_vllm import pool
from lw_vllm.hybrid import state_layout
from lw_vllm.hybrid.state_loads import StateLoads
from lw_vllm.hybrid.state_store import StateStore
from lw_vllm.meta import StateXfer, Xfer
from lw_vllm.metrics import Collector
from lw_vllm.pd.stream_recv import IDLE_WAIT_S, StreamReceiver, Tail

log = logging.getLogger(__name__)


class RecurrentStates:
    """``save_timeout_s``, ``load_timeout_s``: the chunks' deadlines (``save_timeout_s``,
    ``layer_wait_timeout_s``); ``threads``: the state loads' threads."""

    def __init__(self, store: StateStore, stats: Collector, *, save_timeout_s: float = 10.0,
                 load_timeout_s: float = 5.0, threads: int = 1) -> None:
        self.store, self.stats, self.save_timeout_s = store, stats, save_timeout_s
        self.loads = StateLoads(store, load_timeout_s, stats, threads)  # off the forward thread
        self._saver = WorkerPool("lw-state-save", size=1)
        self._saving: tuple[DeadlineCall, list[StateXfer]] | None = None

    @classmethod
    def of_model(cls, kv_cache_config: Any, backend: Any, keyspace: KeySpace, tag: str, kv_caches: dict[str, Any],
                 num_blocks: int, stats: Collector, cfg: PoolConfig) -> RecurrentStates | None:
        """The model's states when the pool restores them (``state_layout``), else ``None``."""
        if not pool.state_groups(kv_cache_config) or state_layout.why_not_restorable(kv_cache_config) is not None:
            return None
        sl = state_layout.state_layout(kv_cache_config)
        return cls(StateStore(backend, state_layout.state_keyspace(keyspace, sl), tag, sl, kv_caches, num_blocks),
                   stats, save_timeout_s=cfg.save_timeout_s, load_timeout_s=cfg.layer_wait_timeout_s,
                   threads=cfg.stream_recv_threads)

    @property
    def nbytes(self) -> int:
        """One state object's size."""
        return self.store.layout.nbytes

    def save(self, saves: Sequence[StateXfer]) -> None:
        """The step's boundary states, now (after the forward that wrote them), within ``save_timeout_s``."""
        self.start_save(saves)
        self.finish_save(time.monotonic() + self.save_timeout_s)

    def start_save(self, saves: Sequence[StateXfer]) -> None:
        """Copy the step's boundary states out of their blocks (the forward wrote them) and start
        writing the copies to the pool; ``finish_save`` waits for them."""
        self.finish_save(0.0)  # one step's saves at a time (a caller that never finished: no wait)
        if not saves:
            return
        store = self.store
        snaps = [(sx.chunk_hash, store.snapshot(sx.blocks)) for sx in saves]
        call = DeadlineCall(self._saver, lambda: [store.put(h, srcs) for h, srcs in snaps])
        self._saving = (call, list(saves))

    def finish_save(self, deadline: float) -> None:
        """Wait for the started saves until ``deadline`` (``time.monotonic``); those still running
        then count as failed (``save_deadline_misses``)."""
        if self._saving is None:
            return
        (call, saves), self._saving = self._saving, None
        if not call.wait(deadline - time.monotonic()):
            log.warning("lw-vllm: %d recurrent-state saves missed their %ss deadline (a later request misses "
                        "them; the requests go on)", len(saves), self.save_timeout_s)
            self.stats.add(save_failed_objects=len(saves), save_deadline_misses=len(saves))
            return
        if call.error is not None:
            log.warning("lw-vllm: recurrent-state saves failed (not published; the requests go on): %s", call.error)
            self.stats.add(save_failed_objects=len(saves), save_errors=1)
            return
        done: list[str] = call.value
        log.debug("lw-vllm: boundary states %s", list(zip((sx.req_id for sx in saves), done)))
        saved = done.count("saved")
        self.stats.add(saved_objects=saved, saved_bytes=saved * self.nbytes, save_failed_objects=done.count("failed"))

    def start_load(self, x: Xfer) -> None:
        """Start reading the state after ``x``'s last chunk into ``x.state``'s blocks, beside the
        receive of its chunks (``state_loads``)."""
        self.loads.start(x.req_id, x.hashes[-1], x.state)

    def tail(self, x: Xfer) -> Tail:
        """Streaming PD: the receive's last object (``stream_recv.Tail``), the state after ``x``'s
        last chunk into ``x.state``'s blocks, each try within the load deadline; one that does not
        land fails the receive (recompute)."""
        loads, h, blocks = self.loads, x.hashes[-1], list(x.state)
        return lambda: loads.load_now(h, blocks)

    def settle(self, recv: StreamReceiver, done: Sequence[Any], idle: bool) -> tuple[list[Any], dict[str, str | None]]:
        """Of the ended receives ``done`` and those held before, the ones whose state settled, and
        how it went for those that had one (``StateLoads.settle``); a receive whose state already
        failed is cancelled (the load fails whole: its chunks need not arrive). On an idle step a
        state still loading is waited for a little."""
        lost = self.loads.failed_running()
        if lost:
            recv.cancel(lost)
        return self.loads.settle(done, IDLE_WAIT_S if idle and self.loads.busy else 0.0)

    def close(self) -> None:
        self.finish_save(time.monotonic() + self.save_timeout_s)
        self.loads.close()
        self._saver.close(timeout_s=1.0)
