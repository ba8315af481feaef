"""``Verifier`` alone, on real pool files: a fresh pool checks out; a counter that disagrees with
the index, and arena space that nothing owns, are each reported by name."""

from __future__ import annotations

import pytest

from lw_core.backend import BackendError
from lw_core.backends.embedded.pool_files import PoolFiles
from lw_core.backends.embedded.records import CIDX, PAGE
from lw_core.backends.embedded.txn import Tx
from lw_core.backends.embedded.verify import Verifier
from lw_core.backends.embedded.writer_lock import WriterLock
from lw_core.procs import current_owner

CAP = 16 * PAGE


@pytest.fixture
def pool(tmp_path):
    p, lock = PoolFiles(str(tmp_path / "p"), CAP, populate=False), WriterLock(str(tmp_path / "p"), timeout_s=1.0, capacity=CAP)
    p.attach(lock, current_owner(), lambda: None)
    yield p
    p.close()
    lock.close_files()


def _change(pool: PoolFiles, fn) -> None:
    with pool.env.begin(write=True) as txn:
        t = Tx(pool, txn)
        fn(t)
        t.flush()


def test_a_fresh_pool_is_consistent_and_its_counters_show_all_space_free(pool):
    v = Verifier(pool)
    assert v.verify() == {"objects": 0, "bytes": 0, "reserved_objects": 0}
    c = v.counters()
    assert c["free_bytes"] == CAP and c["capacity_bytes"] == CAP and "next_id" not in c
    assert v.open_reservations() == {}


def test_a_counter_that_disagrees_with_the_index_is_named(pool):
    _change(pool, lambda t: t.c.__setitem__(CIDX["objects"], 3))
    with pytest.raises(BackendError, match="counter objects=3 but the index holds 0"):
        Verifier(pool).verify()


def test_arena_space_that_nothing_owns_is_a_gap(pool):
    _change(pool, lambda t: t.alloc(PAGE))  # allocated, but no object or reservation holds it
    with pytest.raises(BackendError, match="arena gap at 0"):
        Verifier(pool).verify()
