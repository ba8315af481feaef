"""A torch ``Copier`` (lw_core.pipeline.copier protocol) over the KV cache tensors vLLM hands the connector.

A block of one layer is moved whole, as opaque bytes: its geometry comes from the tensor, never
from the attention backend (GQA on CPU is ``[num_blocks, kv_heads, block_size, 2*head_dim]``, MLA
``[num_blocks, 1, block_size, 576]``, flash-attention ``[2, num_blocks, ...]``). Each layer is
viewed as bytes ``[outer, num_blocks, inner]``: a block is ``outer`` segments of ``inner`` bytes
(one segment on CPU, two (K and V) for ``[2, num_blocks, ...]`` layouts). The bytes are moved
as they lie, so their order of heads and tokens is the engine's layout's (``block_order`` reads it
from the strides: head-major on CPU, token-major under CUDA's default); the keys and the TP split
depend on it (``lw_vllm.identity.kv_layout``).

CPU: copies run synchronously in the calling (transfer) thread through numpy, which releases the
GIL for the memcpy; tokens are ``None``. Devices (cuda, npu, ...): ``lw_vllm.device.device_path`` --
asynchronous copies on side streams ordered by events against the compute stream, straight
between registered pool memory and the KV blocks (``register_host``; ``mechanism``: the
``device_copy_mechanism`` key, ``lw_vllm.device.direct_path``) or else through pinned staging; tokens are
events. This module imports torch and numpy only (no vLLM), so a machine with
a device and torch but no vLLM can run the device path and its tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lw_core.pipeline.buffers import aligned_empty
from lw_vllm.device.device_path import DevicePath
from lw_vllm.device.device_streams import DeviceOps, TorchDeviceOps
from lw_vllm.device.direct_path import check_mechanism

Buffer = Any
Token = Any


def _dense_order(t: torch.Tensor) -> torch.Tensor:
    """The same memory as a contiguous tensor (undoing a stride-order permutation), or raise."""
    if t.is_contiguous():
        return t
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    p = t.permute(order)
    if not p.is_contiguous():
        raise NotImplementedError(
            f"KV cache tensor of shape {tuple(t.shape)} and strides {t.stride()} is not a dense "
            "layout; LayerwiseStoreConnector moves blocks as contiguous bytes"
        )
    return p


def block_bytes_view(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """View one layer's KV cache as uint8 ``[outer, num_blocks, inner]`` (a block = ``outer``
    segments of ``inner`` bytes). ``num_blocks`` is the scheduler's block count; a kernel that
    splits a block into several smaller ones (dim size a multiple of it) is handled, since those
    pieces are adjacent in memory."""
    if num_blocks <= 0:
        raise ValueError(f"num_blocks={num_blocks} must be > 0")
    d = _dense_order(t)
    shape = list(d.shape)
    # [2, num_blocks, ...] (K/V outermost) vs [num_blocks, ...]: prefer the block dim that is not a
    # K/V pair; only 0 or 1 can be the block dim in vLLM's layouts.
    candidates = [i for i in (0, 1) if i < len(shape) and shape[i] % num_blocks == 0]
    if len(candidates) == 2:
        candidates = [1] if shape[0] == 2 else [0]
    if not candidates:
        raise NotImplementedError(
            f"cannot find the block dimension ({num_blocks} blocks) in a KV cache tensor of shape {tuple(t.shape)}"
        )
    bd = candidates[0]
    outer = int(np.prod(shape[:bd], dtype=np.int64)) if bd else 1
    total = d.numel() * d.element_size()
    inner = total // (outer * num_blocks)
    if outer * num_blocks * inner != total:
        raise NotImplementedError(f"KV cache tensor of shape {tuple(t.shape)} does not split into {num_blocks} blocks")
    return d.reshape(-1).view(torch.uint8).view(outer, num_blocks, inner)


def block_order(t: torch.Tensor, num_blocks: int) -> str:
    """How heads and tokens are ordered in the bytes ``TorchCopier`` moves for one block of ``t``,
    read from the strides of vLLM's per-layer view ``[blocks, heads, tokens, content]`` (vLLM 0.32
    hands every attention layer's KV over so, whatever the physical layout).

    Returns ``lw_core.block_order``'s ``HEAD_MAJOR`` ("HN"), ``TOKEN_MAJOR`` ("NH") or ``ONE_HEAD``
    ("N"), or, for blocks that are neither, the physical order of their dims: "S" for a kernel's
    smaller blocks (several per block, each head-major: "SHN"), "C" where the content is not
    innermost. A block is seen as ``block_bytes_view`` cuts it: the dims outside the block dim,
    then the block dim's kernel blocks, then the dims inside it."""
    if t.dim() != 4:
        raise ValueError(f"KV cache tensor of shape {tuple(t.shape)} is not vLLM's [blocks, heads, tokens, content]")
    blocks, heads, tokens, content = t.shape
    if num_blocks <= 0 or blocks % num_blocks:
        raise ValueError(f"KV cache tensor of shape {tuple(t.shape)} does not hold num_blocks={num_blocks} blocks")
    sizes = {"S": blocks // num_blocks, "H": heads, "N": tokens, "C": content}
    strides = dict(zip("SHNC", t.stride()))
    # Physical order, outermost first; a dim of size 1 has no place in the bytes.
    dims = sorted((d for d in "SHNC" if sizes[d] > 1 or d == "C"), key=lambda d: -strides[d])
    order = "".join(dims).replace("SN", "N")  # kernel blocks right outside the tokens: just more tokens
    return order[:-1] if order.endswith("C") else order


class TorchCopier:
    """``Copier`` over per-layer KV tensors (index = layer index in the pool object).

    ``ops`` replaces the device operations (tests drive the device path with CPU tensors through
    a recording fake); ``copy_timeout_s`` bounds a save into pageable memory on a device;
    ``mechanism`` picks how batches in registered pool memory move (``lw_vllm.device.direct_path``).
    """

    def __init__(self, kv_layers: Sequence[torch.Tensor], num_blocks: int, *, ops: DeviceOps | None = None,
                 copy_timeout_s: float = 10.0, mechanism: str = "auto"):
        check_mechanism(mechanism)
        if not kv_layers:
            raise ValueError("TorchCopier: kv_layers must hold at least one layer tensor")
        self.layers = [block_bytes_view(t, num_blocks) for t in kv_layers]
        self.num_blocks = num_blocks
        self.device = kv_layers[0].device
        for i, t in enumerate(kv_layers):
            if t.device != self.device:
                raise ValueError(f"TorchCopier: layer {i} is on {t.device}, layer 0 on {self.device}")
        self.on_host = self.device.type == "cpu" and ops is None
        # Host: numpy views of the same memory (copies release the GIL, per-block slicing is cheap).
        self._np = [lay.numpy() for lay in self.layers] if self.on_host else None
        self.dev: DevicePath | None = None
        if not self.on_host:
            self.dev = DevicePath(self.layers, ops or TorchDeviceOps(self.device), copy_timeout_s, mechanism)

    # --- helpers ---
    def _layer(self, layer: int) -> torch.Tensor:
        if not 0 <= layer < len(self.layers):
            raise IndexError(f"TorchCopier: layer={layer} out of range; accepted 0..{len(self.layers) - 1}")
        return self.layers[layer]

    def _check(self, block_ids: Sequence[int], bufs: Sequence[Buffer], what: str) -> None:
        if len(block_ids) != len(bufs):
            raise ValueError(f"TorchCopier: {len(block_ids)} block ids but {len(bufs)} {what}")
        ids = np.asarray(block_ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            b = next(int(b) for b in ids if not 0 <= b < self.num_blocks)
            raise IndexError(f"TorchCopier: block id {b} out of range; accepted 0..{self.num_blocks - 1}")

    def _check_sizes(self, layer: int, block_ids: Sequence[int], bufs: Sequence[Buffer]) -> None:
        n = self.block_nbytes(layer)
        for b, buf in zip(block_ids, bufs):
            size = memoryview(buf).nbytes
            if size != n:
                raise ValueError(f"TorchCopier: buffer for block {b} of layer {layer} has {size} bytes, expected {n}")

    def _host_bytes(self, buf: Buffer, layer: int, b: int) -> np.ndarray:
        a = np.frombuffer(buf, dtype=np.uint8)
        n = self.block_nbytes(layer)
        if a.size != n:
            raise ValueError(f"TorchCopier: buffer for block {b} of layer {layer} has {a.size} bytes, expected {n}")
        lay = self.layers[layer]
        return a.reshape(lay.shape[0], lay.shape[2])

    # --- Copier protocol ---
    def block_nbytes(self, layer: int) -> int:
        lay = self._layer(layer)
        return lay.shape[0] * lay.shape[2]

    def kv_views(self, layer: int, block_ids: Sequence[int]) -> list[memoryview] | None:
        lay = self._layer(layer)
        if not self.on_host or lay.shape[0] != 1:
            return None
        arr = self._np[layer][0]  # type: ignore[index]
        self._check(block_ids, block_ids, "block ids")
        return [memoryview(arr[b]) for b in block_ids]

    def to_kv(self, layer: int, block_ids: Sequence[int], srcs: Sequence[Buffer]) -> Token:
        self._layer(layer)
        self._check(block_ids, srcs, "srcs")
        if self.dev is not None:
            self._check_sizes(layer, block_ids, srcs)
            return self.dev.to_kv(layer, block_ids, srcs, self.block_nbytes(layer)) if block_ids else None
        arr = self._np[layer]  # type: ignore[index]
        for b, s in zip(block_ids, srcs):
            np.copyto(arr[:, b], self._host_bytes(s, layer, b))
        return None

    def from_kv(self, layer: int, block_ids: Sequence[int], dsts: Sequence[Buffer], after: Token = None) -> Token:
        lay = self._layer(layer)
        self._check(block_ids, dsts, "dsts")
        if self.dev is not None:
            self._check_sizes(layer, block_ids, dsts)
            return self.dev.from_kv(layer, block_ids, dsts, self.block_nbytes(layer), after) if block_ids else None
        arr = self._np[layer]  # type: ignore[index]
        for b, d in zip(block_ids, dsts):
            out = np.frombuffer(d, dtype=np.uint8)
            if out.size != self.block_nbytes(layer):
                raise ValueError(
                    f"TorchCopier: buffer for block {b} of layer {layer} has {out.size} bytes, "
                    f"expected {self.block_nbytes(layer)}"
                )
            np.copyto(out.reshape(lay.shape[0], lay.shape[2]), arr[:, b])
        return None

    def compute_event(self) -> Token:
        return None if self.dev is None else self.dev.compute_event()

    def wait(self, token: Token, timeout_s: float) -> bool:
        return True if token is None or self.dev is None else self.dev.wait(token, timeout_s)

    def make_visible(self, token: Token) -> None:
        if token is not None and self.dev is not None:
            self.dev.make_visible(token)

    # --- optional Copier methods (lw_core.pipeline.copier) ---
    def begin_load(self) -> None:
        """Called on the forward thread when a step's loads start: order them after the compute
        stream's work so far (device); nothing on the CPU."""
        if self.dev is not None:
            self.dev.begin_load()

    def register_host(self, buffers: Sequence[Buffer]) -> None:
        """Register the pool's host memory (a backend's ``host_regions()``) with the device, once per
        range, so batches in it are copied directly; nothing on the CPU. A failure is logged and
        counted (``register_failures``) and leaves those batches on the staged path."""
        if self.dev is not None:
            self.dev.register(buffers)

    @property
    def by_address(self) -> bool:
        """Whether this copier may move batches by address at all (a device, a direct mechanism):
        on the CPU the pipeline then never asks a backend for addresses."""
        return self.dev is not None and self.dev.direct.mechanism != "staged"

    def addressable(self, layer: int, addrs: Any) -> bool:
        """Whether pool windows of ``layer`` at these host addresses (a backend's
        ``view_addresses``) can be copied by address (``to_kv_at``/``from_kv_at``): registered
        memory on a device, and a direct mechanism."""
        return self.dev is not None and self.dev.direct.addressable(addrs, self.block_nbytes(layer))

    def to_kv_at(self, layer: int, block_ids: Sequence[int], addrs: Any) -> Token:
        """``to_kv`` from pool windows given by their host addresses (see ``addressable``): no
        per-window Python object, one submission for the batch."""
        self._layer(layer)
        self._check(block_ids, addrs, "addresses")
        assert self.dev is not None, "addressable() is False on the CPU"
        return self.dev.to_kv_at(layer, block_ids, addrs, self.block_nbytes(layer)) if len(block_ids) else None

    def from_kv_at(self, layer: int, block_ids: Sequence[int], addrs: Any, after: Token = None) -> Token:
        """``from_kv`` into pool windows given by their host addresses (see ``addressable``)."""
        self._layer(layer)
        self._check(block_ids, addrs, "addresses")
        assert self.dev is not None, "addressable() is False on the CPU"
        return self.dev.from_kv_at(layer, block_ids, addrs, self.block_nbytes(layer), after) if len(block_ids) else None

    @property
    def register_failures(self) -> int:
        return 0 if self.dev is None else self.dev.direct.register_failures

    @property
    def mechanism_counts(self) -> dict[str, int]:
        """Batches moved so far per mechanism (device): kernel, batch_dma, staged."""
        return {} if self.dev is None else dict(self.dev.direct.counts)

    def close(self) -> None:
        """Unregister the pool memory (device) once the copies enqueued so far are done."""
        if self.dev is not None:
            self.dev.close()

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """Host memory for the pipeline's staging: pinned on a device (the DMA reads/writes it
        directly), page-aligned ordinary memory on the CPU."""
        if self.dev is not None:
            return self.dev.staging.host_buffer(nbytes)
        return aligned_empty(nbytes)
