"""Reading GQA KV saved at another tensor-parallel size: which saver ranks' objects hold a rank's
heads, and at which byte ranges.

The KV of one block of one layer is ``kv_heads_of_the_rank x block_size`` rows of ``row`` bytes
(one head's K and V for one token), ordered head-major or token-major (``lw_core.block_order``:
vLLM's CPU layout and the NPU's are head-major, CUDA's default is token-major). An object holds one
block of every layer, layer-major. A saver at TP ``P`` has ``H / P`` heads per rank; a reader at TP
``D`` needs heads ``[d * H/D, (d + 1) * H/D)``, and head ``h`` is head ``h mod H/P`` of saver rank
``h // (H/P)``. Neither side saves twice: the reader issues ranged reads (the ``Backend``
protocol's ``read`` at an offset, ``len(dst)`` bytes) into the right part of its block. Head-major,
a rank's heads are one contiguous range per source object and layer; token-major, they are one
range per token (a row of ``n_heads * row`` bytes at every ``heads * row``). Saver and reader
order their blocks alike: the order is in the keys, so a reader never finds another order's objects.

Only sizes that divide the kv heads are split this way (vLLM replicates heads when TP exceeds
them, and an uneven split has no such ranges): ``split_heads`` refuses the rest naming both sizes.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from lw_core.block_order import HEAD_MAJOR, BlockOrder, check_order, row_offset

Count = Annotated[int, Meta(ge=1)]
Index = Annotated[int, Meta(ge=0)]


class TpSplitError(ValueError):
    """Two TP sizes whose ranks' heads cannot be matched by byte ranges."""


class HeadSlice(msgspec.Struct, frozen=True, array_like=True):
    """``n_heads`` heads of source object ``src`` from its head ``src_head`` to the reader's
    block from its head ``dst_head``."""

    src: Index
    src_head: Index
    dst_head: Index
    n_heads: Count


class HeadSplit(msgspec.Struct, frozen=True, array_like=True):
    """How one reader rank's block is put together from objects saved by ranks at another TP."""

    src_tp: Count
    src_ranks: tuple[Index, ...]  # the saver ranks whose objects hold this rank's heads, in order
    src_heads: Count  # heads per layer in each source object (kv_heads / src_tp)
    dst_heads: Count  # heads per layer in the reader's block (kv_heads / dst_tp)
    slices: tuple[HeadSlice, ...]
    order: BlockOrder = HEAD_MAJOR  # how heads and tokens are ordered in a block (both sides)
    tokens: Count = 1  # tokens per block (block_size); only token-major ranges depend on it

    def layer_reads(self, dst_layer_nbytes: int, dst_layer_offset: int) -> list[tuple[int, int, int, int]]:
        """For one layer whose block holds ``dst_layer_nbytes`` bytes at ``dst_layer_offset`` of the
        reader's object layout: ``(source index, offset in the source object, offset in the
        reader's layer bytes, nbytes)``, one per slice (head-major) or per slice and token
        (token-major). The source object's layer ``l`` lies at ``offset_l / dst_heads * src_heads``
        (same layers, each scaled by the head ratio)."""
        if dst_layer_nbytes % self.dst_heads or dst_layer_offset % self.dst_heads:
            raise TpSplitError(f"a layer of {dst_layer_nbytes} bytes at offset {dst_layer_offset} does not split "
                               f"into {self.dst_heads} heads")
        head = dst_layer_nbytes // self.dst_heads
        src_off = dst_layer_offset // self.dst_heads * self.src_heads
        if self.order == HEAD_MAJOR:
            return [(s.src, src_off + s.src_head * head, s.dst_head * head, s.n_heads * head) for s in self.slices]
        if head % self.tokens:
            raise TpSplitError(f"a layer of {dst_layer_nbytes} bytes does not split into {self.dst_heads} heads "
                               f"x {self.tokens} tokens")
        row = head // self.tokens
        sh, dh, n = self.src_heads, self.dst_heads, self.tokens
        return [(s.src, src_off + row_offset(self.order, sh, n, s.src_head, t, row),
                 row_offset(self.order, dh, n, s.dst_head, t, row), s.n_heads * row)
                for s in self.slices for t in range(n)]


def can_split(kv_heads: int, tp_a: int, tp_b: int) -> bool:
    """Whether KV saved at one size can be read at the other by head ranges."""
    return kv_heads >= 1 and all(t >= 1 and kv_heads % t == 0 for t in (tp_a, tp_b))


def split_heads(kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int, *, order: str = HEAD_MAJOR,
                tokens: int = 1) -> HeadSplit:
    """Where reader rank ``dst_rank`` (of ``dst_tp``) finds its heads among the objects of a
    saver at ``src_tp``, for blocks of ``tokens`` tokens in ``order`` (``lw_core.block_order``);
    ``TpSplitError`` names both sizes when they cannot be matched."""
    try:
        checked = check_order(order)
    except ValueError as e:
        raise TpSplitError(str(e)) from None
    if tokens < 1:
        raise TpSplitError(f"tokens={tokens} (tokens per block) must be >= 1")
    if not 0 <= dst_rank < dst_tp:
        raise TpSplitError(f"tp_rank={dst_rank} is outside tensor_parallel_size={dst_tp}")
    if not can_split(kv_heads, src_tp, dst_tp):
        raise TpSplitError(
            f"KV saved at tensor_parallel_size={src_tp} cannot be read at tensor_parallel_size={dst_tp}: the "
            f"model's {kv_heads} kv heads do not divide evenly by both sizes"
        )
    hs, hd = kv_heads // src_tp, kv_heads // dst_tp
    ranks: list[int] = []
    slices: list[HeadSlice] = []
    h, end = dst_rank * hd, (dst_rank + 1) * hd
    while h < end:
        p = h // hs
        n = min(end, (p + 1) * hs) - h
        if p not in ranks:
            ranks.append(p)
        slices.append(HeadSlice(src=ranks.index(p), src_head=h - p * hs, dst_head=h - dst_rank * hd, n_heads=n))
        h += n
    return HeadSplit(src_tp=src_tp, src_ranks=tuple(ranks), src_heads=hs, dst_heads=hd, slices=tuple(slices),
                     order=checked, tokens=tokens)
