"""Writing and reading memcache_hybrid's ``mmc-meta.conf`` / ``mmc-local.conf``.

The library reads these flat ``key = value`` files (``MMC_META_CONFIG_PATH`` for the MetaService,
``MMC_LOCAL_CONFIG_PATH`` for every client). We generate them so users never hand-edit them, and
validate what the library would only reject at init (with a less helpful message).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlsplit

# Protocols a client can use; the device ones need a real Ascend NPU.
PROTOCOLS = ("host_shm", "host_tcp", "host_rdma", "device_rdma", "device_sdma")
HOST_PROTOCOLS = ("host_shm", "host_tcp", "host_rdma")
LOG_LEVELS = ("debug", "info", "warn", "error")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
MAX_DRAM = 1 << 40  # the library's documented limit


class ConfError(ValueError):
    """A bad memcache setting; the message names it and what is accepted."""


def parse_size(value: str | int, field: str = "dram_size", *, allow_zero: bool = False) -> int:
    """``134217728``, ``2048K``, ``200MB``, ``2.5GB`` -> bytes (what the library accepts).
    ``allow_zero``: 0 is a client that adds no memory to the pool (only uses it)."""
    if isinstance(value, bool):
        raise ConfError(f"{field}={value!r}: expected a size such as 268435456, '256MB' or '2GB'")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise ConfError(f"{field}={value!r}: expected a size such as 268435456, '256MB' or '2GB'")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if (n == 0 and allow_zero) or 0 < n <= MAX_DRAM:
        return n
    raise ConfError(f"{field}={value!r}: must be {'>= 0' if allow_zero else '> 0'} and at most 1TB")


def _check_url(url: str, field: str, schemes: tuple[str, ...]) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme not in schemes or not parts.hostname or not parts.port:
        raise ConfError(f"{field}={url!r}: expected {schemes[0]}://HOST:PORT")
    return parts.hostname, parts.port


def _write(path: str | os.PathLike[str], items: dict[str, object], header: str) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"## {header}", "## Written by lw-memcache; regenerate with `lw-memcache config` instead of editing."]
    lines += [f"{k} = {v}" for k, v in items.items()]
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(p)
    return p


def write_meta_conf(
    path: str | os.PathLike[str],
    *,
    meta_url: str,
    config_store_url: str,
    metrics_url: str,
    log_level: str = "warn",
    log_path: str | None = None,
    log_output_target: str = "screen",
    evict_threshold_high: int = 90,
    evict_threshold_low: int = 80,
    evict_check_interval_s: int = 1,
    lease_ttl_ms: int | None = None,
    lru_shard_count: int = 1,
) -> Path:
    """``mmc-meta.conf`` for a MetaService listening on the three given addresses."""
    _check_url(meta_url, "meta_url", ("tcp",))
    _check_url(config_store_url, "config_store_url", ("tcp",))
    _check_url(metrics_url, "metrics_url", ("http",))
    if log_level not in LOG_LEVELS:
        raise ConfError(f"log_level={log_level!r}; accepted: {', '.join(LOG_LEVELS)}")
    if log_output_target not in ("screen", "file", "both"):
        raise ConfError(f"log_output_target={log_output_target!r}; accepted: screen, file, both")
    if not (0 < evict_threshold_low < evict_threshold_high <= 100):
        raise ConfError(
            f"evict_threshold_low={evict_threshold_low!r}, evict_threshold_high={evict_threshold_high!r}: "
            "need 0 < low < high <= 100 (percent of the pool)"
        )
    if lru_shard_count < 1:
        raise ConfError(f"lru_shard_count={lru_shard_count!r} must be >= 1")
    if evict_check_interval_s < 1:
        raise ConfError(f"evict_check_interval_s={evict_check_interval_s!r} must be >= 1 (seconds)")
    items: dict[str, object] = {
        "ock.mmc.meta_service_url": meta_url,
        "ock.mmc.meta_service.config_store_url": config_store_url,
        "ock.mmc.meta_service.metrics_url": metrics_url,
        "ock.mmc.log_level": log_level,
        "ock.mmc.log_output_target": log_output_target,
        "ock.mmc.evict_threshold_high": evict_threshold_high,
        "ock.mmc.evict_threshold_low": evict_threshold_low,
        # Allocation does not evict: a full pool refuses new objects until this periodic check
        # (library default 5 s) has made room, so check often.
        "ock.mmc.evict_check_interval_seconds": evict_check_interval_s,
        # Eviction takes each LRU shard's oldest: with several shards it also drops objects
        # just written (seen: a batch committed a moment ago gone). One shard is exact LRU.
        "ock.mmc.meta_service.lru_shard_count": lru_shard_count,
    }
    if log_path:
        items["ock.mmc.log_path"] = log_path
    if lease_ttl_ms is not None:
        if lease_ttl_ms <= 0:
            raise ConfError(f"lease_ttl_ms={lease_ttl_ms!r} must be > 0")
        items["ock.mmc.meta.lease_ttl_ms"] = lease_ttl_ms
    return _write(path, items, "memcache_hybrid MetaService")


def write_local_conf(
    path: str | os.PathLike[str],
    *,
    meta_url: str,
    config_store_url: str,
    protocol: str = "host_shm",
    dram_size: str | int = "256MB",
    world_size: int = 64,
    hcom_url: str | None = None,
    log_level: str = "error",
    client_timeout_s: int = 10,
) -> Path:
    """``mmc-local.conf`` for clients (each client contributes ``dram_size`` to the pool).

    ``dram_size=0``: clients that only use the pool. Objects live in the memory of the clients
    that hold them and vanish when those exit, so engines that come and go should use such a
    config while long-lived clients (``lw-memcache hold``) keep the pool's memory."""
    _check_url(meta_url, "meta_url", ("tcp",))
    _check_url(config_store_url, "config_store_url", ("tcp",))
    if protocol not in PROTOCOLS:
        raise ConfError(f"protocol={protocol!r}; accepted: {', '.join(PROTOCOLS)}")
    if log_level not in LOG_LEVELS:
        raise ConfError(f"log_level={log_level!r}; accepted: {', '.join(LOG_LEVELS)}")
    if not (1 <= world_size <= 16384):
        raise ConfError(f"world_size={world_size!r}: the most clients the pool accepts, 1..16384")
    if client_timeout_s <= 0:
        raise ConfError(f"client_timeout_s={client_timeout_s!r} must be > 0")
    parse_size(dram_size, allow_zero=True)
    items: dict[str, object] = {
        "ock.mmc.meta_service_url": meta_url,
        "ock.mmc.local_service.config_store_url": config_store_url,
        "ock.mmc.log_level": log_level,
        "ock.mmc.local_service.world_size": world_size,
        "ock.mmc.local_service.protocol": protocol,
        "ock.mmc.local_service.dram.size": dram_size,
        "ock.mmc.client.timeout.seconds": client_timeout_s,
    }
    if hcom_url:
        _check_url(hcom_url, "hcom_url", ("tcp",))
        items["ock.mmc.local_service.hcom_url"] = hcom_url
    return _write(path, items, f"memcache_hybrid client ({protocol})")


