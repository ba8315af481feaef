"""The put-session write path (``SessionWriter`` under ``ObjectWriter``, ranged puts from
``StagedPuts``) over a stand-in Mooncake client that keeps sessions as the real one does
(measured in docs/guide/mooncake.md): invisible until end, -705 for stored keys, ranged puts copy
bytes from registered memory, revoke drops."""

from __future__ import annotations

import ctypes
from collections import Counter

import numpy as np
import pytest

from lw_core.backend import BackendError, ObjectMissing
from lw_mooncake.calls import Deadlines
from lw_mooncake.errors import INVALID_PARAMS, NO_AVAILABLE_HANDLE, OBJECT_ALREADY_EXISTS
from lw_mooncake.object_writer import ObjectWriter
from lw_mooncake.put_sessions import PutSessions, have_put_sessions
from lw_mooncake.puts import StagedPuts
from lw_mooncake.reservations import Reservations
from lw_mooncake.session_writer import SessionWriter, gaps


class _Store:
    """Mooncake's client, its put sessions only. ``full``: keys that do not fit; ``fail_range``:
    keys whose ranged puts fail."""

    def __init__(self) -> None:
        self.stored: dict[str, bytes] = {}
        self.open: dict[str, bytearray] = {}
        self.registered: list[tuple[int, int]] = []
        self.full: set[str] = set()
        self.fail_range: set[str] = set()
        self.calls: Counter[str] = Counter()

    def register_buffer(self, ptr: int, n: int) -> int:
        self.registered.append((ptr, n))
        return 0

    def batch_is_exist(self, keys):
        return [int(k in self.stored) for k in keys]

    def batch_put_session_start(self, keys, sizes):
        self.calls["start"] += 1
        out = []
        for k, n in zip(keys, sizes):
            if k in self.stored:
                out.append(OBJECT_ALREADY_EXISTS)
            elif k in self.open or n == 0:
                out.append(INVALID_PARAMS)
            elif k in self.full:
                out.append(NO_AVAILABLE_HANDLE)
            else:
                self.open[k] = bytearray(b"\xee" * n)  # a segment's old bytes
                out.append(0)
        return out

    def batch_put_from_multi_buffer_ranges(self, keys, ptrs, sizes, offsets):
        self.calls["ranges"] += 1
        out = []
        for k, ps, ns, offs in zip(keys, ptrs, sizes, offsets):
            obj = self.open.get(k)
            if obj is None or k in self.fail_range:
                out.append(INVALID_PARAMS)
                continue
            for p, n, o in zip(ps, ns, offs):
                assert any(a <= p and p + n <= a + m for a, m in self.registered), "unregistered source"
                obj[o : o + n] = ctypes.string_at(p, n)
            out.append(sum(ns))
        return out

    def batch_put_session_end(self, keys):
        self.calls["end"] += 1
        out = []
        for k in keys:
            obj = self.open.pop(k, None)
            if obj is not None:
                self.stored[k] = bytes(obj)
            out.append(0 if obj is not None else INVALID_PARAMS)
        return out

    def batch_put_session_revoke(self, keys):
        self.calls["revoke"] += 1
        return [0 if self.open.pop(k, None) is not None else INVALID_PARAMS for k in keys]


class _Client:
    def __init__(self, store: _Store | None = None) -> None:
        self.store = store or _Store()
        self.calls = Deadlines(5.0, "test")
        self.closed = False

    def check_open(self) -> None:
        pass

    def put_args(self) -> tuple:
        return ()  # no put config (no segment of its own)

    def exist(self, keys):
        return self.store.batch_is_exist(keys)


def _make(store: _Store | None = None):
    client = _Client(store)
    puts = StagedPuts(client, 1 << 16)  # type: ignore[arg-type]
    res = Reservations()
    sw = SessionWriter(PutSessions(client), puts, res, Counter())  # type: ignore[arg-type]
    w = ObjectWriter(client, puts, res, staging_size=1 << 16, streams=None, sessions=sw)  # type: ignore[arg-type]
    return w, client, res


@pytest.fixture
def setup():
    w, client, res = _make()
    yield w, client.store, res
    client.calls.shutdown()


def test_gaps():
    assert gaps([], 8) == [(0, 8)]
    assert gaps([(4, 6), (0, 2), (1, 3)], 8) == [(3, 4), (6, 8)]
    assert gaps([(0, 8)], 8) == []


def test_detects_sessions():
    assert have_put_sessions(_Store()) and not have_put_sessions(object())


