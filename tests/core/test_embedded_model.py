"""Property tests of the embedded pool: the free-extent allocator against a byte-map model, and
random operation sequences against the backend's invariants (hypothesis)."""

from __future__ import annotations

import lmdb
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from lw_core.backends.embedded import PAGE, EmbeddedBackend
from lw_core.backends.embedded.arena_alloc import ArenaCorrupt, ExtentAllocator

CAP_PAGES = 64


@pytest.fixture
def env(tmp_path):
    e = lmdb.open(str(tmp_path / "a.lmdb"), subdir=False, max_dbs=4, map_size=16 << 20)
    yield e
    e.close()


def _alloc(env) -> ExtentAllocator:
    return ExtentAllocator(env.open_db(b"off"), env.open_db(b"size"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.integers(0, 1000)), max_size=80))
def test_allocator_matches_a_page_map(env, ops):
    a = _alloc(env)
    with env.begin(write=True) as txn:
        txn.drop(a.by_off, delete=False)
        txn.drop(a.by_size, delete=False)
        a.init(txn, CAP_PAGES)
        used = np.zeros(CAP_PAGES, bool)
        live: list[tuple[int, int]] = []
        for is_alloc, size, pick in ops:
            if is_alloc or not live:
                off = a.alloc(txn, size)
                free_runs = _runs(~used)
                if off is None:
                    assert all(n < size for _, n in free_runs), "a fitting extent was not found"
                    continue
                assert not used[off : off + size].any(), "allocated space that was in use"
                assert off + size <= CAP_PAGES
                # best fit: no smaller free run could have held it
                fits = [n for _, n in free_runs if n >= size]
                assert any(o <= off < o + n and n == min(fits) for o, n in free_runs)
                used[off : off + size] = True
                live.append((off, size))
            else:
                off, size = live.pop(pick % len(live))
                a.free(txn, off, size)
                used[off : off + size] = False
            # free list == complement of used, fully coalesced
            assert a.extents(txn) == _runs(~used)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    out, i = [], 0
    while i < len(mask):
        if mask[i]:
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            out.append((i, j - i))
            i = j
        else:
            i += 1
    return out


def test_allocator_rejects_double_free(env):
    a = _alloc(env)
    with env.begin(write=True) as txn:
        a.init(txn, 10)
        off = a.alloc(txn, 4)
        a.free(txn, off, 4)
        with pytest.raises(ArenaCorrupt, match="overlaps"):
            a.free(txn, off, 2)


class PoolMachine(RuleBasedStateMachine):
    """Random reserve/write/commit/abort/open/release/fill sequences on a tiny pool; after every
    step the index must tile the arena exactly, committed objects must read back their bytes, and
    leased objects must never disappear."""

    reserved = Bundle("reserved")
    leased = Bundle("leased")

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.dir = tempfile.TemporaryDirectory(dir="/dev/shm" if __import__("os").path.isdir("/dev/shm") else None)
        self.b = EmbeddedBackend(self.dir.name + "/p", capacity_bytes=1 << 20, populate=False)
        self.content: dict[str, bytes] = {}  # committed by us (may since be evicted)
        self.leases: dict[str, int] = {}

    def teardown(self) -> None:
        self.b.close()
        self.dir.cleanup()

    @staticmethod
    def data(key: str, n: int) -> bytes:
        return (key.encode() * (n // len(key) + 1))[:n]

    @rule(target=reserved, key=st.sampled_from([f"k{i}" for i in range(12)]), pages=st.integers(1, 80))
    def reserve(self, key, pages):
        n = pages * PAGE - 7
        (h,) = self.b.reserve([key], n)
        if h is not None:
            assert key not in self.b_committed_keys()
            self.b.write([h], [0], [self.data(key, n)])
        return h

    @rule(h=consumes(reserved), commit=st.booleans())
    def finish(self, h, commit):
        if h is None:
            return
        if commit:
            self.b.commit([h])
            self.content[h.key] = self.data(h.key, h.nbytes)
        else:
            self.b.abort([h])
            assert self.b.lookup([h.key]) == 0

    @rule(target=leased, key=st.sampled_from([f"k{i}" for i in range(12)]))
    def open(self, key):
        (h,) = self.b.open([key])
        if h is not None:
            self.leases[key] = self.leases.get(key, 0) + 1
        return h

    @rule(h=consumes(leased))
    def release(self, h):
        if h is not None:
            out = bytearray(h.nbytes)
            self.b.read([h], [0], [out])
            assert bytes(out) == self.content[h.key], "a leased object changed under its reader"
            self.b.release([h])
            self.leases[h.key] -= 1

    def b_committed_keys(self) -> set[str]:
        return {k for k in self.content if self.b.lookup([k])}

    @invariant()
    def consistent(self):
        self.b.verify()
        for k in self.b_committed_keys():
            (h,) = self.b.open([k])
            out = bytearray(h.nbytes)
            self.b.read([h], [0], [out])
            self.b.release([h])
            assert bytes(out) == self.content[k]
        for k, n in self.leases.items():
            if n > 0:
                assert self.b.lookup([k]) == 1, f"leased {k} was evicted"


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
