"""What a worker tells vLLM after a pass (``WorkerReport``, owned by ``WorkerSide``): the report to
the scheduler part (``LayerwiseWorkerMeta``: blocks loaded and failed, chunks saved, per request)
and the blocks whose load failed (``get_block_ids_with_load_errors``; vLLM recomputes them).

One object shared by the collaborators that write into it (the worker's own loads, ``stream_loads``,
``save_ledger``), so the report each of them fills is the one ``take`` hands out next.
"""

from __future__ import annotations

from collections.abc import Collection

from lw_vllm.meta import LayerwiseWorkerMeta


class WorkerReport:
    """The reports of TP rank ``rank``."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.meta = LayerwiseWorkerMeta(rank=rank)
        self.failed_blocks: set[int] = set()

    def loaded(self, req_id: str, span: tuple[float, float], blocks: int, nbytes: int) -> None:
        """``blocks`` of ``req_id`` (``nbytes`` read) landed in the load that ran over ``span``."""
        m = self.meta
        m.load_span[req_id] = span
        m.loaded[req_id] = m.loaded.get(req_id, 0) + blocks
        m.loaded_bytes[req_id] = m.loaded_bytes.get(req_id, 0) + nbytes

    def failed(self, req_id: str, blocks: int) -> None:
        """``blocks`` of ``req_id`` did not load (counted in the report only)."""
        self.meta.failed[req_id] = self.meta.failed.get(req_id, 0) + blocks

    def fail_blocks(self, req_id: str, block_ids: Collection[int]) -> None:
        """``block_ids`` of ``req_id`` did not load: vLLM recomputes them."""
        self.failed_blocks |= set(block_ids)
        self.failed(req_id, len(block_ids))

    def take(self) -> LayerwiseWorkerMeta | None:
        rep = self.meta
        if not (rep.loaded or rep.failed or rep.saved):
            return None
        self.meta = LayerwiseWorkerMeta(rank=self.rank)
        return rep

    def take_load_errors(self) -> set[int]:
        out, self.failed_blocks = self.failed_blocks, set()
        return out
