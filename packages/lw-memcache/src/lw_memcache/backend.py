"""``MemcacheBackend``: lw-core's Backend protocol over ``memcache_hybrid.DistributedObjectStore``.

One pool object per key holds all layers layer-major. Its life, in store calls (all batched):

* ``reserve``: ``batch_get_key_info(flag=0)`` (sees objects being written too) skips keys that
  exist or are being written (unless orphaned: ``lw_memcache.orphans``), then ``batch_alloc``
  places the rest and takes a write lease; the answer is each object's global address (GVA).
* ``write``: ``batch_copy(GVA + offset, buffer, size)`` -- a ranged copy per layer, no metadata
  round trip. ``commit``: ``batch_write_finish(res=0)``: only now does the object become
  readable (``batch_is_exist`` / ``batch_add_lease`` fail on it before). ``abort``:
  ``batch_write_finish(res=1)`` drops it.
* ``open``: ``batch_add_lease`` (fails on missing and on unfinished objects) then
  ``batch_get_key_info`` for the GVA; ``read``: ``batch_copy`` from ``GVA + offset``;
  ``release``: ``batch_remove_lease``.

The copies themselves (host or device memory, ``register_buffer``) are ``lw_memcache.copies``';
streaming is ``lw_memcache.streaming`` (writer) and ``lw_memcache.stream_read`` (reader).
"""

from __future__ import annotations

import atexit
import logging
import signal
import socket
import threading
import time
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any

from lw_core.backend import BackendError, BackendUnavailable, ObjectMissing
from lw_core.backends.segment_stream.reaper import Reaper
from lw_memcache import errors
from lw_memcache.conf import ConfError, local_config_fields, meta_address, read_conf, resolve_auto_hcom
from lw_memcache.copies import CopyMixin, MemcacheHandle
from lw_memcache.orphans import Sightings
from lw_memcache.stream_read import StreamReadMixin
from lw_memcache.streaming import REMOVE_GRACE_S, TRAILER, MemcacheStreamHandle, StreamMixin

log = logging.getLogger(__name__)

MEDIA_DRAM = 1
_FULL_RETRY_S = 0.2  # between allocation attempts while a full pool waits for its eviction check
# batch_get_key_info flags: 1 = readable objects only, 0 = also objects still being written.
_INFO_READABLE, _INFO_ANY = 1, 0

_open_in_process: weakref.WeakSet[MemcacheBackend] = weakref.WeakSet()


