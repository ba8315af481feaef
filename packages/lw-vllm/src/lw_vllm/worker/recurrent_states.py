"""A worker's recurrent states (Mamba2, gated delta-net hybrids; ``RecurrentStates``, built by
``WorkerSide`` with its KV caches): the boundary states the step hands off are saved whole after
the forward (``state_store``); a hit's state is read beside the receive of its chunks
(``state_loads``), or, with streaming PD, landed last by the receive itself (``tail``) because the
prefiller saves it after its forward. ``stream_loads`` reports a request only once its state
settled (``settle``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from lw_core.keys import KeySpace
from lw_vllm import pool
from lw_vllm.hybrid import state_layout
from lw_vllm.hybrid.state_loads import StateLoads
from lw_vllm.hybrid.state_store import StateStore
from lw_vllm.meta import StateXfer, Xfer
from lw_vllm.metrics import Collector
from lw_vllm.pd.stream_recv import IDLE_WAIT_S, StreamReceiver, Tail

log = logging.getLogger(__name__)


class RecurrentStates:
    def __init__(self, store: StateStore, stats: Collector) -> None:
        self.store, self.stats = store, stats
        self.loads = StateLoads(store)  # off the forward thread

    @classmethod
    def of_model(cls, kv_cache_config: Any, backend: Any, keyspace: KeySpace, tag: str, kv_caches: dict[str, Any],
                 num_blocks: int, stats: Collector) -> RecurrentStates | None:
        """The model's states when the pool restores them (``state_layout``), else ``None``."""
        if not pool.state_groups(kv_cache_config) or state_layout.why_not_restorable(kv_cache_config) is not None:
            return None
        sl = state_layout.state_layout(kv_cache_config)
        return cls(StateStore(backend, state_layout.state_keyspace(keyspace, sl), tag, sl, kv_caches, num_blocks),
                   stats)

    @property
    def nbytes(self) -> int:
        """One state object's size."""
        return self.store.layout.nbytes

    def save(self, saves: Sequence[StateXfer]) -> None:
        """The step's boundary states, now (after the forward that wrote them)."""
        done = [self.store.save(sx.chunk_hash, sx.blocks) for sx in saves]
        log.debug("lw-vllm: boundary states %s", list(zip((sx.req_id for sx in saves), done)))
        saved = done.count("saved")
        self.stats.add(saved_objects=saved, saved_bytes=saved * self.nbytes, save_failed_objects=done.count("failed"))

    def start_load(self, x: Xfer) -> None:
        """Start reading the state after ``x``'s last chunk into ``x.state``'s blocks, beside the
        receive of its chunks (``state_loads``)."""
        self.loads.start(x.req_id, x.hashes[-1], x.state)

    def tail(self, x: Xfer) -> Tail:
        """Streaming PD: the receive's last object (``stream_recv.Tail``), the state after ``x``'s
        last chunk into ``x.state``'s blocks; one that does not land fails the receive (recompute)."""
        store, h, blocks = self.store, x.hashes[-1], list(x.state)
        return lambda: store.load(h, blocks)

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
        self.loads.close()
