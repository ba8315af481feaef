"""Buffers of Mooncake calls past their deadline (``lw_mooncake.buffers.LateBuffers``), without a
Mooncake client: a late call's buffer stays registered and referenced until that call returns,
then it is unregistered and let go, so repeated timeouts do not pile up memory; a buffer whose
unregistration fails is never let go."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from lw_core.backend import BackendUnavailable
from lw_mooncake.calls import CallTimedOut, Deadlines
from lw_mooncake.gets import StagedGets


class _Store:
    """Registration calls of a store; ``batch_get_into`` and ``get_into_ranges`` wait for ``go``
    while ``stall`` is set, then fill what they were given with 7s."""

    def __init__(self) -> None:
        self.registered: set[int] = set()
        self.stall = threading.Event()
        self.go = threading.Event()
        self.unregister_rc = 0
        self.returned = 0  # calls that waited and returned

    def wait_returned(self, n: int) -> None:
        for _ in range(200):
            if self.returned >= n:
                threading.Event().wait(0.1)  # the call's future is done just after it returns
                return
            threading.Event().wait(0.02)
        raise AssertionError(f"{self.returned} of {n} late calls returned")

    def register_buffer(self, base: int, n: int) -> int:
        self.registered.add(base)
        return 0

    def unregister_buffer(self, base: int) -> int:
        if self.unregister_rc == 0:
            self.registered.discard(base)
        return self.unregister_rc

    def _wait(self) -> None:
        if self.stall.is_set():
            self.go.wait(10)
            self.returned += 1

    def batch_get_into(self, keys, ptrs, sizes):
        self._wait()
        return list(sizes)

    def get_into_ranges(self, bufs, keys, poss, offs, sizes):
        self._wait()
        return [[[n for n in per] for per in s] for s in sizes]


class _Client:
    def __init__(self, store: _Store, timeout_s: float) -> None:
        self.store = store
        self.calls = Deadlines(timeout_s, "test", workers=4)

    def check_open(self) -> None:
        pass


@pytest.fixture
def gets():
    store = _Store()
    client = _Client(store, 0.2)
    yield store, StagedGets(client, 1 << 16)  # type: ignore[arg-type]
    store.go.set()
    client.calls.shutdown()


def test_whole_gets_past_their_deadline_are_let_go_once_their_calls_return(gets):
    store, g = gets
    store.stall.set()
    for _ in range(3):
        with pytest.raises(CallTimedOut):
            g.whole(["a"], {"a": 4096}, {})
    assert len(g._late) == 3 and len(store.registered) == 3  # the late calls may still write them
    store.stall.clear()
    store.go.set()
    store.wait_returned(3)
    got: dict[str, np.ndarray] = {}
    g.whole(["a"], {"a": 4096}, got)
    assert got["a"].nbytes == 4096
    assert len(g._late) == 0 and not store.registered  # unregistered, dropped


def test_a_staging_retired_by_a_timeout_is_unregistered_after_its_call_returns(gets):
    store, g = gets
    g.ranges([("k", 0, np.zeros(16, np.uint8))])
    first = set(store.registered)
    store.stall.set()
    with pytest.raises(BackendUnavailable):
        g.ranges([("k", 0, np.zeros(16, np.uint8))])
    assert len(g._late) == 1 and store.registered == first
    store.stall.clear()
    store.go.set()
    store.wait_returned(1)
    g.ranges([("k", 0, np.zeros(16, np.uint8))])  # a new staging; the old one unregistered
    assert len(g._late) == 0 and len(store.registered) == 1


def test_a_buffer_whose_unregistration_fails_is_kept_for_good(gets):
    store, g = gets
    store.unregister_rc = -1
    got: dict[str, np.ndarray] = {}
    g.whole(["a"], {"a": 1024}, got)
    assert len(g._late) == 1
    g.whole(["a"], {"a": 1024}, got)
    assert len(g._late) == 2  # never unregistered: never let go


def test_a_whole_get_that_raises_keeps_its_buffer_registered_until_it_is_unregistered(gets, monkeypatch):
    """A ``batch_get_into`` that raises anything (not only a timeout) must not free a buffer
    Mooncake still has registered: it is kept, then unregistered before it is let go."""
    store, g = gets
    unregistered: list[int] = []
    real_unregister = store.unregister_buffer

    def unregister(base: int) -> int:
        unregistered.append(base)
        return real_unregister(base)

    def broken(keys, ptrs, sizes):
        raise RuntimeError("the binding raised")

    monkeypatch.setattr(store, "unregister_buffer", unregister)
    monkeypatch.setattr(store, "batch_get_into", broken)
    with pytest.raises(RuntimeError, match="the binding raised"):
        g.whole(["a"], {"a": 4096}, {})
    (late,) = g._late.held()  # referenced, so never freed while registered
    base = int(late.ctypes.data)
    assert store.registered == {base} and unregistered == []
    monkeypatch.undo()
    got: dict[str, np.ndarray] = {}
    g.whole(["a"], {"a": 4096}, got)  # the next call unregisters it first, then lets it go
    assert got["a"].nbytes == 4096 and len(g._late) == 0 and not store.registered
