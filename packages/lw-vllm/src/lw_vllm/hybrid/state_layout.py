"""Recurrent-state groups (Mamba2, gated delta-net) of a hybrid model: which layers hold a state,
how many bytes one request's state takes per layer, and the key space of state objects.

A state object holds the state of every state layer after a chunk boundary, layer after layer, each
layer's state tensors (conv, ssm, ...) in the spec's order, their rows as the engine holds them
(not the padded page). It is named like the boundary's chunk (the chunk hash chains every token up
to the boundary) in a key space of its own (``state_keyspace``), so it never meets a KV chunk; that key
space names every state tensor's shape and dtype and the state cache mode, so engines whose states
differ (``--mamba-ssm-cache-dtype`` float16 against bfloat16: the same bytes, other bits; a conv state
stored in another layout) never read each other's states.

The pool restores states only in vLLM's ``mamba_cache_mode`` "align" (prefix caching on), where
the state after ``N * block`` tokens lives in one block of its own (``restorable``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod
from typing import Any

from lw_core.keys import KeySpace, fingerprint
from lw_vllm import pool


@dataclass(frozen=True, slots=True)
class StateLayout:
    """``layers``: state layers in model order; ``groups[i]``: layer ``i``'s KV cache group;
    ``tensor_nbytes[i]``: bytes of one block's row of each of layer ``i``'s state tensors;
    ``group_ids``: the state groups in the order of a transfer's block list; ``tensors[i]``: the
    shape and dtype name of each of layer ``i``'s state tensors (one block's row); ``modes``: each
    state group's ``mamba_cache_mode``, in ``group_ids`` order."""

    layers: tuple[str, ...]
    groups: tuple[int, ...]
    tensor_nbytes: tuple[tuple[int, ...], ...]
    group_ids: tuple[int, ...]
    tensors: tuple[tuple[tuple[tuple[int, ...], str], ...], ...]
    modes: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return sum(sum(t) for t in self.tensor_nbytes)


def why_not_restorable(kv_cache_config: Any) -> str | None:
    """Why the pool cannot restore this model's states (``None``: it can)."""
    groups = kv_cache_config.kv_cache_groups
    state = pool.state_groups(kv_cache_config)
    if not state:
        return "the model has no state layers"
    bs = pool.block_size(kv_cache_config)
    for g in state:
        spec = groups[g].kv_cache_spec
        if getattr(spec, "mamba_cache_mode", "none") != "align":
            return (f"mamba_cache_mode is {getattr(spec, 'mamba_cache_mode', None)!r}, not 'align' (vLLM keeps "
                    "block-aligned states only with prefix caching on)")
        if getattr(spec, "num_speculative_blocks", 0):
            return "speculative decoding keeps extra state blocks"
        if spec.block_size != bs:
            return f"the state group's block size {spec.block_size} differs from the attention chunk {bs}"
    return None


def state_layout(kv_cache_config: Any) -> StateLayout:
    groups = kv_cache_config.kv_cache_groups
    state = pool.state_groups(kv_cache_config)
    rows = sorted(((n, g) for g in state for n in groups[g].layer_names), key=lambda r: _order(r[0]))
    nbytes, tensors = [], []
    for _, g in rows:
        spec = groups[g].kv_cache_spec
        nbytes.append(tuple(int(prod(s)) * _itemsize(d) for s, d in zip(spec.shapes, spec.dtypes)))
        tensors.append(tuple((tuple(int(n) for n in s), dtype_name(d)) for s, d in zip(spec.shapes, spec.dtypes)))
    modes = tuple(str(getattr(groups[g].kv_cache_spec, "mamba_cache_mode", "none")) for g in state)
    return StateLayout(tuple(n for n, _ in rows), tuple(g for _, g in rows), tuple(nbytes), tuple(state),
                       tuple(tensors), modes)


def _order(name: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", name))


def dtype_name(dtype: Any) -> str:
    """``bfloat16`` for ``torch.bfloat16`` (numpy dtypes and strings by their own name)."""
    return str(dtype).removeprefix("torch.")


def _itemsize(dtype: Any) -> int:
    size = getattr(dtype, "itemsize", None)
    if size is None:
        import torch

        size = torch.empty((), dtype=dtype).element_size()
    return int(size)


def state_keyspace(attn: KeySpace, layout: StateLayout) -> KeySpace:
    """The attention key space's model, with a layout of its own for state objects: the state
    tensors' shapes, dtypes and byte sizes, and the state cache mode."""
    return KeySpace(model_fp=attn.model_fp,
                    layout_fp=fingerprint(attn.layout_fp, "recurrent-state", layout.tensor_nbytes, layout.tensors,
                                          layout.modes))
