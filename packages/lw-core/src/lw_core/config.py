"""The connector's ``kv_connector_extra_config``, parsed strictly.

``PoolConfig`` holds every key of the seed's parameter table (with the seed's defaults) plus our
own options; each backend plugin (``lw_core.backends.registry``) brings a Struct of its own keys
(``embedded_*``, ``memcache_*``), given at the same top level and parsed into
``PoolConfig.backend_keys``. Parsing is strict: an unknown key, a wrong type or an out-of-range
value raises ``ConfigError`` naming the key, the value given and what is accepted (read from the
fields' types and ``Meta`` with ``msgspec.inspect``), so a typo fails vLLM at start-up instead of
being silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from lw_core.backends import registry
from lw_core.backends.embedded_defaults import MAX_CAPACITY_BYTES, default_embedded_path
from lw_core.metaserver_allow import ENTRY_FORM, MetaserverAllowList
from lw_core.validation import convert_strict

KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
LOAD_FAILURE_POLICIES = ("recompute", "fail")


class ConfigError(ValueError):
    """A bad ``kv_connector_extra_config``; the message names the key and the accepted values."""


# Upper bounds: far above any real deployment, low enough that nothing later overflows, sleeps
# for ages or allocates absurd amounts. Written once, on the fields: msgspec enforces them and
# ``lw_core.validation`` names the key, the value and the accepted range (read from the ``Meta``).
MAX_TIMEOUT_S = 86400.0  # one day
MAX_PREFETCH_LAYERS = 1024  # more layers than any model has
MAX_TRANSFER_BLOCKS = 1 << 20
MAX_TRANSFER_BYTES = 1 << 40  # 1 TiB
MAX_STAGGER_US = 1_000_000  # 1 s per rank step
MAX_STREAM_RECV_THREADS = 256
MAX_ALLOWED_METASERVERS = 64
MAX_METASERVER_CONNECTIONS = 65536

# Field types shared with LayerPipeline's arguments (lw_core.pipeline.context.PipelineLimits).
Seconds = Annotated[float, Meta(gt=0, le=MAX_TIMEOUT_S)]
PrefetchLayers = Annotated[int, Meta(ge=1, le=MAX_PREFETCH_LAYERS)]
TransferBlocks = Annotated[int, Meta(ge=0, le=MAX_TRANSFER_BLOCKS)]
TransferBytes = Annotated[int, Meta(ge=0, le=MAX_TRANSFER_BYTES)]
StaggerUs = Annotated[int, Meta(ge=0, le=MAX_STAGGER_US)]
RecvThreads = Annotated[int, Meta(ge=1, le=MAX_STREAM_RECV_THREADS)]
# pd_allowed_metaservers: URLs (checked by lw_core.metaserver_allow), a handful per engine.
AllowedMetaservers = Annotated[
    tuple[Annotated[str, Meta(min_length=1, max_length=2048)], ...], Meta(max_length=MAX_ALLOWED_METASERVERS)
]
MetaserverConnections = Annotated[int, Meta(ge=1, le=MAX_METASERVER_CONNECTIONS)]
# An operator's name for the model's identity in pool keys (lw_vllm.identity.model_identity).
ModelId = Annotated[str, Meta(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")]

# Said after the accepted range in error messages.
_NOTES = {
    "layerwise_max_transfer_blocks": "0 = unlimited",
    "layerwise_max_transfer_bytes": "0 = unlimited",
    "h2d_stagger_us": "0 = off",
    "layerwise_prefetch_layers": "typical: 1-4",
    "stream_recv_threads": "typical: 2-8",
    "pd_allowed_metaservers": f"each {ENTRY_FORM}; null = loopback proxies only",
    "pd_metaserver_max_connections": "metaserver calls open at once; more wait for a connection",
    "model_id": "1-200 characters: letters, digits and . _ : / @ + -, starting with a letter or digit",
}
__all__ = ["ConfigError", "PoolConfig", "default_embedded_path", "known_keys", "parse_config", "MAX_CAPACITY_BYTES"]


class PoolConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # --- the seed's table ---
    use_layerwise: bool = False
    backend: str = "embedded"
    mooncake_rpc_port: str = "0"
    layerwise_prefetch_layers: PrefetchLayers = 1
    layerwise_max_transfer_blocks: TransferBlocks = 0
    layerwise_max_transfer_bytes: TransferBytes = 0
    h2d_stagger_us: StaggerUs = 0
    # None = the seed's mode-dependent default: true in bulk mode, false in layerwise mode.
    discard_partial_chunks: bool | None = None
    consumer_is_to_put: bool = False
    consumer_is_to_load: bool = False
    # A kv_producer (PD prefiller) looks pool prefixes up and loads them instead of recomputing.
    producer_is_to_load: bool = True
    # --- ours ---
    layer_wait_timeout_s: Seconds = 5.0
    lookup_timeout_s: Seconds = 1.0
    save_timeout_s: Seconds = 10.0
    # kv_both: a step's saves finish (wait for the layers, commit) on a background thread while the
    # engine goes on; the request's blocks stay allocated until they are done (vLLM's delayed
    # freeing). False: each step waits for its saves, as PD prefillers always do.
    save_in_background: bool = True
    metaserver_timeout_s: Seconds = 30.0
    # The metaservers a decoder (kv_consumer, kv_both) may call; the URL comes with each request,
    # so from clients too (lw_core.metaserver_allow). None: a proxy on this host's loopback only.
    pd_allowed_metaservers: AllowedMetaservers | None = None
    # Metaserver calls (connections) open at once; more wait for one, within metaserver_timeout_s.
    pd_metaserver_max_connections: MetaserverConnections = 1024
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    # How a KV cache on a device (GPU) copies to and from pool memory registered with it
    # (lw_vllm.device.direct_path): the device's own gather/scatter, one batched DMA per batch, auto (by
    # segment size), or staged (no registration: through pinned buffers, one host memcpy more).
    device_copy_mechanism: Literal["auto", "kernel", "batch_dma", "staged"] = "auto"
    # Streaming PD (docs/guide/streaming-pd.md): the prefiller publishes each layer of its reservations
    # as it is saved, the decoder pulls layers as they are published instead of waiting for the
    # whole prompt. Needs a backend with the streaming extension (lw_core.backend).
    pd_streaming: bool = False
    # Streaming PD decoder: worker threads pulling the parked requests' layers (lw_vllm.pd.stream_recv).
    # More receives than threads take turns, one wait slice each; their deadlines keep counting.
    stream_recv_threads: RecvThreads = 4
    # None: the model's identity is its config and weights' content (lw_vllm.identity.model_identity).
    model_id: ModelId | None = None
    # The selected backend plugin's keys (its ``keys`` Struct), set by ``parse_config``; not a key.
    backend_keys: Any = None

    def __post_init__(self) -> None:
        if self.discard_partial_chunks is None:
            self.discard_partial_chunks = not self.use_layerwise

    @property
    def prefetch_depth(self) -> int:
        return self.layerwise_prefetch_layers


def _validate(cfg: PoolConfig) -> None:
    if not cfg.mooncake_rpc_port.isdigit() or int(cfg.mooncake_rpc_port) > 65535:
        raise ConfigError(
            f"kv_connector_extra_config.mooncake_rpc_port={cfg.mooncake_rpc_port!r} must be a port "
            'number as a string, "0" to auto-assign'
        )
    try:
        MetaserverAllowList(cfg.pd_allowed_metaservers)
    except ValueError as e:
        raise ConfigError(f"kv_connector_extra_config.pd_allowed_metaservers: entry {e} (or null: loopback only)") from None


_ALIASES = {"lookup_rpc_port": "mooncake_rpc_port"}
_NOT_KEYS = frozenset({"backend_keys"})


def _core_keys() -> frozenset[str]:
    return frozenset(PoolConfig.__struct_fields__) - _NOT_KEYS


def known_keys() -> list[str]:
    """Every accepted key: the core ones, the aliases and the keys of each installed backend."""
    keys = set(_core_keys()) | set(_ALIASES)
    for p in registry.plugins():
        keys |= set(p.keys.__struct_fields__)
    return sorted(keys)


def parse_config(extra: dict[str, Any] | None) -> PoolConfig:
    """Parse vLLM's ``kv_connector_extra_config`` dict into a validated ``PoolConfig``."""
    raw = dict(extra or {})
    for alias, key in _ALIASES.items():
        if alias in raw:
            if key in raw and raw[key] != raw[alias]:
                raise ConfigError(
                    f"kv_connector_extra_config: {alias!r} is an alias of {key!r} and they disagree "
                    f"({raw[alias]!r} vs {raw[key]!r})"
                )
            raw[key] = raw.pop(alias)
    # The seed writes the rpc port as a string, users often write a number: accept both.
    if isinstance(raw.get("mooncake_rpc_port"), int) and not isinstance(raw["mooncake_rpc_port"], bool):
        raw["mooncake_rpc_port"] = str(raw["mooncake_rpc_port"])
    core = _core_keys()
    plugins = {p.name: p for p in registry.plugins()}
    owned = {k for p in plugins.values() for k in p.keys.__struct_fields__}
    unknown = sorted(k for k in raw if k not in core and k not in owned)
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"known keys: {', '.join(known_keys())}"
        )
    cfg = _convert({k: v for k, v in raw.items() if k in core}, PoolConfig, _NOTES)
    try:
        plugin = registry.get_backend(cfg.backend)
    except registry.UnknownBackend as e:
        raise ConfigError(f"kv_connector_extra_config.{e}") from None
    # Keys of other installed backends are checked too (a typo fails), and have no effect.
    for other in plugins.values():
        if other is not plugin and any(k in other.keys.__struct_fields__ for k in raw):
            _plugin_keys(other, raw)
    cfg.backend_keys = _plugin_keys(plugin, raw)
    _validate(cfg)
    return cfg


def _plugin_keys(plugin: registry.BackendPlugin, raw: dict[str, Any]) -> Any:
    keys = _convert({k: v for k, v in raw.items() if k in plugin.keys.__struct_fields__}, plugin.keys, plugin.notes)
    problem = plugin.check(keys) if plugin.check is not None else None
    if problem:
        raise ConfigError(f"kv_connector_extra_config.{problem}")
    return keys


def _convert(part: dict[str, Any], typ: type, notes: Any) -> Any:
    return convert_strict(part, typ, prefix="kv_connector_extra_config.", notes=notes, error=ConfigError)
