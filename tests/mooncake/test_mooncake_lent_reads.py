"""Per-layer reads lent from the get arena (``ObjectReader.read_lent``, ``StagedGets.lent``) without
a Mooncake client: one ``get_into_ranges`` per batch writes straight into an extent of the arena
(registered memory, the pipeline's ``host_regions``), which stays taken until the pipeline gives it
back, or, for a call that raised, until that call has returned; an error answer frees it at once;
without room, or for fetched copies, nothing is lent and the pipeline reads into staging."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from test_mooncake_get_arena import _content, _Store, readers

from lw_core.backend import BackendError, ObjectMissing
from lw_mooncake.calls import CallTimedOut
from lw_mooncake.errors import OBJECT_NOT_FOUND
from lw_mooncake.get_arena import ALIGN
from lw_mooncake.handle import MooncakeHandle


class _RangeStore(_Store):
    """``_Store`` with ``get_into_ranges``: each range of each key written at the buffer's pointer
    plus its position (registered memory only); ``answer`` overrides what a key's ranges report."""

    def __init__(self, objects: dict[str, int]) -> None:
        super().__init__(objects)
        self.range_calls = 0
        self.answer: dict[str, int] = {}

    def get_into_ranges(self, bufs, keys, positions, offsets, sizes):
        stalled = self.stall.is_set()
        if stalled:
            self.go.wait(10)
        self.range_calls += 1
        out = []
        for base, ks, ps, os_, ns in zip(bufs, keys, positions, offsets, sizes):
            assert any(b <= base < b + n for b, n in self.registered.items()), "a get into unregistered memory"
            per_key = []
            for k, kp, ko, kn in zip(ks, ps, os_, ns):
                if k in self.answer:
                    per_key.append([self.answer[k]] * len(kp))
                    continue
                if k not in self.objects:
                    per_key.append([OBJECT_NOT_FOUND] * len(kp))
                    continue
                whole = _content(k, self.objects[k])
                for p, o, n in zip(kp, ko, kn):
                    np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(base + p))[:] = whole[o : o + n]
                per_key.append(list(kn))
            out.append(per_key)
        if stalled:
            self.returned.set()
        return out


@pytest.fixture
def make():
    yield from readers(_RangeStore, "per_layer")


def _handles(sizes: dict[str, int]) -> list[MooncakeHandle]:
    return [MooncakeHandle(k, n) for k, n in sizes.items()]


def test_a_layer_of_every_object_lands_in_one_lent_extent_until_it_is_given_back(make):
    sizes = {"a": 4 * 3000, "b": 4 * 3000, "c": 4 * 3000}
    store, reader, arena = make(sizes, 8 * ALIGN)
    hs = _handles(sizes)
    for layer in range(4):
        lend = reader.read_lent(hs, [layer * 3000] * 3, 3000)
        assert lend is not None and store.range_calls == layer + 1  # one call for the batch
        for h, v in zip(hs, lend.views):
            assert arena.covers(v) and np.array_equal(v, _content(h.key, h.nbytes)[layer * 3000 : (layer + 1) * 3000])
        assert arena.free_bytes() == 5 * ALIGN  # 9000 bytes: three pages taken
        lend.give_back()
        lend.give_back()  # a second give-back frees nothing twice
        assert arena.free_bytes() == 8 * ALIGN
    assert reader.gets.counts["arena_range_gets"] == 4 and reader.gets.counts["bytes_read"] == 4 * 9000


def test_lent_extents_are_not_handed_out_again_while_lent(make):
    sizes = {"a": 2 * ALIGN, "b": 2 * ALIGN}
    _, reader, arena = make(sizes, 4 * ALIGN)
    a, b = _handles(sizes)
    first = reader.read_lent([a], [0], 2 * ALIGN)
    second = reader.read_lent([b], [0], 2 * ALIGN)
    assert first is not None and second is not None
    assert reader.read_lent([a], [0], ALIGN) is None  # full: the pipeline reads into staging
    assert np.array_equal(first.views[0], _content("a", 2 * ALIGN))  # not overwritten by b's get
    first.give_back()
    second.give_back()
    assert arena.free_bytes() == 4 * ALIGN


def test_a_late_ranged_gets_extent_is_never_handed_out_before_it_returns(make):
    sizes = {"a": 2 * ALIGN, "b": 2 * ALIGN}
    store, reader, arena = make(sizes, 4 * ALIGN, timeout_s=0.2)
    a, b = _handles(sizes)
    store.stall.set()
    with pytest.raises(CallTimedOut):
        reader.read_lent([a], [0], 2 * ALIGN)  # stuck, holding the first two pages; writes them later
    store.stall.clear()
    lend = reader.read_lent([b], [0], 2 * ALIGN)
    assert lend is not None and int(lend.views[0].ctypes.data) == arena.base + 2 * ALIGN
    assert reader.read_lent([b], [0], ALIGN) is None  # the late call's pages are not free yet
    store.go.set()
    assert store.returned.wait(5)
    assert np.array_equal(lend.views[0], _content("b", 2 * ALIGN))  # the late write went to its own pages
    lend.give_back()
    for _ in range(100):  # freed once its call has returned (the future completes just after)
        arena.prune()
        if arena.free_bytes() == 4 * ALIGN:
            break
        threading.Event().wait(0.02)
    assert arena.free_bytes() == 4 * ALIGN


@pytest.mark.parametrize("answer, error", [(OBJECT_NOT_FOUND, ObjectMissing), (-1, BackendError), (100, BackendError)],
                         ids=["gone", "error", "short"])
def test_a_ranged_get_that_answers_an_error_frees_its_extent_and_raises(make, answer, error):
    sizes = {"a": ALIGN, "b": ALIGN}
    store, reader, arena = make(sizes, 4 * ALIGN)
    store.answer["b"] = answer
    with pytest.raises(error):
        reader.read_lent(_handles(sizes), [0, 0], 1000)
    assert arena.free_bytes() == 4 * ALIGN


def test_nothing_is_lent_for_fetched_copies_an_arena_mooncake_refused_or_a_range_outside(make):
    sizes = {"a": ALIGN}
    store, reader, arena = make(sizes, 4 * ALIGN)
    (a,) = _handles(sizes)
    fetched = MooncakeHandle("a", ALIGN, data=np.zeros(ALIGN, np.uint8))
    assert reader.read_lent([fetched], [0], 100) is None  # ``view`` serves a fetched copy
    with pytest.raises(ValueError, match="outside"):
        reader.read_lent([a], [ALIGN - 10], 100)
    assert store.range_calls == 0
    store.refuse = 1
    assert reader.read_lent([a], [0], 100) is None
    assert arena.counts["get_arena_refused"] == 1 and store.range_calls == 0
