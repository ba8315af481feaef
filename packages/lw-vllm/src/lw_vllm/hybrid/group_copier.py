"""Hybrid models (vLLM's HMA): one pool chunk spans a block of every attention group.

vLLM gives each KV cache group its own block table. The pipeline and the receiver name a chunk by
one block id, the *anchor* group's (a full-attention group: its blocks are never null, so an id is
unique among live requests); ``GroupCopier`` maps that id, per layer, to the block of the layer's
own group, from the rows the worker registers with each step plan (``add_rows``) before it hands
the chunks to the pipeline or the receiver.

A sliding-window group's block outside the window is vLLM's null block (id ``NULL_BLOCK``): vLLM
never reads it, so loads skip it (the receiver does not even read it from the pool: ``unread``; a
copy into it is dropped) and saves never include it (the scheduler side saves
only chunks whose every group holds a real block).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from lw_core.pipeline.copier import Buffer, Token

# vLLM's BlockPool reserves block 0 as the null block (a placeholder for skipped blocks).
NULL_BLOCK = 0


class GroupCopier:
    """``slots[layer]``: ``-1`` when the layer is in the anchor group, else the index of its group
    among the rows' other groups (``Xfer.more``)."""

    def __init__(self, inner: Any, slots: Sequence[int]) -> None:
        self.inner = inner
        self.slots = list(slots)
        self._rows: dict[int, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    def add_rows(self, block_ids: Sequence[int], more: Sequence[Sequence[int]]) -> None:
        """Chunk ``i`` is anchor block ``block_ids[i]`` and ``more[g][i]`` in the other groups."""
        if any(len(m) != len(block_ids) for m in more):
            raise ValueError(f"group block ids {[len(m) for m in more]} do not match {len(block_ids)} chunks")
        with self._lock:
            for i, b in enumerate(block_ids):
                self._rows[b] = tuple(m[i] for m in more)

    def _real(self, layer: int, block_ids: Sequence[int]) -> list[int]:
        slot = self.slots[layer]
        if slot < 0:
            return list(block_ids)
        with self._lock:
            return [self._rows[b][slot] for b in block_ids]

    def unread(self, layer: int, block_ids: Sequence[int]) -> list[bool]:
        """Per chunk, whether vLLM will not read this layer's block (it is the null block)."""
        if self.slots[layer] < 0:
            return [False] * len(block_ids)
        return [b == NULL_BLOCK for b in self._real(layer, block_ids)]

    def block_nbytes(self, layer: int) -> int:
        return int(self.inner.block_nbytes(layer))

    def kv_views(self, layer: int, block_ids: Sequence[int]) -> list[memoryview] | None:
        real = self._real(layer, block_ids)
        if NULL_BLOCK in real and self.slots[layer] >= 0:
            return None
        out: list[memoryview] | None = self.inner.kv_views(layer, real)
        return out

    def to_kv(self, layer: int, block_ids: Sequence[int], srcs: Sequence[Buffer]) -> Token:
        real = self._real(layer, block_ids)
        if self.slots[layer] >= 0 and NULL_BLOCK in real:
            keep = [i for i, b in enumerate(real) if b != NULL_BLOCK]
            real, srcs = [real[i] for i in keep], [srcs[i] for i in keep]
        return self.inner.to_kv(layer, real, srcs)

    def from_kv(self, layer: int, block_ids: Sequence[int], dsts: Sequence[Buffer], after: Token = None) -> Token:
        real = self._real(layer, block_ids)
        if self.slots[layer] >= 0 and NULL_BLOCK in real:
            raise ValueError(f"layer {layer}: a save names vLLM's null block (a chunk outside the sliding window)")
        return self.inner.from_kv(layer, real, dsts, after)

    def compute_event(self) -> Token:
        return self.inner.compute_event()

    def wait(self, token: Token, timeout_s: float) -> bool:
        return bool(self.inner.wait(token, timeout_s))

    def make_visible(self, token: Token) -> None:
        self.inner.make_visible(token)

    def begin_load(self) -> None:
        begin = getattr(self.inner, "begin_load", None)
        if begin is not None:
            begin()

    def __getattr__(self, name: str) -> Any:  # the wrapped copier's extras (e.g. host_buffer)
        return getattr(self.inner, name)
