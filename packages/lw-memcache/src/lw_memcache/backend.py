"""``MemcacheBackend``: lw-core's Backend protocol over ``memcache_hybrid.DistributedObjectStore``.

One pool object per key holds all layers layer-major (``TRAILER`` bytes more: the streaming
extension keeps each reservation's token there; handles report the asked size). The backend is a
facade over collaborators it builds and owns, each with its own state and lock:

* ``client`` (``lw_memcache.client.StoreClient``): the store, whether it is closed, the counters;
* ``copier`` (``lw_memcache.copies.Copier``): ``batch_copy`` and the registered device regions;
* ``sightings`` (``lw_memcache.orphans.Sightings``): keys seen being written by others;
* ``writer`` (``lw_memcache.object_writer.ObjectWriter``): reserve, write, commit, abort;
* ``reader`` (``lw_memcache.object_reader.ObjectReader``): lookup, open, read, release;
* ``stream_writer`` / ``stream_reader`` (``lw_memcache.stream_write`` / ``lw_memcache.stream_read``):
  the streaming extension (design: ``lw_memcache.streaming``).

Invariants: one client per process (a second backend is refused while one is open); ``close``
runs once (from the owner or atexit): it drops open reservations (never publishing them) and read
leases, lets the reaper remove what waits, then closes the store.
"""

from __future__ import annotations

import atexit
import socket
import weakref
from collections.abc import Sequence
from typing import Any

from lw_core.backend import BackendError, BackendUnavailable
from lw_memcache.client import StoreClient, open_store, read_client_conf
from lw_memcache.copies import Copier
from lw_memcache.handles import MemcacheHandle, MemcacheStreamHandle
from lw_memcache.object_reader import ObjectReader
from lw_memcache.object_writer import ObjectWriter
from lw_memcache.orphans import Sightings
from lw_memcache.stream_read import StreamReader
from lw_memcache.stream_write import StreamWriter

_open_in_process: weakref.WeakSet[MemcacheBackend] = weakref.WeakSet()


