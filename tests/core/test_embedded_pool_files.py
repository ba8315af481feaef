"""``PoolFiles`` alone: creating and attaching to the pool files, refusing a mismatched pool in use,
and noticing a replaced directory (``EmbeddedBackend`` re-attaches on that)."""

from __future__ import annotations

import os

import pytest

from lw_core.backend import BackendError
from lw_core.backends.embedded.pool_files import PoolFiles
from lw_core.backends.embedded.records import PAGE
from lw_core.backends.embedded.writer_lock import WriterLock
from lw_core.procs import current_owner

CAP = 64 * PAGE


def _attach(path: str, cap: int = CAP) -> tuple[PoolFiles, WriterLock, list[str]]:
    pool, lock, calls = PoolFiles(path, cap, populate=False), WriterLock(path, timeout_s=1.0, capacity=cap), []
    pool.attach(lock, current_owner(), lambda: calls.append("attached"))
    return pool, lock, calls


def _close(pool: PoolFiles, lock: WriterLock) -> None:
    pool.close()
    lock.close_files()


def test_attach_creates_the_pool_maps_the_arena_and_claims_a_lease_row(tmp_path):
    path = str(tmp_path / "p")
    pool, lock, calls = _attach(path)
    try:
        assert calls == ["attached"]  # run once, under the writer lock
        assert {"index.lmdb", "arena", "leases", "LW_POOL"} <= set(os.listdir(path))
        assert pool.mv is not None and pool.mv.nbytes == CAP
        assert pool.leases is not None and pool.leases.row >= 0
        assert not pool.replaced()
    finally:
        _close(pool, lock)
    assert pool.env is None and pool.mv is None
    with pytest.raises(BackendError, match="not attached"):
        pool.leases  # noqa: B018 - the property raises once closed


def test_another_capacity_while_the_pool_is_in_use_is_refused_naming_both(tmp_path):
    path = str(tmp_path / "p")
    pool, lock, _ = _attach(path)
    try:
        with pytest.raises(BackendError, match=f"capacity_bytes={CAP}.*asks capacity_bytes={2 * CAP}"):
            _attach(path, 2 * CAP)
    finally:
        _close(pool, lock)


def test_a_replaced_directory_is_noticed(tmp_path):
    path = str(tmp_path / "p")
    pool, lock, _ = _attach(path)
    try:
        os.rename(path, str(tmp_path / "old"))
        os.mkdir(path, 0o700)
        assert pool.replaced()
    finally:
        _close(pool, lock)