def _meta_reachable(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class MemcacheBackend(CopyMixin, StreamMixin, StreamReadMixin):
    """Objects are allocated ``TRAILER`` bytes longer than asked: the streaming extension
    (``lw_memcache.streaming``) keeps each reservation's token there; handles report the asked size."""

    name = "memcache"
    _streaming = False
    _closed: bool  # set once the client is up; read by later instances (one client per process)

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
        if not config_path:
            raise BackendError(
                "kv_connector_extra_config.memcache_config_path is empty: give the mmc-local.conf path "
                "(write one with `lw-memcache config`)"
            )
        try:
            conf = read_conf(config_path)
        except OSError as e:
            raise BackendError(f"kv_connector_extra_config.memcache_config_path={config_path!r}: cannot read it ({e})") from e
        file_protocol = conf.get("ock.mmc.local_service.protocol")
        if file_protocol != protocol:
            raise BackendError(
                f"kv_connector_extra_config.memcache_protocol={protocol!r} but {config_path} sets "
                f"ock.mmc.local_service.protocol = {file_protocol}; make them agree"
            )
        try:
            host, port = meta_address(conf)
            conf = resolve_auto_hcom(conf)
        except ConfError as e:
            raise BackendError(f"{config_path}: {e}") from e
        for name, v in (("read_lease_ms", read_lease_ms), ("write_lease_ms", write_lease_ms)):
            if v <= 0:
                raise BackendError(f"{name}={v!r} must be > 0 (milliseconds)")
        if not (0 <= full_wait_s < float("inf")):
            raise BackendError(f"full_wait_s={full_wait_s!r} must be >= 0 seconds (0: a full pool refuses at once)")
        if any(not b._closed for b in _open_in_process):
            raise BackendError("a memcache client is already open in this process: close it first (one per process)")

        from lw_memcache.runtime import import_memcache

        self._mc = import_memcache(protocol)
        # Checked first because init() blocks ~80 s per attempt, five attempts, when it is down.
        if not _meta_reachable(host, port, connect_timeout_s):
            raise BackendUnavailable(
                f"memcache MetaService at tcp://{host}:{port} (from {config_path}) is not reachable: start it "
                "with `lw-memcache meta` (code -3014 once clients are running)"
            )
        self.config_path = config_path
        self.protocol = protocol
        self._full_wait_s = full_wait_s
        self._streaming = bool(streaming)  # writes are also staged for streaming readers
        self._wstreams: dict = {}  # key -> streaming.WriteStream of our open reservations
        self._read_lease_ms = read_lease_ms
        self._write_lease_ms = write_lease_ms
        self._lock = threading.Lock()
        # streaming: heads and segments waiting for their grace: (key, head's address or None)
        self._reaper: Reaper[tuple[str, int | None]] = Reaper("lw-memcache-reaper", self._remove_now,
                                                             grace_s=REMOVE_GRACE_S)
        self._writing: dict[str, MemcacheHandle] = {}
        self._sightings = Sightings(write_lease_ms / 1000)  # keys seen being written by others
        self._reading: Counter[str] = Counter()  # open read leases, released at close if forgotten
        self._device_regions: list[tuple[int, int]] = []
        self._stats = dict.fromkeys(
            ("lookups", "lookup_hits", "reserved", "reserve_skipped", "committed", "aborted", "opened",
             "open_misses", "released", "bytes_written", "bytes_read", "copy_calls", "errors", "unavailable"),
            0,
        )
        self._closed = True
        self._no_room = False
        local_cfg = self._local_config(conf, config_path)
        saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        self._store = self._mc.DistributedObjectStore()
        rc = self._store.setup(local_cfg)
        if rc != 0:
            raise errors.error_for(rc, f"client setup from {config_path}")
        rc = self._store.init(device_id, True)
        if restore_signals and threading.current_thread() is threading.main_thread():
            # The library replaces SIGINT/SIGTERM handlers; give them back to Python (Ctrl-C,
            # vLLM's own shutdown). close() still runs: from atexit or the owner.
            for s, h in saved.items():
                if h is not None:
                    signal.signal(s, h)
        if rc != 0:
            # Exiting without close() after init aborts the process (rc 134): close even on failure.
            try:
                self._store.close()
            finally:
                raise errors.error_for(rc, f"client init (device {device_id}, {protocol}, {config_path})")
        self._closed = False
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
        kwargs.setdefault("write_lease_ms", max(10_000, int(cfg.save_timeout_s * 2000)))
        kwargs.setdefault("read_lease_ms", max(10_000, int(cfg.layer_wait_timeout_s * 4000)))
        # A save waiting for room must leave most of its deadline to the copies.
        kwargs.setdefault("full_wait_s", min(2.0, cfg.save_timeout_s / 4))
        kwargs.setdefault("streaming", bool(getattr(cfg, "pd_streaming", False)))
        keys = cfg.backend_keys  # lw_memcache.plugin.MemcacheKeys
        return cls(keys.memcache_config_path, protocol=keys.memcache_protocol, **kwargs)

    # ----- helpers -----

    def _local_config(self, conf: dict[str, str], path: str) -> Any:
        cfg = self._mc.LocalConfig()
        known = {a for a in dir(cfg) if not a.startswith("_") and a != "str"}
        try:
            fields = local_config_fields(conf, known)
        except ConfError as e:
            raise BackendError(f"{path}: {e}") from e
        for attr, raw in fields.items():
            cur = getattr(cfg, attr)
            try:
                if isinstance(cur, bool):
                    if raw.lower() not in ("true", "false", "1", "0"):
                        raise ValueError("expected true or false")
                    value: Any = raw.lower() in ("true", "1")
                elif isinstance(cur, int):
                    value = int(raw)
                else:
                    value = raw
                setattr(cfg, attr, value)
            except (TypeError, ValueError) as e:
                raise BackendError(f"{path}: {attr} = {raw!r} is not valid ({e})") from e
        return cfg

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            self._fail(code, what)

    def _fail(self, code: int, what: str) -> None:
        with self._lock:
            self._stats["errors"] += 1
            if errors.is_unavailable(code):
                self._stats["unavailable"] += 1
        raise errors.error_for(code, what)

    def _count(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                self._stats[k] += v

    def _live(self) -> Any:
        if self._closed:
            raise BackendError("memcache backend is closed")
        return self._store

    def _orphaned(self, key: str, info: Any, now: float) -> bool:
        """``key`` is being written by another client (``info``: its ``batch_get_key_info``):
        is that reservation orphaned (``lw_memcache.orphans``)? Its writer died after allocating
        it on another client's memory, which the store never reclaims; re-reserving it
        (``batch_alloc`` returns the same space) lets the key be saved again."""
        return self._sightings.unfinished(key, (tuple(int(g) for g in info.gva_list()), int(info.size())), now)

    # ----- Backend protocol -----

    def lookup(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        res = self._live().batch_is_exist(list(keys))
        n = 0
        for r in res:
            if r == 1:
                n += 1
                continue
            if r != 0:
                self._fail(r, "lookup (batch_is_exist)")
            break
        self._sightings.forget(keys[:n])
        self._count(lookups=1, lookup_hits=n)
        return n

    def reserve(self, keys: Sequence[str], nbytes: int) -> list[MemcacheHandle | None]:
        if nbytes <= 0:
            raise ValueError(f"reserve: nbytes={nbytes} must be > 0")
        store = self._live()
        out: list[MemcacheHandle | None] = [None] * len(keys)
        if not keys:
            return out
        # batch_alloc hands out the existing space of a key that is committed or being written
        # (it would overwrite it), so keys in use are found first. info(flag=0) sees both; only
        # for those does batch_is_exist tell committed from unfinished: new keys cost one call.
        infos = store.batch_get_key_info(list(keys), _INFO_ANY)
        if len(infos) != len(keys):
            # It answers nothing when the MetaService is down; batch_is_exist says why (-3014).
            for r in store.batch_is_exist(list(keys)):
                if r not in (0, 1):
                    self._fail(r, "reserve (batch_is_exist)")
            self._fail(-1, f"reserve (batch_get_key_info answered {len(infos)} of {len(keys)} keys)")
        taken = [i for i, info in enumerate(infos) if info.size() > 0]
        readable = dict.fromkeys(taken, 0)
        if taken:
            res = store.batch_is_exist([keys[i] for i in taken])
            bad = [r for r in res if r not in (0, 1)]
            if bad:  # the MetaService is down (-3014) or failing: say so instead of "no room"
                self._fail(bad[0], "reserve (batch_is_exist)")
            readable = dict(zip(taken, res))
        now = time.monotonic()
        todo: list[int] = []
        seen: set[str] = set()
        # Readable or absent: no reservation of them is going on.
        self._sightings.forget(k for i, k in enumerate(keys) if readable.get(i, 1) == 1)
        for i, k in enumerate(keys):
            if k in seen or k in self._writing:
                continue  # reserved here already, or repeated in this batch
            if i in readable and (readable[i] == 1 or not self._orphaned(k, infos[i], now)):
                continue  # committed, or being written by another writer (not orphaned)
            seen.add(k)
            todo.append(i)
        deadline = now + self._full_wait_s
        while todo:
            todo = self._alloc(store, keys, todo, nbytes, out)
            # Allocation never evicts: the MetaService's periodic check (every second in the
            # configs we write) makes room. Wait for it, boundedly, as other stores evict inline.
            if not todo or time.monotonic() + _FULL_RETRY_S > deadline:
                break
            time.sleep(_FULL_RETRY_S)
        try:
            self._stream_start(out)
        except BackendError:
            self.abort([h for h in out if h is not None])
            raise
        self._sightings.forget(h.key for h in out if h is not None)
        n_ok = sum(h is not None for h in out)
        self._count(reserved=n_ok, reserve_skipped=len(keys) - n_ok)
        self._note_room(refused=len(todo), asked=len(keys), waited_s=time.monotonic() - now)
        return out

    def _note_room(self, *, refused: int, asked: int, waited_s: float) -> None:
        """Log once when the pool starts refusing objects for lack of room, and once when it takes
        them again: a pool whose memory went away (every ``lw-memcache hold`` gone) looks like a
        full one to the library, and the engines then quietly save nothing."""
        if refused and not self._no_room:
            self._no_room = True
            log.warning(
                "lw-memcache: the memcache pool had no room for %d of %d objects after waiting %.1f s; they are "
                "not saved (the pool is full, or no client lends memory: is `lw-memcache hold` running?)",
                refused, asked, waited_s,
            )
        elif not refused and self._no_room:
            self._no_room = False
            log.warning("lw-memcache: the memcache pool takes objects again")

    def _alloc(self, store: Any, keys: Sequence[str], todo: list[int], nbytes: int, out: list) -> list[int]:
        """batch_alloc ``keys[todo]``; fills ``out``, returns the indices refused for lack of room."""
        gvas = store.batch_alloc([keys[i] for i in todo], [nbytes + TRAILER] * len(todo), MEDIA_DRAM, self._write_lease_ms)
        if gvas and all(errors.is_unavailable(g) for g in gvas):
            self._fail(gvas[0], "reserve (batch_alloc)")
        failed = []
        with self._lock:
            for i, gva in zip(todo, gvas):
                if gva > 0:
                    h = MemcacheHandle(keys[i], nbytes, gva, True)
                    self._writing[h.key] = h
                    out[i] = h
                else:
                    failed.append(i)
        if failed:
            # A refused allocation (pool full: 0) can still leave the key half-created at the
            # MetaService, "being written" to everyone for good: remove it (write-finish with
            # a failure does not; remove does).
            store.remove_batch([keys[i] for i in failed])
        return failed

    def write(self, handles: Sequence[MemcacheHandle], offsets: Sequence[int], srcs: Sequence[Any]) -> None:
        for h in handles:
            if not h.writable or self._writing.get(h.key) is not h:
                raise BackendError(f"write to {h.key}: not a reservation of this backend (or already committed/aborted)")
        self._copy(handles, offsets, srcs, to_store=True)
        if self._streaming and self._wstreams:
            self._stream_write(handles, offsets, srcs)

    def _finish(self, handles: Sequence[MemcacheHandle], ok: bool) -> list[tuple[str, int]]:
        store = self._live()
        with self._lock:
            mine = [h for h in handles if self._writing.get(h.key) is h]
            for h in mine:
                del self._writing[h.key]
                h.state = 1 if ok else 2
        if not mine:
            return []
        keys = [h.key for h in mine]
        return list(zip(keys, store.batch_write_finish(keys, [0 if ok else 1] * len(mine))))

    def commit(self, handles: Sequence[MemcacheHandle]) -> None:
        res = self._finish(handles, True)
        bad = [(k, r) for k, r in res if r != 0]
        done = [k for k, r in res if r == 0]
        if done:
            # batch_alloc's write lease outlives write-finish: until it expires the object can be
            # neither evicted nor freed (a full pool stays full, a leaving holder waits). End it.
            self._live().batch_remove_lease(done)
        self._count(committed=len(done))
        if done:
            mine = set(done)
            self._stream_end([h for h in handles if h.key in mine], aborted=False)
        lost = [h.key for h in handles if h.state == 2]
        if lost:
            raise ObjectMissing(f"memcache: commit of {len(lost)} aborted reservation(s): {lost[:3]}")
        if bad:
            self._fail(bad[0][1], f"commit (batch_write_finish) of {len(bad)} object(s), first {bad[0][0]}")

    def abort(self, handles: Sequence[MemcacheHandle]) -> None:
        # Best effort: an unfinished object is invisible and reclaimed when its write lease ends.
        # Streaming readers are told first (abort marker), so they fail at once.
        with self._lock:
            mine = [h for h in handles if self._writing.get(h.key) is h]
        if mine and not self._closed:
            self._stream_end(mine, aborted=True)
        try:
            res = self._finish(handles, False)
        except BackendError:
            return
        self._count(aborted=len(res))
        if any(r != 0 for _, r in res):
            log.debug("memcache abort: write_finish codes %s", res)

    def open(self, keys: Sequence[str]) -> list[MemcacheHandle | None]:
        store = self._live()
        out: list[MemcacheHandle | None] = [None] * len(keys)
        if not keys:
            return out
        res = store.batch_add_lease(list(keys), self._read_lease_ms)
        if res and all(errors.is_unavailable(r) for r in res):
            self._fail(res[0], "open (batch_add_lease)")
        leased = [i for i, r in enumerate(res) if r == 0]
        if leased:
            infos = store.batch_get_key_info([keys[i] for i in leased], _INFO_READABLE)
            lost = []
            for i, info in zip(leased, infos):
                gvas = info.gva_list()
                if info.size() >= TRAILER and gvas:
                    out[i] = MemcacheHandle(keys[i], int(info.size()) - TRAILER, int(gvas[0]), False)
                else:
                    lost.append(keys[i])
            if lost:
                store.batch_remove_lease(lost)
        with self._lock:
            self._reading.update(h.key for h in out if h is not None)
        self._sightings.forget(h.key for h in out if h is not None)
        n_ok = sum(h is not None for h in out)
        self._count(opened=n_ok, open_misses=len(keys) - n_ok)
        return out

    def read(self, handles: Sequence[MemcacheHandle], offsets: Sequence[int], dsts: Sequence[Any]) -> None:
        if any(type(h) is MemcacheStreamHandle for h in handles):
            self._read_stream(handles, offsets, dsts)
            return
        self._copy(handles, offsets, dsts, to_store=False)

    def release(self, handles: Sequence[MemcacheHandle]) -> None:
        # Streaming handles on reservations hold nothing; on committed objects, a read lease.
        keys = [h.key for h in handles if not h.writable and getattr(h, "leased", True)]
        for h in handles:
            if type(h) is MemcacheStreamHandle:
                h.leased = False
        if not keys or self._closed:
            return
        with self._lock:
            self._reading.subtract(keys)
            self._reading = +self._reading
        # Best effort: a lease that cannot be removed (MetaService down) simply expires.
        rc = self._store.batch_remove_lease(keys)
        self._count(released=len(keys))
        if rc != 0:
            log.debug("memcache release: batch_remove_lease code %s", rc)

    def view(self, handle: MemcacheHandle, offset: int, nbytes: int) -> memoryview | None:
        return None  # objects live in the store's global space; use read/write

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._stats)
            out["writing"] = len(self._writing)
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._writing.values())
            self._writing.clear()
            leased = list(self._reading)
            self._reading.clear()
        # Leaving: drop half-written objects (never publish them) and our read leases (the
        # holder of a leased object waits for the lease to end before it can leave).
        try:
            if pending:
                self._stream_end(pending, aborted=True)
                self._store.batch_write_finish([h.key for h in pending], [1] * len(pending))
            if leased:
                self._store.batch_remove_lease(leased)
        except Exception:  # noqa: BLE001 - leaving anyway
            pass
        self._reaper.close()
        self._store.close()
        _open_in_process.discard(self)

    def __enter__(self) -> MemcacheBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
