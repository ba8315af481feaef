"""Scheduler side of recurrent-state objects (``state_layout``, ``state_store``).

Saves: only the boundaries vLLM hands off (``SchedulerOutput.kv_connector_block_state
.boundary_state_offloads``: request -> [(group, block, boundary tokens)]), in "align" mode the exact
block holding the state after that boundary; a block table of a state group is not append-only, so
it is never read positionally. An offer is taken when the boundary is a chunk multiple inside the
prompt, every state group offers a real block for it, and the request is live (not finished or
preempted in this step: its blocks may already be someone else's), as vLLM's own offloaders do.

Hits: a hit of ``j`` chunks needs the attention KV of chunks ``[0, j)`` and the state object of
boundary ``j`` (every rank's). The longest such ``j`` wins; no state object means a shorter hit, never
a wrong one. The restored state goes to the block vLLM allocates for it: with ``N = j * block``
computed tokens a state group's table is ``j - 1`` null blocks then that block (``MambaManager``:
``get_num_skipped_tokens`` is ``N - 1``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from lw_core.keys import KeySpace
from lw_vllm.hybrid.group_copier import NULL_BLOCK
from lw_vllm.hybrid.state_layout import StateLayout
from lw_vllm.meta import StateXfer, Xfer
from lw_vllm.request.request_state import ReqState

log = logging.getLogger(__name__)


class StatePlan:
    def __init__(self, backend: Any, keyspace: KeySpace, tags: Sequence[str], layout: StateLayout,
                 block_size: int) -> None:
        self.backend, self.keyspace, self.tags, self.layout = backend, keyspace, list(tags), layout
        self.block_size = block_size
        self._targets: dict[str, list[int]] = {}  # request -> state blocks of its pending load

    def longest(self, hashes: Sequence[bytes], local: int, hit: int) -> int:
        """The longest ``j`` in ``(local, hit]`` whose boundary state is in the pool for every rank;
        ``local`` when none is."""
        for j in range(hit, local, -1):
            keys = [self.keyspace.key(t, hashes[j - 1]) for t in self.tags]
            if self.backend.lookup(keys) == len(keys):
                return j
        return local

    def allocated(self, st: ReqState, ids: Any) -> None:
        """vLLM allocated the blocks of ``st``'s pending load (``st.load``): note the state groups'
        block for its end boundary."""
        if st.load is None:
            return
        first, n = st.load
        j = first + n
        blocks = [list(ids[g])[j - 1] if len(ids[g]) >= j else NULL_BLOCK for g in self.layout.group_ids]
        self._targets[st.req.request_id] = blocks

    def with_state(self, x: Xfer) -> Xfer:
        """``x`` (a load ending at the hit's boundary) with the blocks its state goes to; a load
        whose state has no block loses its chunks (the worker fails it: vLLM recomputes)."""
        blocks = self._targets.pop(x.req_id, None)
        if blocks is None or NULL_BLOCK in blocks or not x.hashes:
            log.error("lw-vllm: %s: no block for the restored state (%s); recomputing", x.req_id, blocks)
            return msgspec.structs.replace(x, hashes=[], block_ids=[], more=[[] for _ in x.more], state=[])
        return msgspec.structs.replace(x, state=blocks)

    def forget(self, req_id: str) -> None:
        self._targets.pop(req_id, None)

    def saves(self, so: Any, reqs: dict[str, ReqState], hashes: Callable[[ReqState], list[bytes]]) -> list[StateXfer]:
        """This step's boundary-state hand-offs worth saving."""
        bstate = getattr(so, "kv_connector_block_state", None)
        offers = getattr(bstate, "boundary_state_offloads", None) or {}
        gone = set(getattr(so, "preempted_req_ids", None) or ()) | set(getattr(so, "finished_req_ids", None) or ())
        out: list[StateXfer] = []
        if offers:
            log.debug("lw-vllm: boundary-state offers %s", offers)
        for rid, entries in offers.items():
            st = reqs.get(rid)
            if st is None or rid in gone:
                continue
            by_boundary: dict[int, dict[int, int]] = {}
            for g, block, boundary in entries:
                by_boundary.setdefault(int(boundary), {})[int(g)] = int(block)
            for boundary, blocks in sorted(by_boundary.items()):
                j = boundary // self.block_size
                if boundary <= 0 or boundary % self.block_size or boundary > st.prompt_len:
                    continue
                row = [blocks.get(g, NULL_BLOCK) for g in self.layout.group_ids]
                if NULL_BLOCK in row:
                    continue
                hs = hashes(st)
                if j > len(hs):
                    continue
                out.append(StateXfer(rid, hs[j - 1], row))
        return out
