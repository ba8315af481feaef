"""Bench-only pool backend ``throttled``: a pool behind a slow link, and a per-call timeline.

``lw-bench pd`` needs a slow store to show what streaming PD hides, and a per-layer timeline
(prefiller layer saved/published vs decoder layer landed) that the connector's stats do not carry.
Both come from this wrapper around the embedded backend (or, with ``throttle_inner: "memcache"``,
lw-memcache's), selected in ``kv_connector_extra_config`` with ``backend: "throttled"`` and these
keys (besides the inner store's own):

* ``throttle_bytes_per_s`` (int >= 0; 0 = no throttle): each process has ONE link of that bandwidth
  to the store. Every ``write`` and ``read`` queues on it (transfers are serialised, as on one NIC)
  and waits ``nbytes / bandwidth`` before its copy runs. While throttled, ``view`` (zero-copy) is
  refused so that every byte goes through ``write``/``read`` and pays the link. ``publish``,
  ``commit``, ``lookup`` and the other metadata calls are not delayed.
* ``timeline_path`` (str; empty = none): one JSON line per data call, appended as it ends:
  ``{"t0", "t", "op", "off" | "upto", "n", "nbytes"}`` (wall clock). ``reserve`` lines carry the
  object size (``nbytes`` per object), which with the model's layer count gives the layer size.

It is not a product backend: nothing outside lw-bench registers it. Engine processes find it
through a ``sitecustomize`` module the bench puts on ``PYTHONPATH`` (``sitecustomize_dir``): vLLM
starts its engine core and workers as child processes, which inherit the environment.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from lw_core.backend import BackendError, supports_streaming
from lw_core.backends.builtin import EMBEDDED, EmbeddedKeys
from lw_core.backends.embedded_defaults import CapacityBytes, default_embedded_path
from lw_core.backends.registry import BackendPlugin

NAME = "throttled"


class ThrottledKeys(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # The store behind the link: the embedded pool (its keys below), or memcache (lw-memcache's keys,
    # for ``lw-bench pd --stores memcache``: a real MetaService and holder on this host).
    throttle_inner: Literal["embedded", "memcache"] = "embedded"
    embedded_path: str = msgspec.field(default_factory=default_embedded_path)
    embedded_capacity_bytes: CapacityBytes = 4 << 30
    memcache_config_path: str = ""
    memcache_protocol: str = "host_shm"
    throttle_bytes_per_s: Annotated[int, Meta(ge=0)] = 0
    timeline_path: str = ""


class Link:
    """One serialised link of ``bytes_per_s``: ``take(n)`` returns when n bytes would have crossed it."""

    def __init__(self, bytes_per_s: int) -> None:
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._free_at = 0.0

    def take(self, nbytes: int) -> float:
        """Wait for the link; returns the seconds waited (0 when unthrottled)."""
        if self.bytes_per_s <= 0 or nbytes <= 0:
            return 0.0
        now = time.monotonic()
        with self._lock:
            start = max(now, self._free_at)
            self._free_at = start + nbytes / self.bytes_per_s
            until = self._free_at
        time.sleep(max(0.0, until - now))
        return until - now


def _nbytes(bufs: Sequence[Any]) -> int:
    return sum(memoryview(b).nbytes for b in bufs)


class ThrottledBackend:
    """Wraps a (streaming) backend; see the module docstring."""

    name = NAME

    def __init__(self, inner: Any, bytes_per_s: int = 0, timeline_path: str = "") -> None:
        if not supports_streaming(inner):
            raise BackendError(f"backend {NAME!r} wraps a streaming backend; {type(inner).__name__} is not one")
        self.inner = inner
        self.link = Link(bytes_per_s)
        self._tl_lock = threading.Lock()
        self._tl = open(timeline_path, "a", buffering=1) if timeline_path else None

    def _event(self, t0: float, op: str, n: int, nbytes: int, **kw: Any) -> None:
        if self._tl is None:
            return
        line = json.dumps({"t0": round(t0, 6), "t": round(time.time(), 6), "op": op, "n": n, "nbytes": nbytes,
                           "pid": os.getpid(), **kw})
        with self._tl_lock:
            self._tl.write(line + "\n")

    # --- data calls: through the link, and on the timeline ---
    def write(self, handles: Sequence[Any], offsets: Sequence[int], srcs: Sequence[Any]) -> None:
        t0, nb = time.time(), _nbytes(srcs)
        self.link.take(nb)
        self.inner.write(handles, offsets, srcs)
        self._event(t0, "write", len(handles), nb, off=min(offsets, default=0))

    def read(self, handles: Sequence[Any], offsets: Sequence[int], dsts: Sequence[Any]) -> None:
        t0, nb = time.time(), _nbytes(dsts)
        self.link.take(nb)
        self.inner.read(handles, offsets, dsts)
        self._event(t0, "read", len(handles), nb, off=min(offsets, default=0))

    def view(self, handle: Any, offset: int, nbytes: int) -> memoryview | None:
        if self.link.bytes_per_s > 0:
            return None  # every byte pays the link
        t0 = time.time()
        v = self.inner.view(handle, offset, nbytes)
        if v is not None:  # the caller copies right after: its start is what the timeline can see
            self._event(t0, "view", 1, nbytes, off=offset)
        return v

    def reserve(self, keys: Sequence[str], nbytes: int) -> list[Any]:
        t0 = time.time()
        out = self.inner.reserve(keys, nbytes)
        self._event(t0, "reserve", len(keys), nbytes)
        return out

    def commit(self, handles: Sequence[Any]) -> None:
        t0 = time.time()
        self.inner.commit(handles)
        self._event(t0, "commit", len(handles), 0)

    def publish(self, handles: Sequence[Any], upto: int) -> None:
        t0 = time.time()
        self.inner.publish(handles, upto)
        self._event(t0, "publish", len(handles), 0, upto=upto)

    def wait_published(self, handles: Sequence[Any], upto: int, timeout_s: float) -> list[bool]:
        return self.inner.wait_published(handles, upto, timeout_s)

    def open_streaming(self, keys: Sequence[str]) -> list[Any]:
        return self.inner.open_streaming(keys)

    def lookup(self, keys: Sequence[str]) -> int:
        return self.inner.lookup(keys)

    def open(self, keys: Sequence[str]) -> list[Any]:
        return self.inner.open(keys)

    def abort(self, handles: Sequence[Any]) -> None:
        self.inner.abort(handles)

    def release(self, handles: Sequence[Any]) -> None:
        self.inner.release(handles)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def __getattr__(self, name: str) -> Any:  # optional extras (e.g. ``intact`` for views)
        return getattr(self.inner, name)

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            if self._tl is not None:
                self._tl.close()
                self._tl = None


def _open(cfg: Any, **kwargs: Any) -> ThrottledBackend:
    k: ThrottledKeys = cfg.backend_keys
    if k.throttle_inner == "memcache":
        from lw_core.backends.registry import get_backend

        plugin = get_backend("memcache")  # lw-memcache's entry point
        keys = msgspec.convert({"memcache_config_path": k.memcache_config_path,
                                "memcache_protocol": k.memcache_protocol}, plugin.keys)
        inner = plugin.open(msgspec.structs.replace(cfg, backend="memcache", backend_keys=keys), **kwargs)
    else:
        inner = EMBEDDED.open(msgspec.structs.replace(cfg, backend="embedded", backend_keys=_embedded_keys(k)),
                              **kwargs)
    return ThrottledBackend(inner, k.throttle_bytes_per_s, k.timeline_path)


def _embedded_keys(k: ThrottledKeys) -> EmbeddedKeys:
    return EmbeddedKeys(embedded_path=k.embedded_path, embedded_capacity_bytes=k.embedded_capacity_bytes)


def _check(keys: ThrottledKeys) -> str | None:
    if keys.throttle_inner != "embedded":
        return None
    check = EMBEDDED.check
    return check(_embedded_keys(keys)) if check is not None else None


PLUGIN = BackendPlugin(name=NAME, open=_open, keys=ThrottledKeys, check=_check,
                       notes={"throttle_bytes_per_s": "0 (no throttle) or more bytes per second"})

SITECUSTOMIZE = f'''"""Written by lw-bench pd: registers its bench-only pool backend {NAME!r} in every process."""
try:
    from lw_core.backends.registry import register_backend
    register_backend({NAME!r}, "lw_bench.pd.throttle:PLUGIN")
except ImportError:
    pass
'''


def sitecustomize_dir(parent: Path) -> Path:
    """A directory holding the ``sitecustomize`` above; put it first on ``PYTHONPATH`` of the engines."""
    d = parent / "lw-bench-site"
    d.mkdir(parents=True, exist_ok=True)
    (d / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return d
