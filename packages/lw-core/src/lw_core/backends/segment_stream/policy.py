"""The clean-up policy of the segment-streaming protocol, for every backend on it. What a finished
reservation leaves (head, segments, abort marker) is never read past its marker or its commit, so
clean-up is about the pool's room and about not hurting readers, never about correctness:

* **Marker first.** ``abort`` (and ``close`` with reservations open, and a failed commit) puts the
  abort marker *before* anything is removed, so waiters fail at once instead of at their deadline.
  A marker is kept ``MARKER_KEEP_S`` for readers that poll late (stores that remove it; memcache
  leaves its 64-byte markers to eviction).
* **No removal under a reader.** A head or segment goes only once no reader can still be copying
  out of it. memcache removes leased objects, and a reader's lease on an object removed under it
  outlives its release (memcache-hybrid 1.3.0 keeps renewing it, -3102), after which that client can
  lease nothing placed at that address: so memcache removes heads and segments ``REMOVE_GRACE_S``
  after the commit or abort (far longer than a reader's one-copy lease), by a reaper thread.
  Mooncake refuses to remove what a reader holds a read lease on (OBJECT_HAS_LEASE; its master
  leases what ``batch_is_exist`` finds too), so it removes at once and retries what was refused
  every ``RETRY_S``, up to ``MAX_TRIES`` times, from later calls. Both queue what waits in a
  ``removals.Removals`` of at most ``MAX_QUEUED`` entries (beyond, the oldest is left to eviction),
  run by a ``reaper.Reaper`` (memcache) or a ``collector.Collector`` (Mooncake).
* **Quiet after a timeout.** When the store stops answering (a call past its deadline),
  streaming's own calls (publishing, markers, clean-up) are skipped for ``QUIET_S``, so a dead
  store costs one deadline, not one per layer in the save path; readers then wait for their
  deadline and recompute, as without streaming. (memcache's client calls have no deadline of
  ours; its calls fail or answer.)
* **At close** memcache removes at once what waits for its grace (the client is leaving); Mooncake
  removes what is due, and leaves the rest (markers kept for late pollers, leased segments) to
  eviction.

The cost: while streaming, the pool holds a reservation's published bytes twice, from its first
publish until the grace (or the last reader's lease) after its commit.
"""

from __future__ import annotations

import time

REMOVE_GRACE_S = 2.0  # heads and segments outlive their reservation's commit or abort this long (memcache)
MARKER_KEEP_S = 120.0  # how long an abort marker stays for readers that poll late
RETRY_S = 1.0  # a removal the store refused (a reader's lease) is tried again after this
MAX_TRIES = 600  # ... this many times, then left to eviction
MAX_QUEUED = 1 << 16  # names waiting for removal; beyond, the oldest is left to eviction
QUIET_S = 10.0  # after a store call timed out, streaming's own calls are skipped this long


class QuietPeriod:
    """Whether streaming's own store calls are skipped now (``QUIET_S`` after a timeout)."""

    def __init__(self, quiet_s: float = QUIET_S) -> None:
        self.quiet_s = quiet_s
        self.until = 0.0

    def __bool__(self) -> bool:
        return time.monotonic() < self.until

    def start(self) -> None:
        self.until = time.monotonic() + self.quiet_s
