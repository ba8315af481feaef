"""A request's blocks in every attention group, as the scheduler side tracks them.

vLLM hands the scheduler one block-id list per KV cache group (HMA). A pool chunk is one block of
every attention group: ``ReqState.block_ids`` holds the anchor group's (a full-attention group,
``pool.anchor_group``) and ``ReqState.more_blocks[g]`` the other attention groups', index ``i``
being chunk ``i`` in each. One group (a dense model): ``more_blocks`` is empty and everything
below reduces to the plain block list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lw_vllm.hybrid.group_copier import NULL_BLOCK
from lw_vllm.meta import Xfer
from lw_vllm.request.request_state import ReqState


class GroupBlocks:
    """``anchor``: the group naming chunks; ``others``: the other attention groups, in the order
    of ``ReqState.more_blocks`` and ``Xfer.more`` (state groups are not among them)."""

    def __init__(self, anchor: int, others: Sequence[int]) -> None:
        self.anchor = anchor
        self.others = list(others)

    def set(self, st: ReqState, ids: Any) -> None:
        """``ids``: vLLM's per-group block ids of the request (all of them)."""
        st.block_ids = list(ids[self.anchor])
        st.more_blocks = [list(ids[g]) for g in self.others]

    def add(self, st: ReqState, ids: Any) -> None:
        """``ids``: per group, the blocks vLLM appended this step."""
        st.block_ids.extend(ids[self.anchor])
        for m, g in zip(st.more_blocks, self.others):
            m.extend(ids[g])

    def clear(self, st: ReqState) -> None:
        st.block_ids, st.more_blocks = [], [[] for _ in self.others]

    @staticmethod
    def xfer(st: ReqState, hashes: list[bytes], a: int, b: int, src_tp: int = 0) -> Xfer:
        """Chunks ``[a, b)`` of ``st``; ``hashes[i]`` is chunk ``i``'s hash."""
        return Xfer(st.req.request_id, hashes[a:b], st.block_ids[a:b], src_tp, [m[a:b] for m in st.more_blocks])

    @staticmethod
    def savable_runs(st: ReqState, a: int, b: int) -> list[tuple[int, int]]:
        """Runs of chunks in ``[a, b)`` whose every group holds a real block (a hybrid's
        sliding-window block outside the window is vLLM's null block: that chunk is not saved)."""
        if not st.more_blocks:
            return [(a, b)] if b > a else []
        runs: list[tuple[int, int]] = []
        start = None
        for i in range(a, b):
            ok = all(m[i] != NULL_BLOCK for m in st.more_blocks)
            if ok and start is None:
                start = i
            elif not ok and start is not None:
                runs.append((start, i))
                start = None
        if start is not None:
            runs.append((start, b))
        return runs
