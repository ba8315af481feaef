"""Range arithmetic for reading GQA KV across TP sizes (``lw_core.tp_split``): a reader's block put
together from the savers' objects with ``layer_reads`` equals the block a reader-sized rank would
have saved itself, for every pair of sizes that divide the heads and for head-major and token-major
blocks (``lw_core.block_order``); the rest are refused naming both."""

from __future__ import annotations

import numpy as np
import pytest

from lw_core.block_order import HEAD_MAJOR, ONE_HEAD, TOKEN_MAJOR, canonical, check_order, row_offset
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


TOKENS, ROW = 4, 2  # a block of TOKENS tokens, ROW bytes per head and token (HEAD = TOKENS * ROW)


def _ordered_object(kv: np.ndarray, tp: int, rank: int, order: str) -> bytes:
    """What rank ``rank`` at ``tp`` saves when its blocks are ``order``-ed: per layer, its heads'
    rows ``[heads, tokens, ROW]`` (head-major) or ``[tokens, heads, ROW]`` (token-major)."""
    per = kv.shape[1] // tp
    rows = kv[:, rank * per:(rank + 1) * per, :].reshape(LAYERS, per, TOKENS, ROW)
    return (rows if order == HEAD_MAJOR else rows.transpose(0, 2, 1, 3)).tobytes()


@pytest.mark.parametrize("order", [HEAD_MAJOR, TOKEN_MAJOR])
@pytest.mark.parametrize("kv_heads,src_tp,dst_tp", [(2, 2, 1), (2, 1, 2), (8, 4, 2), (8, 2, 4), (8, 1, 8),
                                                    (8, 8, 1), (6, 3, 2), (6, 2, 3)])
def test_each_order_reassembles_the_reader_ranks_block(order, kv_heads, src_tp, dst_tp) -> None:
    kv = _full_kv(kv_heads)  # HEAD = TOKENS * ROW bytes per head
    objects = [_ordered_object(kv, src_tp, p, order) for p in range(src_tp)]
    layer_nbytes = kv_heads // dst_tp * HEAD
    for d in range(dst_tp):
        split = split_heads(kv_heads, src_tp, dst_tp, d, order=order, tokens=TOKENS)
        got = bytearray(LAYERS * layer_nbytes)
        for layer in range(LAYERS):
            base = layer * layer_nbytes
            reads = split.layer_reads(layer_nbytes, base)
            assert sum(r[3] for r in reads) == layer_nbytes
            for src, src_off, dst_off, n in reads:
                obj = objects[split.src_ranks[src]]
                got[base + dst_off:base + dst_off + n] = obj[src_off:src_off + n]
        assert bytes(got) == _ordered_object(kv, dst_tp, d, order), (order, src_tp, dst_tp, d)


def test_token_major_heads_are_read_one_row_per_token() -> None:
    # P2 -> D1, 2 heads, 4 tokens of 2 bytes: the reader's row t is [rank 0's row t, rank 1's row t].
    s = split_heads(2, 2, 1, 0, order=TOKEN_MAJOR, tokens=TOKENS)
    assert s.layer_reads(16, 0) == [(0, 0, 0, 2), (0, 2, 4, 2), (0, 4, 8, 2), (0, 6, 12, 2),
                                    (1, 0, 2, 2), (1, 2, 6, 2), (1, 4, 10, 2), (1, 6, 14, 2)]
    # P1 -> D2, rank 1: head 1 of each row of the one object, from layer 1 (the object's 16..31).
    assert split_heads(2, 1, 2, 1, order=TOKEN_MAJOR, tokens=TOKENS).layer_reads(8, 8) == [
        (0, 18, 0, 2), (0, 22, 2, 2), (0, 26, 4, 2), (0, 30, 6, 2)]


def test_head_major_ranges_do_not_depend_on_tokens() -> None:
    assert split_heads(2, 2, 1, 0, tokens=TOKENS).layer_reads(64, 64) == split_heads(2, 2, 1, 0).layer_reads(64, 64)


def test_bad_order_and_token_counts_are_refused_naming_the_accepted_values() -> None:
    with pytest.raises(TpSplitError, match=r"block order 'HND' is not one of \['HN', 'NH'\]"):
        split_heads(2, 2, 1, 0, order="HND")
    with pytest.raises(TpSplitError, match="tokens=0"):
        split_heads(2, 2, 1, 0, order=TOKEN_MAJOR, tokens=0)
    with pytest.raises(TpSplitError, match="does not split into 2 heads x 3 tokens"):
        split_heads(2, 2, 1, 0, order=TOKEN_MAJOR, tokens=3).layer_reads(16, 0)


def test_block_order_helpers() -> None:
    assert check_order("NH") == TOKEN_MAJOR
    with pytest.raises(ValueError, match="head-major, token-major"):
        check_order("N")
    assert canonical(HEAD_MAJOR, 1) == canonical(TOKEN_MAJOR, 1) == ONE_HEAD
    assert canonical(TOKEN_MAJOR, 4) == TOKEN_MAJOR
    with pytest.raises(ValueError, match="heads=0"):
        canonical(HEAD_MAJOR, 0)
    # [2 heads, 3 tokens] vs [3 tokens, 2 heads] of 8-byte rows: head 1, token 2
    assert row_offset(HEAD_MAJOR, 2, 3, 1, 2, 8) == 40 and row_offset(TOKEN_MAJOR, 2, 3, 1, 2, 8) == 40
    assert row_offset(HEAD_MAJOR, 2, 3, 0, 1, 8) == 8 and row_offset(TOKEN_MAJOR, 2, 3, 0, 1, 8) == 16
