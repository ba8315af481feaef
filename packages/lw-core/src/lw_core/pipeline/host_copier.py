"""A numpy ``Copier``: a host "KV cache" of one uint8 array per layer, ``[num_blocks, block_nbytes]``.

It stands in for a real KV cache in tests and in ``lw-bench pipeline``, and is what a CPU KV cache
looks like to the pipeline: copies run synchronously in the calling thread (numpy releases the GIL
for the memcpy, so a transfer thread runs alongside compute) and tokens are ``None`` (already done).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lw_core.pipeline.buffers import PAGE, aligned_empty
from lw_core.pipeline.copier import Buffer, Token

__all__ = ["PAGE", "HostCopier", "aligned_empty"]  # aligned_empty lives in lw_core.pipeline.buffers


class HostCopier:
    """``Copier`` over per-layer numpy arrays (shape ``[num_blocks, block_nbytes]``, uint8)."""

    def __init__(self, kv: Sequence[np.ndarray]):
        if not kv:
            raise ValueError("HostCopier: kv must hold at least one layer array")
        for i, a in enumerate(kv):
            if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != 2 or not a.flags.c_contiguous:
                raise ValueError(
                    f"HostCopier: kv[{i}] must be a C-contiguous uint8 numpy array of shape "
                    f"[num_blocks, block_nbytes], got {type(a).__name__} "
                    f"{getattr(a, 'dtype', None)} {getattr(a, 'shape', None)}"
                )
        self.kv = list(kv)

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_nbytes: int | Sequence[int], *, fill: int | None = 0) -> HostCopier:
        """A fresh page-aligned KV cache; ``block_nbytes`` is one size for all layers or one per layer."""
        if num_layers <= 0 or num_blocks <= 0:
            raise ValueError(f"HostCopier.allocate: num_layers={num_layers} and num_blocks={num_blocks} must be > 0")
        sizes = [block_nbytes] * num_layers if isinstance(block_nbytes, int) else list(block_nbytes)
        if len(sizes) != num_layers or any(s <= 0 for s in sizes):
            raise ValueError(f"HostCopier.allocate: block_nbytes={block_nbytes!r} must be > 0, one value or one per layer")
        kv = []
        for s in sizes:
            a = aligned_empty(num_blocks * s).reshape(num_blocks, s)
            if fill is not None:
                a.fill(fill)
            kv.append(a)
        return cls(kv)

    @property
    def num_layers(self) -> int:
        return len(self.kv)

    @property
    def num_blocks(self) -> int:
        return self.kv[0].shape[0]

    def _layer(self, layer: int) -> np.ndarray:
        if not 0 <= layer < len(self.kv):
            raise IndexError(f"HostCopier: layer={layer} out of range; accepted 0..{len(self.kv) - 1}")
        return self.kv[layer]

    def _block(self, arr: np.ndarray, layer: int, b: int) -> np.ndarray:
        if not 0 <= b < arr.shape[0]:
            raise IndexError(f"HostCopier: block id {b} of layer {layer} out of range; accepted 0..{arr.shape[0] - 1}")
        return arr[b]

    @staticmethod
    def _check(pairs: str, block_ids: Sequence[int], bufs: Sequence[Buffer]) -> None:
        if len(block_ids) != len(bufs):
            raise ValueError(f"HostCopier: {len(block_ids)} block ids but {len(bufs)} {pairs}")

    # --- Copier protocol ---
    def block_nbytes(self, layer: int) -> int:
        return self._layer(layer).shape[1]

    def kv_views(self, layer: int, block_ids: Sequence[int]) -> list[memoryview] | None:
        arr = self._layer(layer)
        return [self._block(arr, layer, b).data for b in block_ids]

    def to_kv(self, layer: int, block_ids: Sequence[int], srcs: Sequence[Buffer]) -> Token:
        arr = self._layer(layer)
        self._check("srcs", block_ids, srcs)
        n = arr.shape[1]
        for b, s in zip(block_ids, srcs):
            src = np.frombuffer(s, dtype=np.uint8)
            if src.size != n:
                raise ValueError(f"HostCopier.to_kv: source for block {b} of layer {layer} has {src.size} bytes, expected {n}")
            np.copyto(self._block(arr, layer, b), src)
        return None

    def from_kv(self, layer: int, block_ids: Sequence[int], dsts: Sequence[Buffer], after: Token = None) -> Token:
        arr = self._layer(layer)
        self._check("dsts", block_ids, dsts)
        n = arr.shape[1]
        for b, d in zip(block_ids, dsts):
            dst = np.frombuffer(d, dtype=np.uint8)
            if dst.size != n:
                raise ValueError(f"HostCopier.from_kv: destination for block {b} of layer {layer} has {dst.size} bytes, expected {n}")
            np.copyto(dst, self._block(arr, layer, b))
        return None

    def compute_event(self) -> Token:
        return None

    def wait(self, token: Token, timeout_s: float) -> bool:
        return True

    def make_visible(self, token: Token) -> None:
        return None