HUGEPAGE = 2 << 20
HUGEPAGES_PATH = Path("/proc/sys/vm/nr_hugepages")


def check_hugepages(dram_bytes: int, what: str, meminfo: str | os.PathLike[str] = "/proc/meminfo") -> None:
    """host_tcp places a client's DRAM in 2 MiB huge pages and has no fallback (its init fails with
    a bare error code): refuse early, naming the setting, when too few are free."""
    free = None
    with open(meminfo) as f:
        for line in f:
            if line.startswith("HugePages_Free:"):
                free = int(line.split()[1])
    need = -(-dram_bytes // HUGEPAGE)
    if free is None or free < need:
        raise ConfError(
            f"{what}: host_tcp lends {dram_bytes} bytes from 2 MiB huge pages and needs {need} free, but "
            f"{0 if free is None else free} are (HugePages_Free in {meminfo}); as root: "
            f"echo $(( $(cat {HUGEPAGES_PATH}) + {need} )) > {HUGEPAGES_PATH}"
        )


def read_conf(path: str | os.PathLike[str]) -> dict[str, str]:
    """The ``key = value`` pairs of a memcache config file (comments skipped)."""
    out: dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        k, v = line.split("=", 1)
        out[k.strip()] = v.strip()
    return out


AUTO_HOST = "0.0.0.0"


def resolve_auto_hcom(local_conf: dict[str, str]) -> dict[str, str]:
    """A data port on ``0.0.0.0`` (``lw-memcache config --hcom-host auto``) becomes this machine's
    address on the route to the MetaService, per process: one config file then serves every
    machine. (The library would advertise 0.0.0.0 to its peers, which cannot reach it.)"""
    url = local_conf.get("ock.mmc.local_service.hcom_url")
    if not url:
        return local_conf
    host, port = _check_url(url, "ock.mmc.local_service.hcom_url", ("tcp",))
    if host != AUTO_HOST:
        return local_conf
    meta_host, meta_port = meta_address(local_conf)
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((meta_host, meta_port))  # UDP: picks the route, sends nothing
        except OSError as e:
            raise ConfError(f"ock.mmc.local_service.hcom_url={url!r}: no route to the MetaService at {meta_host} ({e})") from e
        mine = s.getsockname()[0]
    return {**local_conf, "ock.mmc.local_service.hcom_url": f"tcp://{mine}:{port}"}


def meta_address(local_conf: dict[str, str]) -> tuple[str, int]:
    """(host, port) of the MetaService a client config points at."""
    url = local_conf.get("ock.mmc.meta_service_url")
    if not url:
        raise ConfError("the memcache client config has no ock.mmc.meta_service_url")
    return _check_url(url, "ock.mmc.meta_service_url", ("tcp",))


def local_config_fields(local_conf: dict[str, str], known: set[str]) -> dict[str, str]:
    """Map ``mmc-local.conf`` keys to ``memcache_hybrid.LocalConfig`` attribute names.

    Clients are configured through ``DistributedObjectStore.setup(LocalConfig)`` rather than
    ``MMC_LOCAL_CONFIG_PATH``: the library reads that variable once, when it is loaded, so a
    process could never switch pools. ``known`` is the set of LocalConfig attributes; a key with
    no attribute is refused rather than silently ignored.
    """
    out: dict[str, str] = {}
    unknown = []
    for key, value in local_conf.items():
        rest = key.removeprefix("ock.mmc.")
        candidates = []
        if rest.startswith("local_service."):
            candidates.append(rest.removeprefix("local_service.").replace(".", "_"))
        elif rest.startswith("client."):
            tail = rest.removeprefix("client.").replace(".", "_")
            candidates += ["client_" + tail, tail]
        else:
            candidates.append(rest.replace(".", "_"))
        attr = next((c for c in candidates if c in known), None)
        if attr is None or not key.startswith("ock.mmc."):
            unknown.append(key)
        else:
            out[attr] = value
    if unknown:
        raise ConfError(
            f"memcache client config keys not supported by lw-memcache: {', '.join(sorted(unknown))} "
            "(write the file with `lw-memcache config`)"
        )
    return out
