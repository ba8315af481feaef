"""The order of heads and tokens in this engine's KV blocks, for its keys and its TP split.

vLLM 0.32 resolves one physical KV cache layout per engine, in the engine core, before the KV cache
and the connector exist (``cache_config.kv_cache_layout``, also ``KVCacheConfig.kv_cache_layout``):
a ``KVCacheLayout`` name whose letters are the physical order of the layer, block, head, token
and content dims (legacy aliases: ``HND`` = ``LBHNC``, ``NHD`` = ``LBNHC``). The CPU backend
declares ``LBHNC`` (head-major blocks); on CUDA FlashAttention and Triton declare nothing and vLLM
prefers ``LBNHC`` (token-major); FlashInfer declares ``LBHNC``/``BLHNC`` on Blackwell. This
connector states no layout of its own: it keys and splits whatever the engine resolved.

* Keys: ``key_token`` goes into ``layout_fp``, so engines whose blocks order heads and tokens
  differently never share an object (a block of one head is the same bytes in both orders, so
  those share). The scheduler and the workers read the same resolved name, so their keys agree.
* The tensors: ``check_tensors`` (worker start-up) compares what the name promises with the
  order the copier's block views actually have (``lw_vllm.device.copier.block_order``, from strides) and
  refuses a mismatch, e.g. head-major kernel blocks smaller than the block, which neither the
  keys nor the split describe.
* The TP split reads the order (``lw_core.tp_split``): token-major blocks are read per token row.

``BLHNC``, ``BLNHC`` and ``BHLNC`` interleave the layers inside each block, so a layer's view is not
dense; ``TorchCopier`` refuses those at start-up.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lw_core.block_order import HEAD_MAJOR, ONE_HEAD, ORDERS, TOKEN_MAJOR, canonical

LEGACY_NAMES = {"HND": "LBHNC", "NHD": "LBNHC"}
UNRESOLVED = "unresolved"


def layout_name(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """The engine's resolved KV cache layout (``None`` before vLLM resolved it, or a vLLM without it)."""
    name = getattr(getattr(vllm_config, "cache_config", None), "kv_cache_layout", None)
    name = name or getattr(kv_cache_config, "kv_cache_layout", None)
    return LEGACY_NAMES.get(str(name), str(name)) if name else None


def order_of(name: str | None) -> str | None:
    """``HEAD_MAJOR`` or ``TOKEN_MAJOR`` for a layout name (head dim outside the token dim or
    inside it), ``None`` for no name or one without both dims."""
    if not name or "H" not in name or "N" not in name:
        return None
    return HEAD_MAJOR if name.index("H") < name.index("N") else TOKEN_MAJOR


def block_order(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """This engine's block order, from its resolved layout."""
    return order_of(layout_name(vllm_config, kv_cache_config))


def key_token(order: str | None, heads: int | None) -> str:
    """What ``layout_fp`` gets for blocks of ``heads`` heads (``None``: unknown) in ``order``."""
    if order is None:
        return f"block={UNRESOLVED}"
    return f"block={canonical(order, heads) if heads else order}"


def check_tensors(order: str | None, name: str | None, found: Mapping[str, str]) -> str | None:
    """At start-up: the order of the copier's views of every layer (``found``: layer name ->
    ``lw_vllm.device.copier.block_order``) must be one, and the one the resolved layout promises
    (``order``); blocks of one head (``ONE_HEAD``) fit either. ``NotImplementedError`` otherwise,
    naming both. Returns the engine's order: ``order``, or the tensors' when the name said none."""
    orders = set(found.values())
    if len(orders) != 1:
        raise NotImplementedError(
            f"LayerwiseStoreConnector: the layers' KV blocks are ordered differently ({dict(found)}); "
            "one order per engine is supported"
        )
    (got,) = orders
    if got == ONE_HEAD:
        return order
    if order is None:
        return got if got in ORDERS else None
    if got != order:
        first = next(iter(found))
        raise NotImplementedError(
            f"LayerwiseStoreConnector: the KV cache layout {name} promises {_describe(order)} blocks, but layer "
            f"{first}'s tensor holds {_describe(got)} ones (dims outermost first: S kernel block, H head, N token, "
            "C content); the pool's keys and the TP split would misread them. Run with --block-size equal to "
            "the attention kernel's block size, or set VLLM_KV_CACHE_LAYOUT=LBNHC."
        )
    return order


def _describe(order: str) -> str:
    return {HEAD_MAJOR: "head-major", TOKEN_MAJOR: "token-major"}.get(order, f"{order!r}-ordered")
