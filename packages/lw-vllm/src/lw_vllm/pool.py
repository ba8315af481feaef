"""Pool plumbing shared by the scheduler and worker parts: config, key space, rank tags, and one
backend per process (vLLM's in-process engine puts both parts in one process, and the embedded
pool is opened once per process)."""

from __future__ import annotations

import threading
from typing import Any

from lw_core.backend import Backend, open_backend
from lw_core.config import PoolConfig, parse_config
from lw_core.keys import KeySpace, rank_tag

_lock = threading.Lock()
_backends: dict[tuple, list[Any]] = {}  # key -> [backend, refcount]


def _backend_key(cfg: PoolConfig) -> tuple:
    return (cfg.backend, cfg.embedded_path, cfg.embedded_capacity_bytes, cfg.memcache_config_path)


def acquire_backend(cfg: PoolConfig) -> Backend:
    with _lock:
        k = _backend_key(cfg)
        if k not in _backends:
            _backends[k] = [open_backend(cfg), 0]
        _backends[k][1] += 1
        return _backends[k][0]


def release_backend(cfg: PoolConfig, backend: Backend) -> None:
    with _lock:
        k = _backend_key(cfg)
        entry = _backends.get(k)
        if entry is None or entry[0] is not backend:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _backends[k]
            backend.close()


def pool_config(vllm_config: Any) -> PoolConfig:
    ktc = vllm_config.kv_transfer_config
    return parse_config(dict(ktc.kv_connector_extra_config or {}))


def check_supported(vllm_config: Any, kv_cache_config: Any) -> None:
    """Refuse set-ups whose KV this connector would get wrong, at start-up."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise NotImplementedError(
            f"LayerwiseStoreConnector supports models with exactly one KV cache group; this model has "
            f"{len(groups)} (hybrid attention, e.g. sliding window + full). Run it without the connector."
        )
    pc = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(pc, name, 1) > 1:
            raise NotImplementedError(
                f"LayerwiseStoreConnector does not support context parallelism ({name}={getattr(pc, name)})"
            )
    if pc.pipeline_parallel_size > 1:
        raise NotImplementedError(
            f"LayerwiseStoreConnector does not support pipeline parallelism yet "
            f"(pipeline_parallel_size={pc.pipeline_parallel_size})"
        )


def block_size(kv_cache_config: Any) -> int:
    return kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size


def layer_names(kv_cache_config: Any) -> list[str]:
    return list(kv_cache_config.kv_cache_groups[0].layer_names)


def key_space(vllm_config: Any, kv_cache_config: Any) -> KeySpace:
    """Same on the scheduler and every worker: built from the KV cache spec, not from tensors."""
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    n_layers = len(layer_names(kv_cache_config))
    mc = vllm_config.model_config
    return KeySpace.for_model(
        model=str(mc.model),
        dtype=str(mc.dtype),
        block_size=spec.block_size,
        layer_block_bytes=[spec.page_size_bytes] * n_layers,
        kv_dtype=str(vllm_config.cache_config.cache_dtype),
        extra=(type(spec).__name__, vllm_config.parallel_config.tensor_parallel_size),
    )


def is_mla(vllm_config: Any) -> bool:
    return bool(vllm_config.model_config.use_mla)


def rank_tags(vllm_config: Any) -> list[str]:
    """Tags of every rank whose object a hit needs (MLA: one, its KV is the same on all ranks)."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    if is_mla(vllm_config):
        return [rank_tag(tp_rank=0, tp_size=tp, mla=True)]
    return [rank_tag(tp_rank=r, tp_size=tp) for r in range(tp)]


def my_rank_tag(vllm_config: Any, tp_rank: int) -> str:
    tp = vllm_config.parallel_config.tensor_parallel_size
    return rank_tag(tp_rank=tp_rank, tp_size=tp, mla=is_mla(vllm_config))
