"""Range arithmetic for reading GQA KV across TP sizes (``lw_core.tp_split``): a reader's block put
together from the savers' objects with ``layer_reads`` equals the block a reader-sized rank would
have saved itself, for every pair of sizes that divide the heads; the rest are refused naming both."""

from __future__ import annotations

import numpy as np
import pytest

from lw_core.tp_split import HeadSlice, TpSplitError, can_split, split_heads

HEAD = 8  # bytes of one head of one block of one layer (block_size x 2 x head_dim x dtype, tiny)
LAYERS = 3


def _full_kv(kv_heads: int) -> np.ndarray:
    """[layer, head, HEAD bytes]: distinct bytes everywhere."""
    return (np.arange(LAYERS * kv_heads * HEAD) % 251).astype(np.uint8).reshape(LAYERS, kv_heads, HEAD)


def _object(kv: np.ndarray, tp: int, rank: int) -> bytes:
    """What rank ``rank`` at ``tp`` saves: its heads of every layer, layer-major."""
    per = kv.shape[1] // tp
    return kv[:, rank * per:(rank + 1) * per, :].tobytes()


@pytest.mark.parametrize("kv_heads,src_tp,dst_tp", [(2, 2, 1), (2, 1, 2), (8, 4, 2), (8, 2, 4), (8, 1, 8),
                                                    (8, 8, 1), (4, 4, 4), (6, 3, 2), (6, 2, 3)])
def test_assembled_block_equals_what_the_reader_rank_would_save(kv_heads, src_tp, dst_tp) -> None:
    kv = _full_kv(kv_heads)
    objects = [_object(kv, src_tp, p) for p in range(src_tp)]
    layer_nbytes = kv_heads // dst_tp * HEAD
    for d in range(dst_tp):
        split = split_heads(kv_heads, src_tp, dst_tp, d)
        got = bytearray(LAYERS * layer_nbytes)
        for layer in range(LAYERS):
            base = layer * layer_nbytes
            reads = split.layer_reads(layer_nbytes, base)
            assert sum(r[3] for r in reads) == layer_nbytes  # every byte of the block, once
            for src, src_off, dst_off, n in reads:
                obj = objects[split.src_ranks[src]]
                got[base + dst_off:base + dst_off + n] = obj[src_off:src_off + n]
        assert bytes(got) == _object(kv, dst_tp, d), (src_tp, dst_tp, d)


def test_p2_to_d1_reads_both_objects_into_the_two_halves() -> None:
    s = split_heads(2, 2, 1, 0)
    assert s.src_ranks == (0, 1) and s.src_heads == 1 and s.dst_heads == 2
    assert s.slices == (HeadSlice(0, 0, 0, 1), HeadSlice(1, 0, 1, 1))
    # layer 1 of a 64-byte-per-layer block: source layer 1 starts at 32 in each 1-head object
    assert s.layer_reads(64, 64) == [(0, 32, 0, 32), (1, 32, 32, 32)]


def test_p1_to_d2_each_rank_reads_its_half_of_the_one_object() -> None:
    r0, r1 = split_heads(2, 1, 2, 0), split_heads(2, 1, 2, 1)
    assert r0.src_ranks == r1.src_ranks == (0,)
    assert r0.layer_reads(32, 32) == [(0, 64, 0, 32)] and r1.layer_reads(32, 32) == [(0, 96, 0, 32)]


@pytest.mark.parametrize("kv_heads,src_tp,dst_tp", [(6, 4, 1), (6, 1, 4), (2, 4, 1), (2, 1, 4), (3, 2, 1)])
def test_sizes_that_do_not_divide_the_heads_are_refused_naming_both(kv_heads, src_tp, dst_tp) -> None:
    assert not can_split(kv_heads, src_tp, dst_tp)
    with pytest.raises(TpSplitError, match=f"tensor_parallel_size={src_tp}.*tensor_parallel_size={dst_tp}"):
        split_heads(kv_heads, src_tp, dst_tp, 0)


def test_bad_rank_and_bad_layer_size_are_refused() -> None:
    with pytest.raises(TpSplitError, match="tp_rank=2"):
        split_heads(2, 1, 2, 2)
    with pytest.raises(TpSplitError, match="does not split into 2 heads"):
        split_heads(2, 2, 1, 0).layer_reads(63, 0)
