"""HostCopier: the numpy stand-in for a KV cache."""

from __future__ import annotations

import numpy as np
import pytest

from lw_core.pipeline.copier import Copier
from lw_core.pipeline.host_copier import HostCopier, aligned_empty


def test_is_a_copier_with_page_aligned_layers():
    c = HostCopier.allocate(3, 5, [64, 128, 64], fill=7)
    assert isinstance(c, Copier)
    assert [c.block_nbytes(i) for i in range(3)] == [64, 128, 64]
    assert all(a.ctypes.data % 4096 == 0 and (a == 7).all() for a in c.kv)
    assert aligned_empty(10, 4096).ctypes.data % 4096 == 0


def test_to_kv_and_from_kv_move_exact_blocks():
    c = HostCopier.allocate(2, 4, 16)
    srcs = [bytes(range(i, i + 16)) for i in (0, 100)]
    assert c.to_kv(1, [3, 0], srcs) is None
    assert c.kv[1][3].tobytes() == srcs[0] and c.kv[1][0].tobytes() == srcs[1]
    assert (c.kv[0] == 0).all() and (c.kv[1][1:3] == 0).all()
    out = [bytearray(16), np.zeros(16, np.uint8)]
    c.from_kv(1, [0, 3], out)
    assert bytes(out[0]) == srcs[1] and out[1].tobytes() == srcs[0]
    assert c.wait(c.compute_event(), 0.0) is True


def test_kv_views_are_writable_windows_into_the_cache():
    c = HostCopier.allocate(1, 3, 8)
    (v,) = c.kv_views(0, [2])
    v[:] = b"\x01" * 8
    assert (c.kv[0][2] == 1).all() and (c.kv[0][:2] == 0).all()


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda c: c.to_kv(2, [0], [bytes(8)]), r"layer=2 out of range; accepted 0..1"),
        (lambda c: c.to_kv(0, [4], [bytes(8)]), r"block id 4 of layer 0 out of range; accepted 0..3"),
        (lambda c: c.to_kv(0, [1], [bytes(7)]), r"has 7 bytes, expected 8"),
        (lambda c: c.from_kv(0, [1, 2], [bytearray(8)]), r"2 block ids but 1 dsts"),
        (lambda c: c.kv_views(0, [-1]), r"block id -1"),
    ],
)
def test_bad_calls_name_what_is_wrong(call, match):
    c = HostCopier.allocate(2, 4, 8)
    with pytest.raises((ValueError, IndexError), match=match):
        call(c)


def test_rejects_arrays_that_are_not_a_kv_layer():
    with pytest.raises(ValueError, match=r"kv\[0\] must be a C-contiguous uint8"):
        HostCopier([np.zeros((4, 8), np.float32)])
    with pytest.raises(ValueError, match="at least one layer"):
        HostCopier([])