def _meta_reachable(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class MemcacheBackend:
    """This process's memcache client as a pool backend (see the module docstring)."""

    name = "memcache"

    def __init__(
        self,
        config_path: str,
        *,
        protocol: str = "host_shm",
        device_id: int = 0,
        read_lease_ms: int = 30_000,
        write_lease_ms: int = 30_000,
        connect_timeout_s: float = 3.0,
        restore_signals: bool = True,
        full_wait_s: float = 2.0,
        streaming: bool = False,
    ) -> None:
        # ``protocol`` is validated with the config (lw_memcache.plugin.MemcacheKeys); a direct
        # caller's bad value fails the agreement with the file's protocol below.
        conf, host, port = read_client_conf(config_path, protocol)
        for name, v in (("read_lease_ms", read_lease_ms), ("write_lease_ms", write_lease_ms)):
            if v <= 0:
                raise BackendError(f"{name}={v!r} must be > 0 (milliseconds)")
        if not (0 <= full_wait_s < float("inf")):
            raise BackendError(f"full_wait_s={full_wait_s!r} must be >= 0 seconds (0: a full pool refuses at once)")
        if any(not b.closed for b in _open_in_process):
            raise BackendError("a memcache client is already open in this process: close it first (one per process)")

        from lw_memcache.runtime import import_memcache

        mc = import_memcache(protocol)
        # Checked first because init() blocks ~80 s per attempt, five attempts, when it is down.
        if not _meta_reachable(host, port, connect_timeout_s):
            raise BackendUnavailable(
                f"memcache MetaService at tcp://{host}:{port} (from {config_path}) is not reachable: start it "
                "with `lw-memcache meta` (code -3014 once clients are running)"
            )
        self.config_path = config_path
        self.protocol = protocol
        store = open_store(mc, conf, config_path, protocol=protocol, device_id=device_id, restore_signals=restore_signals)
        self.client = StoreClient(store)
        self.copier = Copier(self.client)
        self.sightings = Sightings(write_lease_ms / 1000)
        self.stream_writer = StreamWriter(self.client, self.copier, enabled=bool(streaming), write_lease_ms=write_lease_ms)
        self.writer = ObjectWriter(self.client, self.copier, self.sightings, self.stream_writer,
                                   write_lease_ms=write_lease_ms, full_wait_s=full_wait_s)
        self.reader = ObjectReader(self.client, self.copier, self.sightings, read_lease_ms=read_lease_ms)
        self.stream_reader = StreamReader(self.client, self.copier, self.reader, read_lease_ms=read_lease_ms)
        _open_in_process.add(self)
        ref = weakref.ref(self)

        def close_at_exit() -> None:
            b = ref()
            if b is not None:
                b.close()

        atexit.register(close_at_exit)

    @classmethod
    def from_config(cls, cfg: Any, **kwargs: Any) -> MemcacheBackend:
        """Build from a ``lw_core.config.PoolConfig``; lease lengths and the wait for room in a
        full pool default from its timeouts."""
        keys = cfg.backend_keys  # lw_memcache.plugin.MemcacheKeys
        # A reservation lives from a step's first layer write to its commit after the forward: on a
        # CPU a long prefill step alone takes tens of seconds (2 x save_timeout_s was too short).
        lease_s = keys.memcache_write_lease_s or max(120.0, 4 * cfg.save_timeout_s)
        kwargs.setdefault("write_lease_ms", int(lease_s * 1000))
        kwargs.setdefault("read_lease_ms", max(10_000, int(cfg.layer_wait_timeout_s * 4000)))
        # A save waiting for room must leave most of its deadline to the copies.
        kwargs.setdefault("full_wait_s", min(2.0, cfg.save_timeout_s / 4))
        kwargs.setdefault("streaming", bool(getattr(cfg, "pd_streaming", False)))
        return cls(keys.memcache_config_path, protocol=keys.memcache_protocol, **kwargs)

    @property
    def closed(self) -> bool:
        return self.client.closed

    # ----- Backend protocol (ObjectWriter, ObjectReader) -----

    def lookup(self, keys: Sequence[str]) -> int:
        return self.reader.lookup(keys)

    def reserve(self, keys: Sequence[str], nbytes: int) -> list[MemcacheHandle | None]:
        return self.writer.reserve(keys, nbytes)

    def write(self, handles: Sequence[MemcacheHandle], offsets: Sequence[int], srcs: Sequence[Any]) -> None:
        self.writer.write(handles, offsets, srcs)

    def commit(self, handles: Sequence[MemcacheHandle]) -> None:
        self.writer.commit(handles)

    def abort(self, handles: Sequence[MemcacheHandle]) -> None:
        self.writer.abort(handles)

    def open(self, keys: Sequence[str]) -> list[MemcacheHandle | None]:
        return self.reader.open(keys)

    def read(self, handles: Sequence[MemcacheHandle], offsets: Sequence[int], dsts: Sequence[Any]) -> None:
        if any(type(h) is MemcacheStreamHandle for h in handles):
            self.stream_reader.read(handles, offsets, dsts)
            return
        self.reader.read(handles, offsets, dsts)

    def release(self, handles: Sequence[MemcacheHandle]) -> None:
        self.reader.release(handles)

    def view(self, handle: MemcacheHandle, offset: int, nbytes: int) -> memoryview | None:
        return None  # objects live in the store's global space; use read/write

    # ----- streaming (StreamWriter, StreamReader) -----

    def publish(self, handles: Sequence[Any], upto: int) -> None:
        self.stream_writer.publish(handles, upto, self.writer.holds)

    def open_streaming(self, keys: Sequence[str]) -> list[MemcacheStreamHandle | None]:
        return self.stream_reader.open(keys)

    def wait_published(self, handles: Sequence[Any], upto: int, timeout_s: float) -> list[bool]:
        return self.stream_reader.wait_published(handles, upto, timeout_s)

    # ----- buffers (Copier), counters, close -----

    def register_buffer(self, buf: Any, *, device: bool = False) -> None:
        """Register memory the pipeline will copy to/from (``Copier.register``)."""
        self.copier.register(buf, device=device)

    def unregister_buffer(self, buf: Any) -> None:
        self.copier.unregister(buf)

    def stats(self) -> dict[str, int]:
        out = self.client.counters()
        out["writing"] = len(self.writer)
        return out

    def close(self) -> None:
        if not self.client.mark_closed():
            return
        pending = self.writer.drain()
        leased = self.reader.drain()
        # Leaving: drop half-written objects (never publish them) and our read leases (the
        # holder of a leased object waits for the lease to end before it can leave).
        try:
            if pending:
                self.writer.drop(pending)
            if leased:
                self.client.store.batch_remove_lease(leased)
        except Exception:  # noqa: BLE001 - leaving anyway
            pass
        self.stream_writer.close()
        self.client.store.close()
        _open_in_process.discard(self)

    def __enter__(self) -> MemcacheBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