def test_each_write_lands_at_once_and_commit_makes_the_object_visible(setup):
    w, store, res = setup
    (h,) = w.reserve(["k"], 12)
    assert h.session and store.open and "k" not in store.stored and w.view(h, 0, 4) is None
    w.write([h], [8], [b"3333"])
    w.write([h], [0], [memoryview(b"1111")])
    assert bytes(store.open["k"][8:]) == b"3333"  # sent before commit, into the session only
    assert "k" not in store.stored
    w.commit([h])
    # the unwritten range [4, 8) is zeros, as the whole-object path stores it (not the segment's old bytes)
    assert store.stored["k"] == b"1111" + bytes(4) + b"3333" and h.committed and len(res) == 0
    w.commit([h])  # committed: a no-op
    assert store.calls["end"] == 1


def test_stored_full_and_own_keys_are_not_reserved(setup):
    w, store, _ = setup
    store.stored["old"] = b"x"
    store.full.add("big")
    a, b, c = w.reserve(["old", "big", "new"], 4)
    assert a is None and b is None and c is not None
    assert w.reserve(["new"], 4) == [None]  # open here already
    assert w.reserve(["z"], 0)[0] is not None  # 0 bytes: the whole-object path
    assert not w.reserve(["z2"], 0)[0].session


def test_abort_revokes_and_the_key_can_be_reserved_again(setup):
    w, store, res = setup
    (h,) = w.reserve(["k"], 8)
    w.write([h], [0], [b"abcd"])
    w.abort([h])
    assert store.open == {} and store.stored == {} and len(res) == 0
    with pytest.raises(ObjectMissing):
        w.write([h], [0], [b"x"])
    assert w.reserve(["k"], 8)[0] is not None


def test_a_failed_ranged_put_fails_that_object_at_commit_and_revokes_it(setup):
    w, store, res = setup
    hs = w.reserve(["a", "bad"], 4)
    store.fail_range.add("bad")
    with pytest.raises(BackendError, match="ranged put into 'bad'"):
        w.write(hs, [0, 0], [b"aaaa", b"bbbb"])
    with pytest.raises(BackendError, match="ranged put into 'bad'"):
        w.commit(hs)
    assert store.stored == {"a": b"aaaa"} and store.open == {} and len(res) == 0
    assert hs[0].committed and hs[1].failed is not None
    with pytest.raises(BackendError):  # its error again
        w.commit([hs[1]])


def test_a_leftover_session_of_ours_is_revoked_and_started_again(setup):
    w, store, _ = setup
    store.open["left"] = bytearray(4)  # a revoke that failed earlier
    (h,) = w.reserve(["left"], 4)
    assert h is not None and store.calls["revoke"] == 1


def test_layer_writes_larger_than_the_staging_go_in_several_calls(setup):
    w, store, _ = setup
    hs = w.reserve(["a", "b", "c"], 40000)
    data = [np.full(40000, i + 1, np.uint8) for i in range(3)]
    w.write(hs, [0, 0, 0], data)
    assert store.calls["ranges"] == 3  # 64 KiB staging: one object's range per call
    w.commit(hs)
    assert [store.stored[k] for k in "abc"] == [d.tobytes() for d in data]


class _Frozen(_Store):
    """The master stops answering session ends and revokes (they raise as a past deadline would)."""

    frozen = False

    def batch_put_session_end(self, keys):
        if self.frozen:
            raise _Timeout
        return super().batch_put_session_end(keys)

    def batch_put_session_revoke(self, keys):
        if self.frozen:
            self.calls["revoke_frozen"] += 1
            raise _Timeout
        return super().batch_put_session_revoke(keys)


class _Timeout(Exception):
    pass


def test_a_commit_that_times_out_fails_its_objects_and_later_aborts_skip_the_revoke(monkeypatch):
    from lw_core.backend import BackendUnavailable

    store = _Frozen()
    w, client, res = _make(store)

    def call(what, fn, *args, timeout_s=None):
        try:
            return fn(*args)
        except _Timeout:
            raise BackendUnavailable(f"mooncake {what} did not answer") from None

    monkeypatch.setattr(client.calls, "call", call)
    hs = w.reserve(["a", "b"], 4)
    w.write(hs, [0, 0], [b"aaaa", b"bbbb"])
    store.frozen = True
    with pytest.raises(BackendUnavailable):
        w.commit([hs[0]])
    assert hs[0].failed is not None and not hs[0].committed and "a" not in store.stored
    assert store.calls["revoke_frozen"] == 0  # a store that did not answer is not asked again at once
    w.abort([hs[1]])
    assert store.calls["revoke_frozen"] == 0 and len(res) == 0
    client.calls.shutdown()
