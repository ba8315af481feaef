"""Pool plumbing shared by the scheduler and worker parts: config, key space, rank tags, and one
backend per process (vLLM's in-process engine puts both parts in one process, and the embedded
pool is opened once per process)."""

from __future__ import annotations

import re
import threading
from typing import Any

from lw_core.backend import Backend, supports_streaming
from lw_core.backends.registry import open_backend
from lw_core.config import ConfigError, PoolConfig, parse_config
from lw_core.keys import KeySpace, rank_tag
from lw_core.tp_split import can_split
from lw_vllm.identity import kv_layout
from lw_vllm.identity.engine_identity import EngineIdentity, engine_identity

_lock = threading.Lock()
_backends: dict[tuple, list[Any]] = {}  # key -> [backend, refcount]


def _backend_key(cfg: PoolConfig) -> tuple:
    return (cfg.backend, cfg.backend_keys)  # the plugin's keys struct (frozen, so hashable)


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


def close_all() -> None:
    """Close every backend this process still holds, for a process about to end without vLLM's
    shutdown (which releases them through the connector's ``shutdown``): the embedded pool's disk
    tier writes the demotions still queued (``DiskTier.close``), distributed clients disconnect."""
    with _lock:
        entries = list(_backends.values())
        _backends.clear()
    for backend, _ in entries:
        backend.close()


def check_streaming(cfg: PoolConfig, backend: Backend) -> None:
    """``pd_streaming`` needs the backend's streaming extension: refuse at start-up, naming it.
    The backend is released first (the engine does not start)."""
    if cfg.pd_streaming and not supports_streaming(backend):
        release_backend(cfg, backend)
        raise ConfigError(
            f"kv_connector_extra_config.pd_streaming=true needs a backend with the streaming extension "
            f"(publish, open_streaming, wait_published), and backend {getattr(backend, 'name', cfg.backend)!r} "
            "does not have it; "
            "use backend 'embedded', 'memcache' or 'mooncake', or set pd_streaming to false"
        )


def pool_config(vllm_config: Any) -> PoolConfig:
    ktc = vllm_config.kv_transfer_config
    return parse_config(dict(ktc.kv_connector_extra_config or {}))


def _kinds(spec: Any) -> set[str]:
    """Class names of ``spec`` and its bases (vLLM's spec classes, or test doubles named alike)."""
    return {c.__name__ for c in type(spec).__mro__}


def is_state_spec(spec: Any) -> bool:
    """A recurrent-state group (Mamba2, gated delta-net, short conv): one state per request."""
    return "MambaSpec" in _kinds(spec)


def is_window_spec(spec: Any) -> bool:
    return "SlidingWindowSpec" in _kinds(spec)


def is_full_spec(spec: Any) -> bool:
    return "FullAttentionSpec" in _kinds(spec) and not is_window_spec(spec)


def anchor_group(kv_cache_config: Any) -> int:
    """The group whose block ids name a request's chunks: the first full-attention group (its
    blocks are never null, so they are unique among live requests). A single group is its own."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) == 1:
        return 0
    for i, g in enumerate(groups):
        if is_full_spec(g.kv_cache_spec):
            return i
    raise NotImplementedError("LayerwiseStoreConnector needs one full-attention layer group in a hybrid model")


def state_groups(kv_cache_config: Any) -> list[int]:
    return [i for i, g in enumerate(kv_cache_config.kv_cache_groups) if is_state_spec(g.kv_cache_spec)]


def check_supported(vllm_config: Any, kv_cache_config: Any) -> None:
    """Refuse set-ups whose KV this connector would get wrong, at start-up."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) > 1:
        odd = [type(g.kv_cache_spec).__name__ for g in groups
               if not (is_full_spec(g.kv_cache_spec) or is_window_spec(g.kv_cache_spec) or is_state_spec(g.kv_cache_spec))]
        if odd:
            raise NotImplementedError(
                f"LayerwiseStoreConnector: KV cache group kinds {sorted(set(odd))} are not supported in a hybrid "
                "model; supported: full attention (GQA, MLA), sliding window, Mamba/linear-attention state")
        anchor_group(kv_cache_config)
        # State groups may size their blocks apart (the pool then leaves them alone: state_layout).
        attn = [g for g in groups if not is_state_spec(g.kv_cache_spec)]
        sizes = {g.kv_cache_spec.block_size for g in attn}
        pages = {g.kv_cache_spec.page_size_bytes for g in attn}
        if len(pages) != 1:
            raise NotImplementedError(
                f"LayerwiseStoreConnector: the model's attention groups have different page sizes {sorted(pages)}")
        if len(sizes) != 1:
            raise NotImplementedError(
                f"LayerwiseStoreConnector: the model's KV cache groups have different block sizes {sorted(sizes)}; "
                "a pool chunk is one block of every group")
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


