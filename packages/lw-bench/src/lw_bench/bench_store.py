"""The pool a bench measures: a backend plugin's throwaway pool (``bench_pool``), plus the backend
keys given with ``--backend-key KEY=VALUE`` (repeatable), parsed like ``kv_connector_extra_config``.

``--backend-key mooncake_load=whole`` sets a key; a value is read as JSON when it parses (numbers,
``true``/``false``), else as text. Keys are checked twice through lw-core's own config path: at
start-up each key's name and value against the backend's keys (``check_keys``: the connector's
msgspec constraints and messages, before any pool starts), then the whole config by
``parse_config`` once the throwaway pool says where it is.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from lw_core.backend import Backend
from lw_core.backends.registry import BackendPlugin, UnknownBackend, get_backend, open_backend
from lw_core.config import ConfigError, PoolConfig, known_keys, parse_config
from lw_core.validation import convert_strict

PREFIX = "kv_connector_extra_config."


def add_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend-key", action="append", default=[], metavar="KEY=VALUE", dest="backend_key",
                   help="a kv_connector_extra_config key for the backend, e.g. mooncake_load=whole (repeatable; "
                        "checked as the connector checks it)")


def plugin_of(mode: str, name: str) -> BackendPlugin:
    try:
        return get_backend(name)
    except UnknownBackend as e:
        raise SystemExit(f"lw-bench {mode} --backend: {e}") from None


def parse_keys(mode: str, items: list[str] | None) -> dict[str, Any]:
    """``["k=v", ...]`` -> ``{k: v}``, values as JSON where they parse."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SystemExit(f"lw-bench {mode} --backend-key {item!r}: expected KEY=VALUE, e.g. mooncake_load=whole")
        if key == "backend":
            raise SystemExit(f"lw-bench {mode} --backend-key backend=...: choose the backend with --backend")
        try:
            out[key] = json.loads(text)
        except ValueError:
            out[key] = text
    return out


def check_keys(mode: str, name: str, keys: dict[str, Any]) -> None:
    """Each key's name and value, by the connector's own msgspec types (a clear error naming the
    key and what it accepts); cross-key checks wait for ``parse_config`` in ``bench_store``."""
    if not keys:
        return
    plugin = plugin_of(mode, name)
    own = set(plugin.keys.__struct_fields__)
    core = set(PoolConfig.__struct_fields__) - {"backend", "backend_keys"}
    bad = sorted(k for k in keys if k not in own and k not in core)
    if bad:
        known = sorted(k for k in known_keys() if k in own) or ["(none: this backend has no keys)"]
        raise SystemExit(f"lw-bench {mode} --backend-key: {', '.join(map(repr, bad))} is not a key of backend "
                         f"{name!r}; its keys: {', '.join(known)}")
    try:
        convert_strict({k: v for k, v in keys.items() if k in own}, plugin.keys, prefix=PREFIX, notes=plugin.notes,
                       error=ConfigError)
        convert_strict({k: v for k, v in keys.items() if k in core}, PoolConfig, prefix=PREFIX, error=ConfigError)
    except ConfigError as e:
        raise SystemExit(f"lw-bench {mode} --backend-key: {e}") from None


@contextmanager
def bench_store(mode: str, name: str, capacity: int, path: str | None, keys: dict[str, Any] | None = None,
                **pool_kw: Any) -> Iterator[tuple[Backend, dict[str, Any]]]:
    """The backend over the plugin's throwaway pool of ``capacity`` bytes, and its extra config
    (the pool's keys and ``keys``); the pool goes when the context ends."""
    plugin = plugin_of(mode, name)
    if plugin.bench_pool is None:
        raise SystemExit(f"lw-bench {mode} --backend {name}: this backend has no throwaway pool for benchmarks")
    keys = dict(keys or {})
    check_keys(mode, name, keys)
    with ExitStack() as stack:
        try:
            extra = dict(stack.enter_context(plugin.bench_pool(capacity, path, **pool_kw)))
        except ImportError as e:  # the plugin's store is not installed
            raise SystemExit(f"lw-bench {mode} --backend {name}: {e}") from None
        fixed = sorted(k for k in keys if k in extra)
        if fixed:
            raise SystemExit(f"lw-bench {mode} --backend-key: {', '.join(fixed)} is set by the bench's own "
                             f"throwaway pool ({', '.join(f'{k}={extra[k]!r}' for k in fixed)})")
        extra.update(keys)
        try:
            cfg = parse_config(extra)
        except ConfigError as e:
            raise SystemExit(f"lw-bench {mode} --backend-key: {e}") from None
        b = open_backend(cfg)
        stack.callback(b.close)
        yield b, extra


def open_owning(mode: str, name: str, capacity: int, path: str | None, keys: dict[str, Any] | None = None) -> Backend:
    """Like ``bench_store``, for callers that hold a backend rather than a context: the backend's
    ``close()`` also stops its throwaway pool."""
    stack = ExitStack()
    b, _ = stack.enter_context(bench_store(mode, name, capacity, path, keys))
    close = b.close

    def close_all(*args: Any, **kw: Any) -> None:
        try:
            close(*args, **kw)
        finally:
            stack.close()

    b.close = close_all  # type: ignore[method-assign]
    return b


def open_for_pipeline(cfg: dict[str, Any], total: int) -> tuple[Any, str | None]:
    """``lw-bench pipeline``'s pool (and the temporary directory to remove after, if any): memory,
    embedded in a fresh directory, or (another backend, or backend keys) a plugin's bench pool."""
    if cfg["backend"] == "memory":
        from lw_core.backends.memory import MemoryBackend

        return MemoryBackend(capacity_bytes=total + (64 << 20)), None
    if cfg["backend"] != "embedded" or cfg.get("backend_keys"):  # its close() stops its throwaway pool
        return open_owning("pipeline", cfg["backend"], total + total // 4 + (16 << 20), cfg["pool_path"],
                           cfg.get("backend_keys")), None
    from lw_core.config import default_embedded_path

    path, tmp = cfg["pool_path"], None
    if path is None:
        base = os.path.dirname(default_embedded_path())
        tmp = path = tempfile.mkdtemp(prefix="lw-bench-pipeline-", dir=base)
    # Through the embedded plugin, as the connector opens it (its store's modules are its own).
    pool = parse_config({"embedded_path": path, "embedded_capacity_bytes": total + total // 4 + (16 << 20)})
    return open_backend(pool), tmp
