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
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from lw_vllm.hybrid.state_store import StateStore

log = logging.getLogger(__name__)


class StateLoads:
    def __init__(self, store: StateStore, threads: int = 1) -> None:
        self.store = store
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="lw-state-load")
        self._pending: dict[str, Future[str | None]] = {}
        self._held: list[Any] = []  # ended receives whose state is still loading

    def start(self, req_id: str, chunk_hash: bytes, blocks: Sequence[int]) -> None:
        """Read the state after ``chunk_hash`` into ``blocks`` (one per state group), in the background."""
        self._pending[req_id] = self._pool.submit(self._load, chunk_hash, list(blocks))

    def _load(self, chunk_hash: bytes, blocks: list[int]) -> str | None:
        try:
            return self.store.load(chunk_hash, blocks)
        except Exception as e:  # a bug costs a recompute, never a request parked for good
            log.exception("lw-vllm: state load crashed")
            return f"state load crashed: {e!r}"

    def failed_running(self) -> set[str]:
        """Requests whose state already failed to land while their receive is still running (their
        receive can stop: the load fails whole)."""
        held = {d.req_id for d in self._held}
        return {rid for rid, f in self._pending.items() if rid not in held and f.done() and f.result() is not None}

    def settle(self, done: Sequence[Any], wait_s: float = 0.0) -> tuple[list[Any], dict[str, str | None]]:
        """Of the ended receives ``done`` (``RecvDone``) and those held before, the ones that can be
        reported now, and for those that had a state, how it went (``None``: landed, else why not).
        With ``wait_s``, first wait that long for a held one's state."""
        todo = self._held + list(done)
        if wait_s > 0:
            futs = [self._pending[d.req_id] for d in todo if d.req_id in self._pending]
            if futs:
                wait(futs, timeout=wait_s)
        ready: list[Any] = []
        outcome: dict[str, str | None] = {}
        self._held = []
        for d in todo:
            fut = self._pending.get(d.req_id)
            if fut is None:
                ready.append(d)
            elif not fut.done():
                self._held.append(d)
            else:
                del self._pending[d.req_id]
                outcome[d.req_id] = fut.result()
                ready.append(d)
        return ready, outcome

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
