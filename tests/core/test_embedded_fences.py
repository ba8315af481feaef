"""The embedded pool's memory fences (lw_core/backends/embedded/fences.py).

This machine is x86 (TSO), so the reorderings a weakly ordered CPU (aarch64) makes cannot happen
here. What is checked instead: each lock-free step calls the fence between the accesses it must
order, and the accesses after the fence see what another process made visible at the fence (the
fence is replaced by one that does the other side's store at that moment, which is what an aarch64
reader may see: the store arrives only once the barrier is passed); and which fence each CPU gets,
or that the pool is refused where there is none.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from lw_core.backend import BackendError, ObjectMissing
from lw_core.backends.embedded import EmbeddedBackend, fences
from lw_core.backends.embedded.leases import FREE, LEASED
from lw_core.procs import current_owner

MiB = 1 << 20
N = 64 << 10


@pytest.fixture
def pools(tmp_path):
    made = []

    def make(**kw):
        b = EmbeddedBackend(str(tmp_path / "p"), capacity_bytes=2 * MiB, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def put(b: EmbeddedBackend, key: str, fill: int):
    (h,) = b.reserve([key], N)
    b.write([h], [0], [np.full(N, fill, np.uint8)])
    b.commit([h])
    return h


def at_fence(monkeypatch, action=None) -> list[int]:
    """Replace the fence: count calls and run ``action`` (another side's store) at each."""
    calls: list[int] = []

    def fake() -> None:
        calls.append(1)
        if action is not None:
            action()

    monkeypatch.setattr(fences, "fence", fake)
    return calls


def test_read_fences_after_the_copies_and_before_the_generation_check(pools, monkeypatch):
    b = pools()
    put(b, "a", 7)
    (h,) = b.open(["a"])
    dst = np.zeros(N, np.uint8)
    copied_at_fence = []

    def evicted_now() -> None:  # the evictor's tombstone reaches this reader at its fence
        copied_at_fence.append(bool((dst == 7).all()))
        b._pool.leases.gen[h._pg] = 0

    calls = at_fence(monkeypatch, evicted_now)
    with pytest.raises(ObjectMissing, match="evicted"):
        b.read([h], [0], [dst])
    assert calls == [1] and copied_at_fence == [True], "one fence, after the copy, before the re-read"


def test_read_of_a_batch_takes_one_fence(pools, monkeypatch):
    b = pools()
    put(b, "a", 1)
    put(b, "b", 2)
    hs = b.open(["a", "b"])
    calls = at_fence(monkeypatch)
    dsts = [np.zeros(N, np.uint8), np.zeros(N, np.uint8)]
    b.read(hs, [0, 0], dsts)
    assert calls == [1] and (dsts[0] == 1).all() and (dsts[1] == 2).all()


def test_open_publishes_its_lease_before_the_fence_and_checks_the_generation_after(pools, monkeypatch):
    b = pools()
    h0 = put(b, "a", 7)
    lt = b._pool.leases
    seen = []

    def evicted_now() -> None:
        seen.append(h0._oid in lt.ent_oid[lt.row])  # our lease is already stored
        lt.gen[h0._pg] = 0

    calls = at_fence(monkeypatch, evicted_now)
    assert b.open(["a"]) == [None], "the tombstone seen after the fence makes it a miss"
    assert calls == [1] and seen == [True]
    assert h0._oid not in lt.ent_oid[lt.row], "the lease of the miss is dropped"


def test_intact_fences_before_reading_the_generations(pools, monkeypatch):
    b = pools()
    put(b, "a", 7)
    (h,) = b.open(["a"])
    calls = at_fence(monkeypatch, lambda: b._pool.leases.gen.__setitem__(h._pg, 0))
    assert b.intact([h]) == [False] and calls == [1]


def test_commit_fences_before_publishing_the_generation(pools, monkeypatch):
    b = pools()
    (h,) = b.reserve(["a"], N)
    b.write([h], [0], [np.full(N, 7, np.uint8)])
    gen_at_fence = []
    calls = at_fence(monkeypatch, lambda: gen_at_fence.append(b._pool.leases.gen[h._pg]))
    b.commit([h])
    assert calls == [1] and gen_at_fence == [0] and b._pool.leases.gen[h._pg] == h._oid


def test_evict_stores_the_tombstone_before_the_fence_and_reads_leases_after(pools, monkeypatch):
    writer, reader = pools(), pools()
    h = put(writer, "a", 7)
    wl, rl = writer._pool.leases, reader._pool.leases
    wl.ref[h._pg] = 0  # not read since: CLOCK takes it
    rows = wl.live_rows(current_owner())  # the writer is this process
    gen_at_fence, entries = [], []

    def leased_now() -> None:  # a reader's lease reaches the evictor at its fence
        gen_at_fence.append(wl.gen[h._pg])
        with rl.lock:
            entries.append(rl.take(h._oid, h._pg, time.time() + 60))

    calls = at_fence(monkeypatch, leased_now)
    assert wl.evict(h._pg, h._oid, time.time(), rows) == LEASED
    assert calls == [1] and gen_at_fence == [0] and wl.gen[h._pg] == h._oid, "kept, its generation restored"
    at_fence(monkeypatch)  # the lease gone and the page not read since: evicted
    with rl.lock:
        rl.drop(entries[0], h._oid)
    wl.ref[h._pg] = 0
    assert wl.evict(h._pg, h._oid, time.time(), rows) == FREE and wl.gen[h._pg] == 0


# ---------------------------------------------------------------- which fence, and refusing without one


def test_each_cpu_gets_a_real_fence_or_none():
    real = object()
    assert fences.choose("aarch64", real)[0] is real
    assert fences.choose("x86_64", real)[0] is real
    for tso in ("x86_64", "AMD64", "i686"):
        assert fences.choose(tso, None)[0] is fences.lock_fence
    for weak in ("aarch64", "arm64", "ppc64le", "riscv64"):
        fn, how = fences.choose(weak, None)
        assert fn is None and weak in how


def test_libatomic_loads_here_and_its_fence_runs():
    f = fences.load_libatomic()
    assert f is not None, "libatomic.so.1 did not load (it comes with gcc; Debian: apt-get install libatomic1)"
    f()
    assert fences.load_libatomic("libno-such-atomics.so.9") is None
    assert fences.REAL is not None and "libatomic" in fences.HOW and fences.fence is fences.REAL


def _as_cpu(monkeypatch, machine: str, libatomic: bool) -> None:
    """Make fences believe it runs on ``machine``, with or without libatomic, as at import."""
    monkeypatch.setattr(fences.platform, "machine", lambda: machine)
    if not libatomic:
        monkeypatch.setattr(fences, "load_libatomic", lambda name=fences.LIBATOMIC: None)
    m, real, how = fences.detect()
    monkeypatch.setattr(fences, "MACHINE", m)
    monkeypatch.setattr(fences, "REAL", real)
    monkeypatch.setattr(fences, "HOW", how)


def test_weakly_ordered_cpu_without_libatomic_refuses_the_pool(tmp_path, monkeypatch):
    monkeypatch.delenv(fences.UNFENCED_ENV, raising=False)
    _as_cpu(monkeypatch, "aarch64", libatomic=False)
    with pytest.raises(BackendError) as ei:
        EmbeddedBackend(str(tmp_path / "p"), capacity_bytes=2 * MiB)
    msg = str(ei.value)
    for part in ("aarch64", "libatomic.so.1", "apt-get install libatomic1", "memcache", "mooncake",
                 f"{fences.UNFENCED_ENV}=1"):
        assert part in msg, (part, msg)
    assert not (tmp_path / "p").exists(), "nothing is created"


def test_the_override_opens_it_anyway_with_a_warning(tmp_path, monkeypatch, caplog):
    _as_cpu(monkeypatch, "aarch64", libatomic=False)
    monkeypatch.setenv(fences.UNFENCED_ENV, "1")
    with caplog.at_level(logging.WARNING), EmbeddedBackend(str(tmp_path / "p"), capacity_bytes=2 * MiB) as b:
        put(b, "a", 7)
        assert b.lookup(["a"]) == 1
    assert any(fences.UNFENCED_ENV in r.getMessage() and "aarch64" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("machine,libatomic", [("aarch64", True), ("x86_64", False)])
def test_a_real_fence_or_tso_opens_without_a_word(tmp_path, monkeypatch, caplog, machine, libatomic):
    monkeypatch.delenv(fences.UNFENCED_ENV, raising=False)
    _as_cpu(monkeypatch, machine, libatomic)
    with caplog.at_level(logging.WARNING), EmbeddedBackend(str(tmp_path / "p"), capacity_bytes=2 * MiB) as b:
        assert b.lookup(["a"]) == 0
    assert not [r for r in caplog.records if fences.UNFENCED_ENV in r.getMessage()]
