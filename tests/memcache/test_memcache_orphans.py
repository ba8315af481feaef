"""Which unfinished objects ``reserve`` takes over as orphaned (``lw_memcache.orphans``): the same
reservation seen unfinished for longer than a write lease, never a live writer's fresh reservation
of a key whose earlier reservation was seen long ago (the store hands that one the same address).

The ``Sightings`` tests need no store; the others run client processes on a real MetaService."""

from __future__ import annotations

import time

import pytest
from mc_support import expected, needs_memcache

from lw_memcache.orphans import Sightings

L, N = 4, 4096
AT = ((1 << 56,), L * N + 16)  # a key's (addresses, size) as batch_get_key_info tells them


def test_one_reservation_watched_for_longer_than_a_lease_is_orphaned():
    s = Sightings(lease_s=10.0)
    assert [s.unfinished("k", AT, t) for t in (0.0, 6.0, 10.0)] == [False, False, False]
    assert s.unfinished("k", AT, 12.0)  # seen since 0, never more than a lease apart
    assert len(s) == 0  # taken over: the sighting is gone
    assert not s.unfinished("k", AT, 13.0)


def test_a_sighting_not_renewed_within_a_lease_starts_over():
    # Seen once while a writer was writing; the key may since have been committed, evicted and
    # reserved again by a live writer at the same address: that one is not judged by the old sighting.
    s = Sightings(lease_s=10.0)
    assert not s.unfinished("k", AT, 0.0)
    assert not s.unfinished("k", AT, 30.0)
    assert not s.unfinished("k", AT, 39.0)
    assert s.unfinished("k", AT, 40.5)


def test_another_address_or_size_is_another_reservation():
    s = Sightings(lease_s=10.0)
    assert not s.unfinished("k", AT, 0.0)
    assert not s.unfinished("k", ((2 << 56,), AT[1]), 6.0)
    assert not s.unfinished("k", ((2 << 56,), AT[1] * 2), 12.0)
    assert not s.unfinished("k", ((2 << 56,), AT[1] * 2), 20.0)
    assert s.unfinished("k", ((2 << 56,), AT[1] * 2), 22.5)


def test_seen_readable_absent_or_reserved_forgets_the_sighting():
    s = Sightings(lease_s=10.0)
    assert not s.unfinished("k", AT, 0.0)
    assert not s.unfinished("other", AT, 0.0)
    s.forget(["k"])
    assert len(s) == 1
    assert not s.unfinished("k", AT, 6.0)
    assert not s.unfinished("other", AT, 6.0)
    assert not s.unfinished("k", AT, 12.0)  # seen since 6 only
    assert s.unfinished("other", AT, 10.5)  # the one not forgotten
    assert s.unfinished("k", AT, 16.5)


def test_sightings_are_bounded_and_the_least_recently_seen_go_first():
    s = Sightings(lease_s=10.0, cap=4)
    for i in range(4):
        s.unfinished(f"k{i}", AT, float(i))
    s.unfinished("k0", AT, 4.0)  # renewed: now the most recently seen
    s.unfinished("k4", AT, 5.0)  # over the cap: down to half, least recently seen first
    assert len(s) == 2
    assert s.unfinished("k0", AT, 10.5)  # kept, and seen since 0
    assert not s.unfinished("k1", AT, 10.5)  # dropped: starts over


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="lease_s"):
        Sightings(lease_s=0)
    with pytest.raises(ValueError, match="cap"):
        Sightings(lease_s=1.0, cap=1)


def _reserve(c, key) -> bool:
    (ok,) = c.ok("reserve", keys=[key], layers=L, layer_nbytes=N)
    return ok


@needs_memcache
@pytest.mark.slow
def test_a_live_writers_fresh_reservation_is_not_taken_for_an_orphan(pool, make_client):
    key = "lw1/test/orphans/fresh"
    w = make_client(pool.extra_config)
    b = make_client(pool.extra_config, write_lease_ms=1500)
    assert _reserve(w, key)
    assert not _reserve(b, key)  # being written: b sees it unfinished
    w.write([key], range(L), N)
    w.ok("commit", keys=[key])
    w.ok("remove", keys=[key])  # evicted
    time.sleep(1.8)  # longer than b's write lease since b's sighting
    assert _reserve(w, key)  # the writer saves the key again (its space: the same address)
    assert not _reserve(b, key)  # a fresh reservation: not orphaned, b leaves it to its writer
    assert b.ok("stats")["reserved"] == 0
    w.write([key], range(L), N)
    w.ok("commit", keys=[key])
    assert all(b.ok("open", keys=[key]))
    assert b.read([(key, 0, L * N)]) == [b"".join(expected(key, i, N) for i in range(L))]
    b.ok("release", keys=[key])


@needs_memcache
@pytest.mark.slow
def test_seeing_the_key_committed_forgets_the_earlier_reservation(pool, make_client):
    key = "lw1/test/orphans/committed"
    w = make_client(pool.extra_config)
    b = make_client(pool.extra_config, write_lease_ms=3000)
    t0 = time.monotonic()
    assert _reserve(w, key)
    assert not _reserve(b, key)  # b's sighting of the first reservation
    w.write([key], range(L), N)
    w.ok("commit", keys=[key])
    assert not _reserve(b, key)  # committed: b forgets its sighting
    time.sleep(max(0.0, t0 + 1.2 - time.monotonic()))
    w.ok("remove", keys=[key])
    assert _reserve(w, key)
    assert not _reserve(b, key)  # the second reservation, seen within a lease of the first sighting
    time.sleep(max(0.0, t0 + 3.5 - time.monotonic()))
    # More than a lease since the first sighting, less since the second reservation was first seen.
    assert time.monotonic() - t0 < 4.4
    assert not _reserve(b, key)
    assert b.ok("stats")["reserved"] == 0
    w.ok("abort", keys=[key])
