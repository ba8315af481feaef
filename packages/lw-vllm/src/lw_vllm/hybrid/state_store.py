"""Worker side of recurrent-state objects (``state_layout``): copy one request's state (every state
layer, one block each) to the pool after a chunk boundary, and back into the block vLLM allocated
for a restored state.

State layers have no per-layer connector hooks (vLLM calls ``save_kv_layer`` and
``wait_for_layer_load`` from attention layers only), so a state is copied whole. Loaded before the
request's first forward, on a thread of its own beside the receive of the chunks (``state_loads``:
a hybrid's load is asynchronous, vLLM parks the request until the workers report it). Saved in
``wait_for_save`` of the step whose forward wrote it (vLLM hands the boundary off in that step's
scheduler output; without speculative decoding each state layer's forward writes its state in
place into the boundary's block, after ``preprocess_mamba`` copied the running state there), one
object of ``StateLayout.nbytes`` per boundary: split per layer at ``save_kv_layer`` it would do the
same copies on the forward thread between layers (on a GPU with a stream sync per layer), and
hybrids finish their saves in their step, before vLLM may hand the block to another request.

Neither direction lets a late pool call touch the KV cache: a save copies the block's state first
(``snapshot``) and writes that copy (``put``), a load reads into buffers of its own (``fetch``) and
copies them into the block (``land``) only if its deadline has not passed (``state_loads``,
``recurrent_states``: the pool calls run on threads of their own under the chunks' deadlines).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from lw_core.backend import BackendError
from lw_core.keys import KeySpace
from lw_vllm.hybrid.state_layout import StateLayout

log = logging.getLogger(__name__)


class StateStore:
    """``kv_caches``: vLLM's per-layer caches; a state layer's entry is its list of state tensors,
    each ``[num_blocks, ...]`` (one row per block), or one tensor whose row is a block's whole state
    (vLLM's CPU build: ``[num_blocks, 1, 1, state bytes]``)."""

    def __init__(self, backend: Any, keyspace: KeySpace, tag: str, layout: StateLayout,
                 kv_caches: dict[str, Any], num_blocks: int) -> None:
        self.backend, self.keyspace, self.tag, self.layout = backend, keyspace, tag, layout
        self.tensors: list[list[Any]] = []
        for name, want in zip(layout.layers, layout.tensor_nbytes):
            entry = kv_caches.get(name)
            if entry is None:
                raise NotImplementedError(f"LayerwiseStoreConnector: no state tensors for layer {name}")
            ts = list(entry) if isinstance(entry, (list, tuple)) else [entry]
            got = tuple(int(t[0].numel()) * t.element_size() for t in ts)
            # One tensor per state (conv, ssm, ...), or one tensor of each block's state bytes.
            if (got != want and got != (sum(want),)) or any(t.shape[0] < num_blocks for t in ts):
                raise NotImplementedError(
                    f"LayerwiseStoreConnector: layer {name}'s state tensors hold {got} bytes per block "
                    f"({[tuple(t.shape) for t in ts]}), the KV cache spec says {want}; this state layout is not "
                    "supported")
            self.tensors.append(ts)
        self.offsets: list[int] = []
        off = 0
        for ts in self.tensors:
            for t in ts:
                self.offsets.append(off)
                off += int(t[0].numel()) * t.element_size()

    def _rows(self, blocks: Sequence[int]) -> list[Any]:
        """Per state tensor (in object order), its row for this request's block."""
        by_group = dict(zip(self.layout.group_ids, blocks))
        return [t[by_group[g]] for g, ts in zip(self.layout.groups, self.tensors) for t in ts]

    def save(self, chunk_hash: bytes, blocks: Sequence[int]) -> str:
        """Write the state in ``blocks`` (one per state group) under the boundary chunk's hash:
        "saved", "present" (the pool has it), or "failed" (logged; a later request misses it)."""
        return self.put(chunk_hash, self.snapshot(blocks))

    def snapshot(self, blocks: Sequence[int]) -> list[np.ndarray]:
        """A copy of the state in ``blocks``, per state tensor: what ``put`` writes, whenever it
        runs (the blocks may belong to another request once the step ended)."""
        import torch

        return [r.contiguous().view(torch.uint8).reshape(-1).cpu().numpy().copy() for r in self._rows(blocks)]

    def put(self, chunk_hash: bytes, srcs: Sequence[np.ndarray]) -> str:
        """Write a ``snapshot`` under the boundary chunk's hash (``save``'s outcomes)."""
        key = self.keyspace.key(self.tag, chunk_hash)
        try:
            (h,) = self.backend.reserve([key], self.layout.nbytes)
        except BackendError as e:
            log.warning("lw-vllm: state save %s not reserved: %s", key, e)
            return "failed"
        if h is None:
            return "present"
        try:
            self.backend.write([h] * len(srcs), self.offsets, list(srcs))
            self.backend.commit([h])
        except Exception as e:
            log.warning("lw-vllm: state save %s failed (not published): %s", key, e)
            try:
                self.backend.abort([h])
            except BackendError:
                pass
            return "failed"
        return "saved"

    def load(self, chunk_hash: bytes, blocks: Sequence[int]) -> str | None:
        """Read the boundary's state into ``blocks``; ``None`` when it landed, else why not."""
        got = self.fetch(chunk_hash)
        if isinstance(got, str):
            return got
        self.land(blocks, got)
        return None

    def fetch(self, chunk_hash: bytes) -> list[np.ndarray] | str:
        """The boundary's state, per state tensor, read into buffers of its own (never into the KV
        cache: a read that returns late must not land); else why not."""
        key = self.keyspace.key(self.tag, chunk_hash)
        try:
            (h,) = self.backend.open([key])
        except BackendError as e:
            return f"open failed: {e}"
        if h is None:
            return "state object missing"
        try:
            bufs = [np.empty(n, dtype=np.uint8) for ts in self.tensors
                    for n in (int(t[0].numel()) * t.element_size() for t in ts)]
            self.backend.read([h] * len(bufs), self.offsets, bufs)
        except Exception as e:
            return f"read failed: {e}"
        finally:
            try:
                self.backend.release([h])
            except BackendError:
                pass
        return bufs

    def land(self, blocks: Sequence[int], bufs: Sequence[np.ndarray]) -> None:
        """Copy a ``fetch``'s buffers into ``blocks`` (one per state group)."""
        import torch

        for r, b in zip(self._rows(blocks), bufs):
            r.copy_(torch.from_numpy(b).view(r.dtype).reshape(r.shape))
