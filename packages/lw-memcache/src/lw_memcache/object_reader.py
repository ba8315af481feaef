"""``ObjectReader``: the reading half of the ``Backend`` protocol on memcache (lookup, open, read,
release), in store calls: ``batch_is_exist``; ``batch_add_lease`` (fails on missing and on
unfinished objects) then ``batch_get_key_info`` for the address; ``batch_copy`` from
``GVA + offset``; ``batch_remove_lease``.

Invariants:

* Only committed objects are read, each under a read lease of ``read_lease_ms`` taken by ``open``.
* It owns the count of the read leases it holds per key (own lock): ``release`` takes them off,
  ``drain`` hands what is left to ``close``, which removes them (the holder of a leased object
  waits for the lease to end before it can leave).
* Keys found readable are no longer candidate orphans (``Sightings.forget``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from lw_memcache import errors
from lw_memcache.client import INFO_READABLE, StoreClient
from lw_memcache.copies import Copier
from lw_memcache.handles import MemcacheHandle, MemcacheStreamHandle
from lw_memcache.orphans import Sightings
from lw_memcache.streaming import TRAILER

log = logging.getLogger(__name__)


class ObjectReader:
    """Reads committed objects through the client ``client`` and ``copier``; tells ``sightings``
    which keys are readable."""

    def __init__(self, client: StoreClient, copier: Copier, sightings: Sightings, *, read_lease_ms: int) -> None:
        self.client = client
        self.copier = copier
        self.sightings = sightings
        self.read_lease_ms = read_lease_ms
        self._lock = threading.Lock()
        self._reading: Counter[str] = Counter()  # open read leases, released at close if forgotten

    def lookup(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        res = self.client.live().batch_is_exist(list(keys))
        n = 0
        for r in res:
            if r == 1:
                n += 1
                continue
            if r != 0:
                self.client.fail(r, "lookup (batch_is_exist)")
            break
        self.sightings.forget(keys[:n])
        self.client.count(lookups=1, lookup_hits=n)
        return n

    def open(self, keys: Sequence[str], *, retry_s: float = 0.0) -> list[MemcacheHandle | None]:
        """Lease and place ``keys``; ``None`` where that fails. A lease the client refuses for a
        moment is tried again for up to ``retry_s`` (``StoreClient.add_lease``)."""
        store = self.client.live()
        out: list[MemcacheHandle | None] = [None] * len(keys)
        if not keys:
            return out
        res = self.client.add_lease(list(keys), self.read_lease_ms, retry_s)
        if res and all(errors.is_unavailable(r) for r in res):
            self.client.fail(res[0], "open (batch_add_lease)")
        leased = [i for i, r in enumerate(res) if r == 0]
        if leased:
            infos = store.batch_get_key_info([keys[i] for i in leased], INFO_READABLE)
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
        self.sightings.forget(h.key for h in out if h is not None)
        n_ok = sum(h is not None for h in out)
        self.client.count(opened=n_ok, open_misses=len(keys) - n_ok)
        return out

    def read(self, handles: Sequence[MemcacheHandle], offsets: Sequence[int], dsts: Sequence[Any]) -> None:
        self.copier.copy(handles, offsets, dsts, to_store=False)

    def release(self, handles: Sequence[Any]) -> None:
        # Streaming handles on reservations hold nothing; on committed objects, a read lease.
        keys = [h.key for h in handles if not h.writable and getattr(h, "leased", True)]
        for h in handles:
            if type(h) is MemcacheStreamHandle:
                h.leased = False
        if not keys or self.client.closed:
            return
        with self._lock:
            self._reading.subtract(keys)
            self._reading = +self._reading
        # Best effort: a lease that cannot be removed (MetaService down) simply expires.
        rc = self.client.store.batch_remove_lease(keys)
        self.client.count(released=len(keys))
        if rc != 0:
            log.debug("memcache release: batch_remove_lease code %s", rc)

    def drain(self) -> list[str]:
        """The keys this reader still holds read leases on, forgotten here (``close`` drops them)."""
        with self._lock:
            leased = list(self._reading)
            self._reading.clear()
        return leased
