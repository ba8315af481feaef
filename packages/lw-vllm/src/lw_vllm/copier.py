"""A torch ``Copier`` (lw_core.copier protocol) over the KV cache tensors vLLM hands the connector.

A block of one layer is moved whole, as opaque bytes: its geometry comes from the tensor, never
from the attention backend (GQA on CPU is ``[num_blocks, kv_heads, block_size, 2*head_dim]``, MLA
``[num_blocks, 1, block_size, 576]``, flash-attention ``[2, num_blocks, ...]``). Each layer is
viewed as bytes ``[outer, num_blocks, inner]``: a block is ``outer`` segments of ``inner`` bytes
(one segment on CPU, two (K and V) for ``[2, num_blocks, ...]`` layouts).

CPU: copies run synchronously in the calling (transfer) thread through numpy, which releases the
GIL for the memcpy; tokens are ``None``. Devices (cuda, npu, ...): copies run on one side stream
created with torch's device-agnostic ``torch.Stream`` / ``torch.Event`` API; tokens are events and
``wait`` polls them against a deadline (``Event.synchronize`` has none). ``torch_npu`` is imported
only when the KV cache lives on an NPU.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

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


class TorchCopier:
    """``Copier`` over per-layer KV tensors (index = layer index in the pool object)."""

    def __init__(self, kv_layers: Sequence[torch.Tensor], num_blocks: int):
        if not kv_layers:
            raise ValueError("TorchCopier: kv_layers must hold at least one layer tensor")
        self.layers = [block_bytes_view(t, num_blocks) for t in kv_layers]
        self.num_blocks = num_blocks
        self.device = kv_layers[0].device
        for i, t in enumerate(kv_layers):
            if t.device != self.device:
                raise ValueError(f"TorchCopier: layer {i} is on {t.device}, layer 0 on {self.device}")
        self.on_host = self.device.type == "cpu"
        # Host: numpy views of the same memory (copies release the GIL, per-block slicing is cheap).
        self._np = [lay.numpy() for lay in self.layers] if self.on_host else None
        self._stream = None if self.on_host else _new_stream(self.device)

    # --- helpers ---
    def _layer(self, layer: int) -> torch.Tensor:
        if not 0 <= layer < len(self.layers):
            raise IndexError(f"TorchCopier: layer={layer} out of range; accepted 0..{len(self.layers) - 1}")
        return self.layers[layer]

    def _check(self, block_ids: Sequence[int], bufs: Sequence[Buffer], what: str) -> None:
        if len(block_ids) != len(bufs):
            raise ValueError(f"TorchCopier: {len(block_ids)} block ids but {len(bufs)} {what}")
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise IndexError(f"TorchCopier: block id {b} out of range; accepted 0..{self.num_blocks - 1}")

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
        lay = self._layer(layer)
        self._check(block_ids, srcs, "srcs")
        if self.on_host:
            arr = self._np[layer]  # type: ignore[index]
            for b, s in zip(block_ids, srcs):
                np.copyto(arr[:, b], self._host_bytes(s, layer, b))
            return None
        host = torch.from_numpy(np.stack([self._host_bytes(s, layer, b) for b, s in zip(block_ids, srcs)], axis=1))
        idx = torch.tensor(list(block_ids), dtype=torch.long)
        with self._stream:  # type: ignore[union-attr]
            dev = host.to(self.device, non_blocking=False)
            lay.index_copy_(1, idx.to(self.device), dev)
            return self._record()

    def from_kv(self, layer: int, block_ids: Sequence[int], dsts: Sequence[Buffer], after: Token = None) -> Token:
        lay = self._layer(layer)
        self._check(block_ids, dsts, "dsts")
        if self.on_host:
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
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        with self._stream:  # type: ignore[union-attr]
            if after is not None:
                self._stream.wait_event(after)  # type: ignore[union-attr]
            gathered = lay.index_select(1, idx).transpose(0, 1).contiguous().cpu()  # host copy: syncs this stream only
        for i, d in enumerate(dsts):
            out = np.frombuffer(d, dtype=np.uint8)
            np.copyto(out.reshape(lay.shape[0], lay.shape[2]), gathered[i].numpy())
        return None

    def compute_event(self) -> Token:
        if self.on_host:
            return None
        ev = torch.Event(device=self.device)
        ev.record(torch.accelerator.current_stream(self.device))
        return ev

    def wait(self, token: Token, timeout_s: float) -> bool:
        if token is None:
            return True
        deadline = time.monotonic() + timeout_s
        delay = 1e-5
        while not token.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        return True

    def make_visible(self, token: Token) -> None:
        if token is not None:
            torch.accelerator.current_stream(self.device).wait_event(token)

    def _record(self) -> Token:
        ev = torch.Event(device=self.device)
        ev.record(self._stream)
        return ev


def _new_stream(device: torch.device) -> Any:
    if device.type == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the npu device with torch)
        except ImportError as e:  # pragma: no cover - only on Ascend
            raise RuntimeError("KV cache is on an NPU but torch_npu is not installed") from e
    return torch.Stream(device=device)