def saves_in_background(cfg: PoolConfig, kv_role: str, kv_cache_config: Any) -> bool:
    """Whether a step's saves finish in the background (``save_in_background``): kv_both only (a PD
    decoder depends on the prefiller's commit), not streaming PD, and one KV cache group (vLLM frees
    a sliding window's blocks while the request runs, so a late save could read reused blocks).
    The scheduler and every worker decide it alike: it says which finished requests free late."""
    return (cfg.save_in_background and kv_role == "kv_both" and not cfg.pd_streaming
            and len(kv_cache_config.kv_cache_groups) == 1)


def block_size(kv_cache_config: Any) -> int:
    return kv_cache_config.kv_cache_groups[anchor_group(kv_cache_config)].kv_cache_spec.block_size


def _layer_order(name: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", name))


def layer_names(kv_cache_config: Any) -> list[str]:
    """The attention layers a pool object holds, in the model's order (a hybrid's state layers are
    not among them: ``state_groups``). One group: that group's order, as vLLM lists it."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) == 1:
        return list(groups[0].layer_names)
    names = [n for g in groups if not is_state_spec(g.kv_cache_spec) for n in g.layer_names]
    return sorted(names, key=_layer_order)


def layer_groups(kv_cache_config: Any) -> dict[str, int]:
    """Each attention layer's KV cache group."""
    return {n: i for i, g in enumerate(kv_cache_config.kv_cache_groups) if not is_state_spec(g.kv_cache_spec)
            for n in g.layer_names}


def key_space(vllm_config: Any, kv_cache_config: Any, cfg: PoolConfig, tp_size: int | None = None) -> KeySpace:
    """Same on the scheduler and every worker: built from the KV cache spec, not from tensors, and
    from the model's identity (``model_id``, else its config and weights, plus the engine settings
    that change the KV: ``engine_identity``), not its path.
    ``tp_size``: the key space an engine of this model at that TP size uses (``None``: this one's);
    GQA ranks hold ``kv_heads / tp`` heads each, so their pages scale with it. MLA's keys carry no
    TP size: every rank holds the same latent KV, so engines at any TP size share its objects.
    ``layout_fp`` also holds the order of heads and tokens in a block (``kv_layout.key_token``,
    from vLLM's resolved layout): engines whose blocks differ so never share an object."""
    # A hybrid's objects hold its attention layers in model order, each block as the engine holds
    # it: the same bytes as the model run with HMA off (one group), so both share objects.
    spec = kv_cache_config.kv_cache_groups[anchor_group(kv_cache_config)].kv_cache_spec
    n_layers = len(layer_names(kv_cache_config))
    mc = vllm_config.model_config
    own_tp = vllm_config.parallel_config.tensor_parallel_size
    tp = own_tp if tp_size is None else tp_size
    page = spec.page_size_bytes
    if tp != own_tp and not is_mla(vllm_config):
        total = total_kv_heads(vllm_config)
        if total is None:  # unknown: each rank's share scales with 1 / tp
            page = page * own_tp // tp
        else:
            page = page // kv_heads_per_rank(total, own_tp) * kv_heads_per_rank(total, tp)
    ident = identity(vllm_config, cfg)
    return KeySpace.for_model(
        model="|".join(ident.parts()),
        dtype=str(mc.dtype),
        block_size=spec.block_size,
        layer_block_bytes=[page] * n_layers,
        kv_dtype=str(vllm_config.cache_config.cache_dtype),
        extra=(type(spec).__name__, "tp-any" if is_mla(vllm_config) else tp,
               kv_layout.key_token(kv_layout.block_order(vllm_config, kv_cache_config), heads_per_rank(vllm_config, tp))),
    )


def identity(vllm_config: Any, cfg: PoolConfig) -> EngineIdentity:
    """What the model fingerprint of this engine's keys is made of (``engine_identity``)."""
    return engine_identity(vllm_config, cfg.model_id)


def total_kv_heads(vllm_config: Any) -> int | None:
    get = getattr(vllm_config.model_config, "get_total_num_kv_heads", None)
    return int(get()) if callable(get) else None


def heads_per_rank(vllm_config: Any, tp: int) -> int | None:
    """KV heads in one rank's blocks at TP ``tp`` (MLA: its one latent head); ``None`` when unknown."""
    if is_mla(vllm_config):
        return 1
    total = total_kv_heads(vllm_config)
    return None if total is None else kv_heads_per_rank(total, tp)


def kv_heads_per_rank(total: int, tp: int) -> int:
    """vLLM's split: ``total / tp`` heads per rank, one replicated head when ``tp`` exceeds them."""
    return max(1, total // tp)


def readable_tp_sizes(vllm_config: Any, sizes: tuple[int, ...]) -> list[int]:
    """The TP sizes among ``sizes`` (other than this engine's) whose GQA KV this engine reads by
    head ranges (``lw_core.tp_split``): both sizes divide the model's kv heads. None for MLA (its
    keys carry no TP size) or when the head count is unknown."""
    own = vllm_config.parallel_config.tensor_parallel_size
    total = total_kv_heads(vllm_config)
    if is_mla(vllm_config) or total is None:
        return []
    return [tp for tp in sizes if tp != own and can_split(total, tp, own)]


def tp_mismatch(vllm_config: Any, other_tp: int) -> str:
    """Why KV saved at ``other_tp`` is not read by this engine (for logs)."""
    own = vllm_config.parallel_config.tensor_parallel_size
    total = total_kv_heads(vllm_config)
    why = (f"it was saved by an engine at tensor_parallel_size={other_tp} and this engine runs "
           f"tensor_parallel_size={own}")
    if total is None:
        return f"{why}; the model's kv head count is unknown, so this engine does not read across TP sizes"
    if not can_split(total, other_tp, own):
        return (f"{why}; the model's {total} kv heads do not divide evenly by both sizes, so this combination "
                f"cannot share KV: run the prefiller and the decoder at sizes that divide {total}")
    return (f"{why}; this engine reads KV across TP sizes, but not every saver rank's object of the prompt is "
            f"in the pool (a save failed or was evicted)")


def is_mla(vllm_config: Any) -> bool:
    return bool(vllm_config.model_config.use_mla)


def rank_tags(vllm_config: Any, tp_size: int | None = None) -> list[str]:
    """Tags of every rank whose object a hit needs (MLA: one, its KV is the same on all ranks);
    ``tp_size``: an engine of this model at that TP size (``None``: this one)."""
    tp = vllm_config.parallel_config.tensor_parallel_size if tp_size is None else tp_size
    if is_mla(vllm_config):
        return [rank_tag(tp_rank=0, tp_size=tp, mla=True)]
    return [rank_tag(tp_rank=r, tp_size=tp) for r in range(tp)]


def my_rank_tag(vllm_config: Any, tp_rank: int) -> str:
    tp = vllm_config.parallel_config.tensor_parallel_size
    return rank_tag(tp_rank=tp_rank, tp_size=tp, mla=is_mla(vllm_config))
