"""Pool backends as plugins: a name -> ``BackendPlugin`` registry, filled lazily.

A backend package registers itself in its own ``pyproject.toml``, with no edit to lw-core::

    [project.entry-points."lw_pool.backends"]
    mooncake = "lw_mooncake.plugin:PLUGIN"

The entry point names a ``BackendPlugin`` (or a no-argument callable returning one) in a light
module: loading it must not import the store's client library (that happens in ``open``).
``register_backend(name, loader)`` does the same in-process (tests, embedders); it wins over an
entry point of the same name. Names resolve on first use (vLLM's ``KVConnectorFactory`` style).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from importlib import import_module
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import msgspec

from lw_core.backend import Backend, BackendError

GROUP = "lw_pool.backends"

# Names the seed documents that no plugin here provides: refused with the reason, unless a plugin
# of that name is installed.
REFUSED = {
    "yuanrong": "Yuanrong is not supported by this connector (and cannot run layerwise)",
}
# Backends shipped as separate packages: what to install when one is asked for but missing.
INSTALL_HINTS = {"memcache": "pip install 'lw-memcache[store]'", "mooncake": "pip install 'lw-mooncake[store]'"}


class NoKeys(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A backend with no keys of its own."""


@dataclass(frozen=True)
class BackendPlugin:
    """One pool backend, as the connector and lw-bench see it.

    ``keys``: a frozen msgspec Struct of the backend's own ``kv_connector_extra_config`` keys
    (constraints as ``Meta`` on the fields; parsed as strictly as the core keys).
    ``open(cfg, **kwargs)``: build the backend from a parsed ``PoolConfig``; ``cfg.backend_keys``
    is the ``keys`` struct. ``check(keys)``: cross-field checks, returns an error text or None.
    ``notes``: said after a key's accepted range in errors. ``bench_pool(capacity, path)``: a
    context that yields the extra config of a throwaway pool of that size (lw-bench).
    ``purge(cfg, prefix, timeout_s)``: remove the objects whose key starts with ``prefix`` ("" =
    all) from the pool ``cfg`` names, with or without engines attached (``lw-pool purge``); counts
    as the ``purge`` method's (``lw_core.backend``). None: the backend cannot.
    """

    name: str
    open: Callable[..., Backend[Any]]
    keys: type[msgspec.Struct] = NoKeys
    check: Callable[[Any], str | None] | None = None
    notes: Mapping[str, str] = field(default_factory=dict)
    bench_pool: Callable[[int, str | None], AbstractContextManager[dict[str, Any]]] | None = None
    purge: Callable[[Any, str, float], dict[str, int]] | None = None


class UnknownBackend(BackendError):
    """``backend`` names no installed plugin; the message names the accepted ones."""


Loader = Callable[[], "BackendPlugin"] | str

_lock = threading.RLock()
_registered: dict[str, Loader] = {}
_loaded: dict[str, BackendPlugin] = {}


def register_backend(name: str, loader: Loader) -> None:
    """Register (or replace) backend ``name`` in this process: ``loader`` is a no-argument callable
    returning a ``BackendPlugin``, or ``"module:attr"`` naming one; it runs on first use."""
    if not name or not isinstance(name, str):
        raise ValueError(f"register_backend: name={name!r} must be a non-empty string")
    with _lock:
        _registered[name] = loader
        _loaded.pop(name, None)


def unregister_backend(name: str) -> None:
    with _lock:
        _registered.pop(name, None)
        _loaded.pop(name, None)


# lw-core's own, also found when its distribution metadata is missing or stale (a source tree on
# PYTHONPATH); the same name from an entry point or register_backend wins.
_BUILTIN = {"embedded": "lw_core.backends.builtin:EMBEDDED"}


def _entry_points() -> dict[str, Any]:
    return {**_BUILTIN, **{ep.name: ep for ep in entry_points(group=GROUP)}}


def backend_names() -> list[str]:
    """The backends installed (entry points) or registered in this process, sorted."""
    with _lock:
        return sorted(set(_entry_points()) | set(_registered))


def _resolve(name: str, loader: Any) -> BackendPlugin:
    obj = loader
    if isinstance(obj, str):
        mod, _, attr = obj.partition(":")
        obj = import_module(mod)
        for part in attr.split(".") if attr else ():
            obj = getattr(obj, part)
    elif isinstance(obj, EntryPoint):
        obj = obj.load()
    if not isinstance(obj, BackendPlugin) and callable(obj):
        obj = obj()
    if not isinstance(obj, BackendPlugin):
        raise UnknownBackend(f"backend={name!r}: its plugin loader gave {type(obj).__name__}, not a BackendPlugin")
    if obj.name != name:
        raise UnknownBackend(f"backend={name!r}: the plugin registered as {name!r} calls itself {obj.name!r}")
    return obj


def accepted_text() -> str:
    return ", ".join(map(repr, backend_names())) or "(none installed)"


def get_backend(name: str) -> BackendPlugin:
    """The plugin for ``name``, loading it on first use; ``UnknownBackend`` names the accepted
    backends, the reason for a refused one, or the package to install for a known missing one."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        loader: Any = _registered.get(name)
        if loader is None:
            loader = _entry_points().get(name)
        if loader is None:
            if name in REFUSED:
                raise UnknownBackend(f"backend={name!r}: {REFUSED[name]}; accepted: {accepted_text()}")
            if name in INSTALL_HINTS:
                raise UnknownBackend(
                    f"backend={name!r} is not installed: {INSTALL_HINTS[name]}; accepted now: {accepted_text()}"
                )
            raise UnknownBackend(f"backend={name!r} is unknown; accepted: {accepted_text()}")
        try:
            plugin = _resolve(name, loader)
        except UnknownBackend:
            raise
        except Exception as e:  # a broken or half-installed plugin: say which, never a traceback of ours
            hint = f"; {INSTALL_HINTS[name]}" if name in INSTALL_HINTS else ""
            raise UnknownBackend(f"backend={name!r}: its plugin cannot be loaded ({type(e).__name__}: {e}){hint}") from e
        _loaded[name] = plugin
        return plugin


def open_backend(cfg: Any, **kwargs: Any) -> Backend[Any]:
    """Build the backend ``cfg.backend`` names (a parsed ``PoolConfig``) through its plugin; the
    store's own modules are imported only now."""
    return get_backend(cfg.backend).open(cfg, **kwargs)


def plugins() -> Iterator[BackendPlugin]:
    """Every installed plugin that loads (for their config keys); a broken one is skipped here and
    reported when it is selected."""
    for name in backend_names():
        try:
            yield get_backend(name)
        except BackendError:
            continue
