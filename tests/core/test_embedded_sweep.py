"""``Sweeper`` alone, on real pool files: a dead writer's reservation is reclaimed, a live but
timed-out one loses its key and keeps its extent, and ``reserve`` sweeps at most every interval."""

from __future__ import annotations

import pytest

from lw_core.backends.embedded.pool_files import PoolFiles
from lw_core.backends.embedded.records import CIDX, PAGE, RESERVED, SWEEP_INTERVAL_S, Resv
from lw_core.backends.embedded.sweep import Sweeper
from lw_core.backends.embedded.txn import Tx
from lw_core.backends.embedded.writer_lock import WriterLock
from lw_core.procs import Owner, current_owner

TIMEOUT_S = 600.0


@pytest.fixture
def pool(tmp_path):
    p, lock = PoolFiles(str(tmp_path / "p"), 16 * PAGE, populate=False), WriterLock(str(tmp_path / "p"), timeout_s=1.0, capacity=16 * PAGE)
    p.attach(lock, current_owner(), lambda: None)
    yield p
    p.close()
    lock.close_files()


def _in_tx(pool: PoolFiles, fn):
    with pool.env.begin(write=True) as txn:
        t = Tx(pool, txn)
        out = fn(t)
        t.flush()
    return out


def _reserve(t: Tx, key: bytes, owner: Owner, t0: float) -> int:
    off, oid = t.alloc(PAGE), t.next_id()
    t.put_obj(key, [RESERVED, oid, off, PAGE, PAGE, 0])
    t.put_resv(oid, Resv(owner, t0, off, PAGE, 0), key)
    t.c[CIDX["reserved_objects"]] += 1
    t.c[CIDX["reserved_bytes"]] += PAGE
    return oid


def test_a_dead_writers_reservation_is_reclaimed_with_its_key_and_extent(pool):
    me = current_owner()
    dead = Owner(me.pidns, me.pid, me.start + 1)  # our pid, another start time: a process gone
    sw = Sweeper(pool, me, reservation_timeout_s=TIMEOUT_S)
    oid = _in_tx(pool, lambda t: _reserve(t, b"k", dead, t.now))
    _in_tx(pool, sw.sweep)
    got = _in_tx(pool, lambda t: (t.get_obj(b"k"), t.get_resv(oid), t.c[CIDX["reclaimed_reservations"]], t.c[CIDX["free_bytes"]]))
    assert got == (None, None, 1, 16 * PAGE)


def test_a_live_but_timed_out_writer_loses_its_key_and_keeps_its_extent(pool):
    me = current_owner()
    sw = Sweeper(pool, me, reservation_timeout_s=TIMEOUT_S)
    oid = _in_tx(pool, lambda t: _reserve(t, b"k", me, t.now - TIMEOUT_S - 1))
    assert _in_tx(pool, lambda t: sw.key_free(t, b"k", t.get_obj(b"k")))  # the key goes to the next writer
    obj, resv, orphaned = _in_tx(pool, lambda t: (t.get_obj(b"k"), t.get_resv(oid), t.c[CIDX["orphaned_reservations"]]))
    assert obj is None and orphaned == 1
    assert resv is not None and resv[0].orphan == 1  # its extent stays the writer's until it commits or aborts


def test_a_live_writers_fresh_reservation_blocks_its_key(pool):
    me = current_owner()
    sw = Sweeper(pool, me, reservation_timeout_s=TIMEOUT_S)
    _in_tx(pool, lambda t: _reserve(t, b"k", me, t.now))
    assert not _in_tx(pool, lambda t: sw.key_free(t, b"k", t.get_obj(b"k")))


def test_sweeps_are_due_at_most_every_interval(pool):
    sw = Sweeper(pool, current_owner(), reservation_timeout_s=TIMEOUT_S)
    assert _in_tx(pool, sw.due)
    _in_tx(pool, sw.sweep)
    assert not _in_tx(pool, sw.due)
    sw.last_sweep -= SWEEP_INTERVAL_S + 1
    assert _in_tx(pool, sw.due)
