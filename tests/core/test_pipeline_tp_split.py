"""The layer pipeline loading GQA KV saved at another TP size (``ReqLoad.split``): each block's
layer is put together from ranged reads of the saver ranks' objects. P2 -> D1 (one block from two
objects), P1 -> D2 (each rank its half of one object), mixed with plain loads in one step, and a
missing source object failing only its own block."""

from __future__ import annotations

import numpy as np
import pytest

from lw_core.backends.memory import MemoryBackend
from lw_core.pipeline import LayerPipeline
from lw_core.pipeline.host_copier import HostCopier
from lw_core.plan import ObjectLayout, ReqLoad
from lw_core.tp_split import split_heads

KV_HEADS = 2
HEAD_BYTES = (16, 32, 16)  # one head of one block, per layer (layers of different sizes: offsets matter)
SENTINEL = 0xEE


def _heads(chunk: int) -> list[np.ndarray]:
    """Per layer ``[KV_HEADS, head bytes]``: the full KV of one chunk, distinct everywhere."""
    rng = np.random.default_rng(chunk)
    return [rng.integers(0, 255, size=(KV_HEADS, n), dtype=np.uint8) for n in HEAD_BYTES]


def _rank_bytes(chunk: int, tp: int, rank: int) -> bytes:
    """The object rank ``rank`` at ``tp`` saves for ``chunk``: its heads of every layer, layer-major."""
    per = KV_HEADS // tp
    return b"".join(h[rank * per:(rank + 1) * per].tobytes() for h in _heads(chunk))


def _key(tp: int, rank: int, chunk: int) -> str:
    return f"tp{rank}of{tp}/c{chunk}"


def _save(backend: MemoryBackend, tp: int, chunks: list[int], skip: set[tuple[int, int]] = frozenset()) -> None:
    for rank in range(tp):
        for c in chunks:
            if (rank, c) in skip:
                continue
            data = _rank_bytes(c, tp, rank)
            (h,) = backend.reserve([_key(tp, rank, c)], len(data))
            backend.write([h], [0], [data])
            backend.commit([h])


def _load(backend: MemoryBackend, dst_tp: int, rank: int, loads: list[ReqLoad], num_blocks: int = 8):
    per = KV_HEADS // dst_tp
    layout = ObjectLayout(tuple(per * n for n in HEAD_BYTES))
    copier = HostCopier.allocate(layout.num_layers, num_blocks, list(layout.layer_nbytes), fill=SENTINEL)
    with LayerPipeline(backend, copier, layout, tp_rank=rank, tp_size=dst_tp) as pipe:
        pipe.start_load(loads)
        for layer in range(layout.num_layers):
            pipe.wait_layer(layer)
        res = pipe.finish_load()
    return copier, res


def _block(copier: HostCopier, block: int) -> bytes:
    return b"".join(layer[block].tobytes() for layer in copier.kv)


def _split_load(req: str, src_tp: int, dst_tp: int, rank: int, chunks: list[int], blocks: list[int]) -> ReqLoad:
    split = split_heads(KV_HEADS, src_tp, dst_tp, rank)
    keys = [[_key(src_tp, p, c) for c in chunks] for p in split.src_ranks]
    return ReqLoad(req, keys[0], blocks, split=split, more_keys=keys[1:])


def test_p2_to_d1_puts_each_block_together_from_both_ranks_objects() -> None:
    backend = MemoryBackend(1 << 20)
    _save(backend, 2, [0, 1, 2])
    load = _split_load("r", 2, 1, 0, [0, 1, 2], [5, 1, 6])
    assert load.more_keys == [[_key(2, 1, c) for c in (0, 1, 2)]]
    copier, res = _load(backend, 1, 0, [load])
    assert res.ok and res.loaded_objects == 3, res
    for c, b in zip([0, 1, 2], [5, 1, 6]):
        assert _block(copier, b) == _rank_bytes(c, 1, 0), c  # what a TP=1 engine would have saved


@pytest.mark.parametrize("rank", [0, 1])
def test_p1_to_d2_each_rank_reads_its_half_of_the_one_object(rank: int) -> None:
    backend = MemoryBackend(1 << 20)
    _save(backend, 1, [0, 1])
    copier, res = _load(backend, 2, rank, [_split_load("r", 1, 2, rank, [0, 1], [2, 3])])
    assert res.ok, res
    for c, b in zip([0, 1], [2, 3]):
        assert _block(copier, b) == _rank_bytes(c, 2, rank)


def test_split_and_plain_loads_in_one_step() -> None:
    backend = MemoryBackend(1 << 20)  # has zero-copy views: the plain load may use them
    _save(backend, 2, [0, 1])
    _save(backend, 1, [7])
    plain = ReqLoad("plain", [_key(1, 0, 7)], [4])
    copier, res = _load(backend, 1, 0, [plain, _split_load("split", 2, 1, 0, [0, 1], [0, 2])])
    assert res.ok and res.loaded_objects == 3, res
    assert _block(copier, 4) == _rank_bytes(7, 1, 0)
    assert _block(copier, 0) == _rank_bytes(0, 1, 0) and _block(copier, 2) == _rank_bytes(1, 1, 0)


def test_a_missing_source_object_fails_only_its_block() -> None:
    backend = MemoryBackend(1 << 20)
    _save(backend, 2, [0, 1, 2], skip={(1, 1)})  # rank 1's object of chunk 1 is not there
    copier, res = _load(backend, 1, 0, [_split_load("r", 2, 1, 0, [0, 1, 2], [3, 4, 5])])
    assert res.failed_block_ids == [4] and res.failed_req_ids == ["r"]
    assert any(_key(2, 1, 1) in e for e in res.errors), res.errors
    assert _block(copier, 3) == _rank_bytes(0, 1, 0) and _block(copier, 5) == _rank_bytes(2, 1, 0)


def test_more_keys_must_match_the_split() -> None:
    split = split_heads(KV_HEADS, 2, 1, 0)
    with pytest.raises(ValueError, match="more_keys must be 1 lists of 2 keys"):
        ReqLoad("r", ["a", "b"], [0, 1], split=split)
    with pytest.raises(ValueError, match="more_keys must be 1 lists of 2 keys"):
        ReqLoad("r", ["a", "b"], [0, 1], split=split, more_keys=[["c"]])
