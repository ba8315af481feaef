"""The connector's ``kv_connector_extra_config``, parsed strictly.

One msgspec Struct holds every key of the seed's parameter table (with the seed's defaults) plus
our own options. Parsing is strict: an unknown key, a wrong type or an out-of-range value raises
``ConfigError`` naming the key, the value given and what is accepted, so a typo fails vLLM at
start-up instead of being silently ignored.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Literal

import msgspec

KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
BACKENDS = ("embedded", "memcache")
# Backends the seed documents but this product does not ship: named so the error can say why.
_UNSUPPORTED_BACKENDS = {
    "mooncake": "Mooncake Store is not supported by this connector (and cannot run layerwise)",
    "yuanrong": "Yuanrong is not supported by this connector (and cannot run layerwise)",
}
LOAD_FAILURE_POLICIES = ("recompute", "fail")


class ConfigError(ValueError):
    """A bad ``kv_connector_extra_config``; the message names the key and the accepted values."""


def default_embedded_path() -> str:
    """Per-user pool directory: tmpfs when present (the pool is a cache of DRAM, not a disk store)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"lw-pool-{os.getuid()}")


class PoolConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # --- the seed's table ---
    use_layerwise: bool = False
    backend: str = "embedded"
    mooncake_rpc_port: str = "0"
    layerwise_prefetch_layers: int = 1
    layerwise_max_transfer_blocks: int = 0
    layerwise_max_transfer_bytes: int = 0
    h2d_stagger_us: int = 0
    # None = the seed's mode-dependent default: true in bulk mode, false in layerwise mode.
    discard_partial_chunks: bool | None = None
    consumer_is_to_put: bool = False
    consumer_is_to_load: bool = False
    # --- ours ---
    embedded_path: str = msgspec.field(default_factory=default_embedded_path)
    embedded_capacity_bytes: int = 4 << 30
    layer_wait_timeout_s: float = 5.0
    lookup_timeout_s: float = 1.0
    save_timeout_s: float = 10.0
    metaserver_timeout_s: float = 30.0
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    memcache_config_path: str = ""
    memcache_protocol: Literal["host_shm", "host_tcp", "device_rdma", "device_sdma", "host_rdma"] = "host_shm"

    def __post_init__(self) -> None:
        if self.discard_partial_chunks is None:
            self.discard_partial_chunks = not self.use_layerwise

    @property
    def prefetch_depth(self) -> int:
        return self.layerwise_prefetch_layers


_NON_NEGATIVE_INT = (
    "layerwise_max_transfer_blocks",
    "layerwise_max_transfer_bytes",
    "h2d_stagger_us",
    "embedded_capacity_bytes",
)
_POSITIVE_FLOAT = ("layer_wait_timeout_s", "lookup_timeout_s", "save_timeout_s", "metaserver_timeout_s")


def _validate(cfg: PoolConfig) -> None:
    if cfg.backend in _UNSUPPORTED_BACKENDS:
        raise ConfigError(
            f"kv_connector_extra_config.backend={cfg.backend!r}: {_UNSUPPORTED_BACKENDS[cfg.backend]}; "
            f"accepted: {', '.join(map(repr, BACKENDS))}"
        )
    if cfg.backend not in BACKENDS:
        raise ConfigError(
            f"kv_connector_extra_config.backend={cfg.backend!r} is unknown; accepted: {', '.join(map(repr, BACKENDS))}"
        )
    for key in _NON_NEGATIVE_INT:
        v = getattr(cfg, key)
        if v < 0:
            raise ConfigError(f"kv_connector_extra_config.{key}={v!r} must be >= 0 (0 = unlimited/off)")
    if cfg.layerwise_prefetch_layers < 1:
        raise ConfigError(
            f"kv_connector_extra_config.layerwise_prefetch_layers={cfg.layerwise_prefetch_layers!r} "
            "must be >= 1 (typical: 1-4)"
        )
    for key in _POSITIVE_FLOAT:
        v = getattr(cfg, key)
        if not (v > 0) or v == float("inf"):
            raise ConfigError(f"kv_connector_extra_config.{key}={v!r} must be a finite number of seconds > 0")
    if cfg.backend == "embedded" and cfg.embedded_capacity_bytes < (1 << 20):
        raise ConfigError(
            f"kv_connector_extra_config.embedded_capacity_bytes={cfg.embedded_capacity_bytes!r} "
            "must be at least 1048576 (1 MiB)"
        )
    if not cfg.mooncake_rpc_port.isdigit() or int(cfg.mooncake_rpc_port) > 65535:
        raise ConfigError(
            f"kv_connector_extra_config.mooncake_rpc_port={cfg.mooncake_rpc_port!r} must be a port "
            'number as a string, "0" to auto-assign'
        )


_ALIASES = {"lookup_rpc_port": "mooncake_rpc_port"}


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
    known = set(PoolConfig.__struct_fields__)
    unknown = sorted(k for k in raw if k not in known)
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"known keys: {', '.join(sorted(known | set(_ALIASES)))}"
        )
    try:
        cfg = msgspec.convert(raw, PoolConfig, strict=True)
    except msgspec.ValidationError as e:
        raise ConfigError(_explain(e, raw)) from None
    _validate(cfg)
    return cfg


def _explain(e: msgspec.ValidationError, raw: dict[str, Any]) -> str:
    # msgspec says e.g. "Expected `int`, got `str` - at `$.h2d_stagger_us`": restate it with the key.
    msg = str(e)
    key = None
    if "$." in msg:
        key = msg.rsplit("$.", 1)[1].split("`")[0].split("[")[0]
    if key is not None:
        ann = PoolConfig.__annotations__.get(key, "")
        if "Literal" in str(ann):
            accepted = str(ann).split("Literal[", 1)[1].rstrip("]")
            return f"kv_connector_extra_config.{key}={raw.get(key)!r} is not accepted; accepted: {accepted}"
        return f"kv_connector_extra_config.{key}={raw.get(key)!r}: {msg.split(' - at ')[0]}"
    return f"kv_connector_extra_config: {msg}"
