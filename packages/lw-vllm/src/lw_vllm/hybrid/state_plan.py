"""Scheduler side of recurrent-state objects (``state_layout``, ``state_store``).

Saves: only the boundaries vLLM hands off (``SchedulerOutput.kv_connector_block_state
.boundary_state_offloads``: request -> [(group, block, boundary tokens)]), in "align" mode the exact
block holding the state after that boundary; a block table of a state group is not append-only, so
it is never read positionally. An offer is taken when the boundary is a chunk multiple inside the
prompt, every state group offers a real block for it, and the request is live (not finished or
preempted in this step: its blocks may already be someone else's), as vLLM's own offloaders do.

Hits: a hit of ``j`` chunks needs the attention KV of chunks ``[0, j)`` and the state object of
boundary ``j`` (every rank's). The longest such ``j`` wins; no state object means a shorter hit, never
a wrong one. The boundaries are looked up through the scheduler side's ``PoolLookup`` (one call under
``lookup_timeout_s`` and its back-off, in vLLM's scheduler loop). The restored state goes to the
block vLLM allocates for it: with ``N = j * block`` computed tokens a state group's table is
``j - 1`` null blocks then that block (``MambaManager``: ``get_num_skipped_tokens`` is ``N - 1``).

A hit never ends past ``(n - 1) // block`` for an ``n``-token request (``last_boundary``): vLLM
computes at least the last token, so it is told at most ``n - 1`` tokens are computed, and the state
after token ``n - 1`` (boundary ``n / block`` of a prompt that ends on a block) would run that token
through the recurrent layers twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec

from lw_core.keys import KeySpace
from lw_vllm.hybrid.group_copier import NULL_BLOCK
from lw_vllm.hybrid.state_layout import StateLayout
from lw_vllm.meta import StateXfer, Xfer
from lw_vllm.request.request_state import ReqState

log = logging.getLogger(__name__)


class HeldLookup(Protocol):
    """``pool_lookup.PoolLookup.first_held``: raises when the pool cannot answer in time."""

    def first_held(self, candidates: list[list[str]]) -> int: ...


def last_boundary(n_tokens: int, block_size: int) -> int:
    """The last boundary a hit of an ``n_tokens`` request may end at (module docstring)."""
    return max(0, n_tokens - 1) // block_size


class StatePlan:
    """``lookup``: the scheduler side's pool lookup (deadline, back-off)."""

    def __init__(self, lookup: HeldLookup, keyspace: KeySpace, tags: Sequence[str], layout: StateLayout,
                 block_size: int) -> None:
        self.lookup, self.keyspace, self.tags, self.layout = lookup, keyspace, list(tags), layout
        self.block_size = block_size
        self._targets: dict[str, list[int]] = {}  # request -> state blocks of its pending load

    def longest(self, hashes: Sequence[bytes], local: int, hit: int) -> int:
        """The longest ``j`` in ``(local, hit]`` whose boundary state is in the pool for every rank;
        ``local`` when none is. Raises when the pool cannot answer (``PoolLookup``)."""
        js = list(range(hit, local, -1))
        i = self.lookup.first_held([[self.keyspace.key(t, hashes[j - 1]) for t in self.tags] for j in js])
        return js[i] if i < len(js) else local

    def held(self, hashes: Sequence[bytes], j: int) -> bool:
        """Whether the pool holds boundary ``j``'s state for every rank (``True`` for ``j`` 0:
        the empty prefix needs none). Raises when the pool cannot answer."""
        return j <= 0 or self.longest(hashes, j - 1, j) == j

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
