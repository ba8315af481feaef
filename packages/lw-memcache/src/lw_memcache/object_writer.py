"""``ObjectWriter``: the writing half of the ``Backend`` protocol on memcache (reserve, write,
commit, abort), in store calls (all batched):

* ``reserve``: ``batch_get_key_info(flag=0)`` (sees objects being written too) skips keys that
  exist or are being written (unless orphaned: ``lw_memcache.orphans``), then ``batch_alloc``
  places the rest and takes a write lease; the answer is each object's global address (GVA).
* ``write``: ``batch_copy(GVA + offset, buffer, size)`` -- a ranged copy per layer, no metadata
  round trip. ``commit``: ``batch_write_finish(res=0)``: only now does the object become
  readable (``batch_is_exist`` / ``batch_add_lease`` fail on it before). ``abort``:
  ``batch_write_finish(res=1)`` drops it.

Invariants:

* It owns this client's open reservations (key -> handle, own lock): a handle is written,
  committed or aborted only while it is the one held for its key, and leaves them exactly once
  (``state`` 1 or 2), or at ``drain`` when the backend closes.
* Objects are allocated ``TRAILER`` bytes longer than asked (``lw_memcache.streaming``).
* The streaming hooks (``StreamWriter``) run after reserve and write, after commit, and before
  abort (its marker first, so waiting readers fail at once).
* Allocation never evicts: a full pool is retried for ``full_wait_s`` while the MetaService's
  periodic check makes room; the pool running out of room, and having room again, is logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from lw_core.backend import BackendError, ObjectMissing
from lw_memcache import errors
from lw_memcache.client import FINISH_FAILED, FINISH_OK, INFO_ANY, MEDIA_DRAM, StoreClient
from lw_memcache.copies import Copier
from lw_memcache.handles import MemcacheHandle
from lw_memcache.orphans import Sightings
from lw_memcache.stream_write import StreamWriter
from lw_memcache.streaming import TRAILER

log = logging.getLogger(__name__)

_FULL_RETRY_S = 0.2  # between allocation attempts while a full pool waits for its eviction check


class ObjectWriter:
    """Reservations of the client ``client``, written through ``copier`` and streamed by
    ``streams``; ``sightings`` judges which keys being written elsewhere are orphaned."""

    def __init__(self, client: StoreClient, copier: Copier, sightings: Sightings, streams: StreamWriter, *,
                 write_lease_ms: int, full_wait_s: float) -> None:
        self.client = client
        self.copier = copier
        self.sightings = sightings
        self.streams = streams
        self.write_lease_ms = write_lease_ms
        self.full_wait_s = full_wait_s
        self._lock = threading.Lock()
        self._writing: dict[str, MemcacheHandle] = {}
        self._no_room = False

    def __len__(self) -> int:
        """Open reservations."""
        with self._lock:
            return len(self._writing)

    def holds(self, h: Any) -> bool:
        """``h`` is an open reservation of this writer (not committed, aborted or another's)."""
        return self._writing.get(h.key) is h

    def reserve(self, keys: Sequence[str], nbytes: int) -> list[MemcacheHandle | None]:
        if nbytes <= 0:
            raise ValueError(f"reserve: nbytes={nbytes} must be > 0")
        store = self.client.live()
        out: list[MemcacheHandle | None] = [None] * len(keys)
        if not keys:
            return out
        # batch_alloc hands out the existing space of a key that is committed or being written
        # (it would overwrite it), so keys in use are found first. info(flag=0) sees both; only
        # for those does batch_is_exist tell committed from unfinished: new keys cost one call.
        infos = store.batch_get_key_info(list(keys), INFO_ANY)
        if len(infos) != len(keys):
            # It answers nothing when the MetaService is down; batch_is_exist says why (-3014).
            for r in store.batch_is_exist(list(keys)):
                if r not in (0, 1):
                    self.client.fail(r, "reserve (batch_is_exist)")
            self.client.fail(-1, f"reserve (batch_get_key_info answered {len(infos)} of {len(keys)} keys)")
        taken = [i for i, info in enumerate(infos) if info.size() > 0]
        readable = dict.fromkeys(taken, 0)
        if taken:
            res = store.batch_is_exist([keys[i] for i in taken])
            bad = [r for r in res if r not in (0, 1)]
            if bad:  # the MetaService is down (-3014) or failing: say so instead of "no room"
                self.client.fail(bad[0], "reserve (batch_is_exist)")
            readable = dict(zip(taken, res))
        now = time.monotonic()
        todo: list[int] = []
        seen: set[str] = set()
        # Readable or absent: no reservation of them is going on.
        self.sightings.forget(k for i, k in enumerate(keys) if readable.get(i, 1) == 1)
        for i, k in enumerate(keys):
            if k in seen or k in self._writing:
                continue  # reserved here already, or repeated in this batch
            if i in readable and (readable[i] == 1 or not self._orphaned(k, infos[i], now)):
                continue  # committed, or being written by another writer (not orphaned)
            seen.add(k)
            todo.append(i)
        deadline = now + self.full_wait_s
        while todo:
            todo = self._alloc(store, keys, todo, nbytes, out)
            # Allocation never evicts: the MetaService's periodic check (every second in the
            # configs we write) makes room. Wait for it, boundedly, as other stores evict inline.
            if not todo or time.monotonic() + _FULL_RETRY_S > deadline:
                break
            time.sleep(_FULL_RETRY_S)
        try:
            self.streams.start(out)
        except BackendError:
            self.abort([h for h in out if h is not None])
            raise
        self.sightings.forget(h.key for h in out if h is not None)
        n_ok = sum(h is not None for h in out)
        self.client.count(reserved=n_ok, reserve_skipped=len(keys) - n_ok)
        self._note_room(refused=len(todo), asked=len(keys), waited_s=time.monotonic() - now)
        return out

    def _orphaned(self, key: str, info: Any, now: float) -> bool:
        """``key`` is being written by another client (``info``: its ``batch_get_key_info``):
        is that reservation orphaned (``lw_memcache.orphans``)? Its writer died after allocating
        it on another client's memory, which the store never reclaims; re-reserving it
        (``batch_alloc`` returns the same space) lets the key be saved again."""
        return self.sightings.unfinished(key, (tuple(int(g) for g in info.gva_list()), int(info.size())), now)

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
        gvas = store.batch_alloc([keys[i] for i in todo], [nbytes + TRAILER] * len(todo), MEDIA_DRAM, self.write_lease_ms)
        if gvas and all(errors.is_unavailable(g) for g in gvas):
            self.client.fail(gvas[0], "reserve (batch_alloc)")
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
        self.copier.copy(handles, offsets, srcs, to_store=True)
        if self.streams.active():
            self.streams.write(handles, offsets, srcs)

    def _finish(self, handles: Sequence[MemcacheHandle], ok: bool) -> list[tuple[str, int]]:
        store = self.client.live()
        with self._lock:
            mine = [h for h in handles if self._writing.get(h.key) is h]
            for h in mine:
                del self._writing[h.key]
                h.state = 1 if ok else 2
        if not mine:
            return []
        keys = [h.key for h in mine]
        return list(zip(keys, store.batch_write_finish(keys, [FINISH_OK if ok else FINISH_FAILED] * len(mine))))

    def commit(self, handles: Sequence[MemcacheHandle]) -> None:
        res = self._finish(handles, True)
        bad = [(k, r) for k, r in res if r != 0]
        done = [k for k, r in res if r == 0]
        if done:
            # batch_alloc's write lease outlives write-finish: until it expires the object can be
            # neither evicted nor freed (a full pool stays full, a leaving holder waits). End it.
            self.client.live().batch_remove_lease(done)
        self.client.count(committed=len(done))
        if done:
            mine = set(done)
            self.streams.end([h for h in handles if h.key in mine], aborted=False)
        lost = [h.key for h in handles if h.state == 2]
        if lost:
            raise ObjectMissing(f"memcache: commit of {len(lost)} aborted reservation(s): {lost[:3]}")
        if bad:
            self.client.fail(bad[0][1], f"commit (batch_write_finish) of {len(bad)} object(s), first {bad[0][0]}")

    def abort(self, handles: Sequence[MemcacheHandle]) -> None:
        # Best effort: an unfinished object is invisible and reclaimed when its write lease ends.
        # Streaming readers are told first (abort marker), so they fail at once.
        with self._lock:
            mine = [h for h in handles if self._writing.get(h.key) is h]
        if mine and not self.client.closed:
            self.streams.end(mine, aborted=True)
        try:
            res = self._finish(handles, False)
        except BackendError:
            return
        self.client.count(aborted=len(res))
        if any(r != 0 for _, r in res):
            log.debug("memcache abort: write_finish codes %s", res)

    def drain(self) -> list[MemcacheHandle]:
        """The open reservations, forgotten here (``close`` drops them with ``drop``)."""
        with self._lock:
            pending = list(self._writing.values())
            self._writing.clear()
        return pending

    def drop(self, pending: Sequence[MemcacheHandle]) -> None:
        """Drop reservations ``drain`` handed out, never publishing them (the client is leaving)."""
        self.streams.end(pending, aborted=True)
        self.client.store.batch_write_finish([h.key for h in pending], [FINISH_FAILED] * len(pending))
