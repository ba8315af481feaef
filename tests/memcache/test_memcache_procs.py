"""MemcacheBackend across processes on a real MetaService (CPU stand-in for the Ascend runtime)."""

from __future__ import annotations

import time

import pytest
from mc_support import expected, needs_memcache, wait_until

pytestmark = [needs_memcache, pytest.mark.slow]

L, N = 4, 4096  # layers per object, bytes per layer


def _keys(prefix: str, n: int) -> list[str]:
    return [f"lw1/test/{prefix}/{i:04d}" for i in range(n)]


def _save_eventually(c, keys, n, timeout_s) -> bool:
    """What a writer does: save whatever it can reserve, right away, until all keys are saved."""
    done: set[str] = set()

    def save_rest() -> bool:
        rest = [k for k in keys if k not in done]
        got = [k for k, ok in zip(rest, c.ok("reserve", keys=rest, layers=L, layer_nbytes=n)) if ok]
        if got:
            c.write(got, range(L), n)
            c.ok("commit", keys=got)
            done.update(got)
        return len(done) == len(keys)

    return bool(wait_until(save_rest, timeout_s, interval_s=0.5))


def _write_all(w, keys, layers=range(L)):
    assert all(w.ok("reserve", keys=keys, layers=L, layer_nbytes=N))
    w.write(keys, layers, N)


def test_round_trip_across_processes_per_layer_and_whole(pool, make_client):
    keys = _keys("rt", 6)
    w = make_client(pool.extra_config)
    r = make_client(pool.extra_config)
    _write_all(w, keys)
    w.ok("commit", keys=keys)

    assert r.ok("lookup", keys=keys) == len(keys)
    assert r.ok("lookup", keys=keys[:3] + ["lw1/test/rt/missing"] + keys[3:]) == 3
    assert all(r.ok("open", keys=keys))
    # Per layer, newest layer first (one batched read per layer), then each object whole.
    for layer in reversed(range(L)):
        got = r.read([(k, layer * N, N) for k in keys])
        assert got == [expected(k, layer, N) for k in keys]
    whole = r.read([(k, 0, L * N) for k in keys])
    assert whole == [b"".join(expected(k, layer, N) for layer in range(L)) for k in keys]
    # A range across a layer boundary.
    assert r.read([(keys[0], N - 100, 200)]) == [expected(keys[0], 0, N)[-100:] + expected(keys[0], 1, N)[:100]]
    r.ok("release", keys=keys)
    # Write-once: a committed key is not reserved again, by the writer or by anyone else.
    assert r.ok("reserve", keys=keys[:2], layers=L, layer_nbytes=N) == [False, False]
    assert w.ok("reserve", keys=keys[:2], layers=L, layer_nbytes=N) == [False, False]


def test_reserved_but_unfinished_is_never_a_hit(pool, make_client):
    keys = _keys("unfinished", 3)
    w = make_client(pool.extra_config)
    r = make_client(pool.extra_config)
    _write_all(w, keys)  # every byte written, not committed

    assert r.ok("lookup", keys=keys) == 0
    assert r.ok("open", keys=keys) == [False] * 3
    # Another writer sees the object as taken (being written), not as free.
    assert r.ok("reserve", keys=keys, layers=L, layer_nbytes=N) == [False] * 3

    w.ok("commit", keys=keys[:2])
    assert r.ok("lookup", keys=keys) == 2
    w.ok("abort", keys=keys[2:])
    assert r.ok("lookup", keys=keys) == 2
    assert r.ok("open", keys=keys) == [True, True, False]
    assert r.read([(k, 3 * N, N) for k in keys[:2]]) == [expected(k, 3, N) for k in keys[:2]]
    r.ok("release", keys=keys[:2])


