"""The device's own gather/scatter between KV blocks and host memory it can address: a registered,
mapped pool region seen as a device tensor (zero-copy: the SMs read or write the host pages over
PCIe), one pair of torch indexing ops per chunk of a batch, on the current stream.

Bytes move as words (int64 where every address and size allows, else int32/int16/uint8) so each
thread moves 8 bytes. A batch is ``k`` blocks; block ``i`` is ``n = outer * inner`` bytes at word
offset ``woffs[i]`` in the region, and ``outer`` segments of ``inner`` bytes in the KV layer
(``[outer, num_blocks, inner]`` bytes, ``lw_vllm.device.copier.block_bytes_view``). The index of a chunk
(``woffs[:, None] + arange(words)``) is built on the device; chunks bound the device temporaries
(the gathered words and that index) to ``CHUNK_BYTES`` each.

These functions are plain torch: ``TorchDeviceOps`` runs them on a device, the CPU fakes and the
bench's inline mode on CPU tensors (where they check the same address arithmetic).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

CHUNK_BYTES = 16 << 20
_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_size(*values: int) -> int:
    """The largest of 8, 4, 2, 1 bytes that divides every value (addresses, sizes, offsets)."""
    g = 0
    for v in values:
        g = math.gcd(g, int(v))
    for w in (8, 4, 2):
        if g % w == 0:
            return w
    return 1


def _words(layer: torch.Tensor, region: torch.Tensor, word: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    dt = _DTYPES[word]
    outer, _, inner = layer.shape
    return layer.view(dt), region.view(dt), outer, inner // word


def _chunks(k: int, block_words: int, word: int) -> range:
    return range(0, k, max(1, CHUNK_BYTES // max(1, block_words * word)))


def gather_to_kv(layer: torch.Tensor, ids: torch.Tensor, region: torch.Tensor, woffs: torch.Tensor, word: int) -> None:
    """Region words ``woffs[i] .. + n/word`` -> block ``ids[i]`` of ``layer`` (both int64 index
    tensors on the layer's device)."""
    lw, hw, outer, iw = _words(layer, region, word)
    per_block = outer * iw
    ar = torch.arange(per_block, device=layer.device, dtype=torch.int64)
    k = ids.numel()
    step = _chunks(k, per_block, word).step
    for a in range(0, k, step):
        idx = (woffs[a : a + step, None] + ar[None, :]).reshape(-1)
        g = hw.index_select(0, idx)  # the SMs read the host pages
        lw.index_copy_(1, ids[a : a + step], g.view(-1, outer, iw).transpose(0, 1))


def scatter_from_kv(layer: torch.Tensor, ids: torch.Tensor, region: torch.Tensor, woffs: torch.Tensor, word: int) -> None:
    """Block ``ids[i]`` of ``layer`` -> region words ``woffs[i] .. + n/word``."""
    lw, hw, outer, iw = _words(layer, region, word)
    per_block = outer * iw
    ar = torch.arange(per_block, device=layer.device, dtype=torch.int64)
    k = ids.numel()
    step = _chunks(k, per_block, word).step
    for a in range(0, k, step):
        g = lw.index_select(1, ids[a : a + step]).transpose(0, 1).reshape(-1)
        idx = (woffs[a : a + step, None] + ar[None, :]).reshape(-1)
        hw.index_copy_(0, idx, g)  # the SMs write the host pages


def segments(layer: torch.Tensor, block_ids: Sequence[int] | np.ndarray, host_addrs: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """The contiguous pieces of a batch for a DMA engine: per block and per outer segment, the KV
    address and the host address (uint64 arrays), and the segment size (``inner`` bytes)."""
    outer, nb, inner = layer.shape
    ids = np.asarray(block_ids, dtype=np.uint64)
    o = np.arange(outer, dtype=np.uint64)
    kv = np.uint64(layer.data_ptr()) + (o[None, :] * np.uint64(nb) + ids[:, None]) * np.uint64(inner)
    host = np.asarray(host_addrs, dtype=np.uint64)[:, None] + o[None, :] * np.uint64(inner)
    return kv.ravel(), host.ravel(), inner
