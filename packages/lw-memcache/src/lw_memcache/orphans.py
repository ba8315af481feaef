"""Which unfinished objects ``MemcacheBackend.reserve`` may take over as orphaned.

memcache-hybrid hands a key's space to every ``batch_alloc`` of it, also while another client is
still writing it; and a writer killed after ``batch_alloc`` leaves the objects it placed on other
clients' memory "being written" for good. So ``reserve`` skips a key being written unless its
reservation is orphaned: the same reservation observed unfinished for longer than a write lease (a
live writer commits or aborts within its save deadline, well inside its write lease).

The store does not tell reservations apart: a key's info is its placement and size (``loc``,
``type``, ``gva``, ``blobNum``, ``size``), no writer, lease or version; and a fresh reservation of
a key that was committed and then evicted or removed, or aborted, lands at the very address of the
last one (observed with memcache-hybrid 1.3.0). So "the same reservation" is judged by watching it.
A *sighting* is a key's (address, size) with the times it was first and last seen unfinished:

* seeing the key readable or absent, or reserving it here, drops its sighting;
* another address or size, or a sighting not renewed within a write lease (the key could have been
  committed, evicted and reserved again unseen meanwhile), starts it over;
* orphaned: one sighting spanning more than a write lease.

Left open: a key committed, removed and reserved again at the same address and size between two
sightings less than a write lease apart is taken for one reservation. Taking over an orphan needs
reserves of the key no further apart than a write lease; a key asked for more rarely stays
unwritable (a miss, recomputed) until the client holding its memory leaves.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

Where = tuple[tuple[int, ...], int]  # (addresses, size) from batch_get_key_info


@dataclass(slots=True)
class _Sighting:
    where: Where
    first: float
    last: float


class Sightings:
    """Unfinished keys seen by one client; thread-safe. ``lease_s``: the write lease, in seconds."""

    def __init__(self, lease_s: float, cap: int = 100_000) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s={lease_s!r} must be > 0 seconds")
        if cap < 2:
            raise ValueError(f"cap={cap!r} must be >= 2 sightings")
        self.lease_s = lease_s
        self._cap = cap
        self._seen: OrderedDict[str, _Sighting] = OrderedDict()  # least recently seen first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def unfinished(self, key: str, where: Where, now: float) -> bool:
        """``key`` is seen unfinished at ``where`` now: is its reservation orphaned? An orphaned
        key's sighting is dropped (the caller takes the key over)."""
        with self._lock:
            s = self._seen.get(key)
            if s is None or s.where != where or now - s.last > self.lease_s:
                self._seen[key] = _Sighting(where, now, now)
                self._seen.move_to_end(key)
                self._bound(now)
                return False
            s.last = now
            self._seen.move_to_end(key)
            if now - s.first > self.lease_s:
                del self._seen[key]
                return True
            return False

    def forget(self, keys: Iterable[str]) -> None:
        """The keys are readable, absent or reserved here: whatever was being written is done."""
        if not self._seen:
            return
        with self._lock:
            for k in keys:
                self._seen.pop(k, None)

    def _bound(self, now: float) -> None:
        if len(self._seen) <= self._cap:
            return
        # Sightings not renewed within a lease start over anyway; then the least recently seen.
        for k in [k for k, s in self._seen.items() if now - s.last > self.lease_s]:
            del self._seen[k]
        if len(self._seen) > self._cap:
            while len(self._seen) > self._cap // 2:
                self._seen.popitem(last=False)