def test_writer_killed_mid_object_leaves_nothing_visible(pool, make_client):
    keys = _keys("killed", 4)
    w = make_client(pool.extra_config, write_lease_ms=3000)  # short: holders wait for it on close
    # Objects are placed round-robin on every client's memory; what the dead writer allocated on
    # the others' stays "being written" until a writer re-reserves it after a write lease.
    r = make_client(pool.extra_config, write_lease_ms=3000)
    _write_all(w, keys, layers=range(L // 2))  # half the layers
    w.kill()

    t0 = time.monotonic()
    for _ in range(5):  # over a couple of seconds: the dead writer's blocks are reclaimed meanwhile
        assert r.ok("lookup", keys=keys) == 0
        assert r.ok("open", keys=keys) == [False] * 4
        time.sleep(0.5)
    assert time.monotonic() - t0 < 30
    # The keys are free again for a new writer once the dead writer's blocks are reclaimed.
    assert _save_eventually(r, keys, N, 20), "keys of the dead writer never freed"
    assert r.ok("lookup", keys=keys) == 4


def test_metaservice_killed_fails_fast_and_restart_is_picked_up(pool, make_client):
    keys = _keys("meta", 5)
    # Short leases: a client leaving waits for leases on what it holds, and a restart orphans them.
    w = make_client(pool.extra_config, write_lease_ms=3000, read_lease_ms=3000)
    r = make_client(pool.extra_config, write_lease_ms=3000, read_lease_ms=3000)
    _write_all(w, keys)
    w.ok("commit", keys=keys)
    assert r.ok("lookup", keys=keys) == 5

    pool.kill()
    for op, args in (("lookup", {"keys": keys}), ("open", {"keys": keys}),
                     ("reserve", {"keys": _keys("meta-new", 2), "layers": L, "layer_nbytes": N})):
        t0 = time.monotonic()
        res = r.call(op, timeout_s=15, **args)
        took = time.monotonic() - t0
        assert not res["ok"] and res["type"] == "BackendUnavailable", res
        assert "-3014" in res["error"] and "MetaService" in res["error"]
        assert took < 5, f"{op} took {took:.1f} s with the MetaService down"

    pool.restart()
    # Clients reconnect on their own. Objects committed before the restart do not come back
    # (memcache 1.3.0 rebuilds no blobs for allocate/write-finish objects): they read as misses,
    # which the connector recomputes. New saves work and are visible across processes again.
    assert wait_until(lambda: r.call("lookup", keys=keys).get("ok"), 30), "restarted MetaService not picked up"
    assert r.ok("lookup", keys=keys) in (0, 5)
    fresh = _keys("meta-after", 3)
    assert wait_until(lambda: all(w.call("reserve", keys=fresh, layers=L, layer_nbytes=N).get("value") or [False]), 30)
    w.write(fresh, range(L), N)
    w.ok("commit", keys=fresh)
    assert r.ok("lookup", keys=fresh) == 3
    assert all(r.ok("open", keys=fresh))
    assert r.read([(k, 0, L * N) for k in fresh]) == [b"".join(expected(k, i, N) for i in range(L)) for k in fresh]
    r.ok("release", keys=fresh)


def _offer_100_mib(c, n) -> int:
    refused = 0
    for rnd in range(10):
        keys = _keys(f"full{rnd}", 10)
        ok = c.ok("reserve", keys=keys, layers=L, layer_nbytes=n)
        got = [k for k, o in zip(keys, ok) if o]
        refused += len(keys) - len(got)
        c.write(got, range(L), n)
        c.ok("commit", keys=got)
    return refused


def test_full_pool_refuses_what_does_not_fit_then_evicts(pool, make_client):
    # full_wait_s=0: reserve answers at once, so a full pool refuses until eviction ran.
    c = make_client(pool.extra_config, full_wait_s=0)  # the only client: the pool is its 64 MiB
    n = 256 << 10  # 1 MiB objects
    assert _offer_100_mib(c, n) > 0, "100 MiB fitted in a 64 MiB pool"
    # The MetaService's periodic eviction makes room: new objects fit again, old ones are gone.
    fresh = _keys("full-after", 5)
    assert _save_eventually(c, fresh, n, 15), "no room made within 15 s"
    assert c.ok("lookup", keys=fresh) == 5
    assert sum(c.ok("lookup", keys=_keys(f"full{rnd}", 10)[:1]) for rnd in range(10)) < 10


def test_full_pool_reserve_waits_for_eviction(pool, make_client):
    # By default reserve waits (boundedly) for the periodic eviction, as a store that evicts
    # inline would: every save of 100 MiB into 64 MiB succeeds, the oldest objects are gone.
    c = make_client(pool.extra_config)
    n = 256 << 10
    t0 = time.monotonic()
    assert _offer_100_mib(c, n) == 0
    assert time.monotonic() - t0 < 10 * 2.5  # never more than full_wait_s (2 s) per reserve
    assert c.ok("lookup", keys=_keys("full9", 10)) == 10
    assert sum(c.ok("lookup", keys=_keys(f"full{rnd}", 10)[:1]) for rnd in range(10)) < 10
    assert c.ok("stats")["reserve_skipped"] == 0
