"""MooncakeBackend's writing collaborators without a Mooncake client: ``Reservations`` and
``ObjectWriter`` over a stand-in store client and put staging (what a put stores, and which fail)."""

from __future__ import annotations

import numpy as np
import pytest

from lw_core.backend import ObjectMissing, PoolFull
from lw_mooncake.errors import NO_AVAILABLE_HANDLE
from lw_mooncake.object_writer import ObjectWriter
from lw_mooncake.reservations import Reservations


class _Client:
    """``StoreClient``'s calls the writer makes: every key in ``stored`` exists."""

    def __init__(self, stored: set[str]) -> None:
        self.stored = stored

    def exist(self, keys: list[str]) -> list[int]:
        return [int(k in self.stored) for k in keys]


class _Puts:
    """``StagedPuts``: stores each object whole into ``client.stored``/``objects``, except ``fail``."""

    def __init__(self, client: _Client, fail: frozenset[str] = frozenset()) -> None:
        self.client, self.fail, self.objects, self.calls = client, fail, {}, 0

    def put_parts(self, items):
        self.calls += 1
        res = []
        for k, parts in items:
            if k in self.fail:
                res.append(NO_AVAILABLE_HANDLE)
                continue
            self.objects[k] = b"".join(bytes(p) for p in parts)
            self.client.stored.add(k)
            res.append(0)
        return res


def _writer(fail: frozenset[str] = frozenset(), staging_size: int = 1 << 20):
    client = _Client(set())
    puts = _Puts(client, fail)
    res = Reservations()
    return ObjectWriter(client, puts, res, staging_size=staging_size, streams=None), puts, res


def test_a_key_is_reserved_once_and_never_when_stored():
    w, puts, res = _writer()
    puts.client.stored.add("old")
    a, b, c = w.reserve(["k", "k2", "old"], 8)
    assert a is not None and b is not None and c is None
    assert w.reserve(["k"], 8) == [None] and len(res) == 2


def test_commit_puts_the_written_object_whole_and_ends_the_reservation():
    w, puts, res = _writer()
    (h,) = w.reserve(["k"], 8)
    w.write([h], [2], [b"abcd"])
    w.view(h, 6, 2)[:] = b"ef"
    assert puts.objects == {}  # nothing is sent before commit
    w.commit([h])
    assert puts.objects == {"k": b"\0\0abcdef"} and h.committed and h.buf is None and len(res) == 0
    w.commit([h])  # committed: a no-op
    assert puts.calls == 1 and w.view(h, 0, 1) is None
    with pytest.raises(ObjectMissing):
        w.write([h], [0], [b"x"])


def test_a_failed_put_is_that_objects_error_again_and_the_rest_count_as_committed():
    w, puts, _ = _writer(fail=frozenset({"bad"}))
    hs = w.reserve(["a", "bad", "b"], 4)
    with pytest.raises(PoolFull, match="NO_AVAILABLE_HANDLE"):
        w.commit(hs)
    assert sorted(puts.objects) == ["a", "b"]
    w.commit([hs[0]])  # put before: committed
    with pytest.raises(PoolFull):
        w.commit([hs[1]])
    assert w.counts["objects_put"] == 2


def test_batches_fit_the_staging_and_abort_drops_the_reservation():
    w, puts, res = _writer(staging_size=8)
    hs = w.reserve(["a", "b", "c"], 5)
    w.abort([hs[2]])
    with pytest.raises(ObjectMissing, match="not reserved"):
        w.commit(hs)
    assert sorted(puts.objects) == ["a", "b"] and puts.calls == 2 and len(res) == 0
    assert w.reserve(["c"], 5)[0] is not None  # aborted: the key can be reserved again
    np.testing.assert_array_equal(np.frombuffer(puts.objects["a"], np.uint8), np.zeros(5, np.uint8))
