"""GQA KV in every physical layout vLLM 0.32 can resolve, built by vLLM itself
(``create_kv_cache_views``, the per-layer ``[blocks, heads, tokens, content]`` views it hands the
connector) and moved through the copier's real block views and the layer pipeline:

* the order the copier's views have (``copier.block_order``, from strides) is the one the layout's
  name promises (``kv_layout``); kernel blocks smaller than the block are refused when that breaks
  the promise, and layouts whose layer views are not dense are refused by the copier;
* a block saved by TP=2 ranks and read at TP=1 (and the reverse) is byte-exact what the TP=1 (or
  TP=2) engine holds itself, for head-major and token-major blocks alike;
* engines whose blocks order heads and tokens differently have different ``layout_fp``.

Cheap: no engine.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from lw_core.backends.memory import MemoryBackend  # noqa: E402
from lw_core.block_order import HEAD_MAJOR, ONE_HEAD, TOKEN_MAJOR  # noqa: E402
from lw_core.config import parse_config  # noqa: E402
from lw_core.keys import rank_tag  # noqa: E402
from lw_core.pipeline import LayerPipeline  # noqa: E402
from lw_core.plan import ObjectLayout, ReqLoad, ReqSave  # noqa: E402
from lw_core.tp_split import split_heads  # noqa: E402
from lw_vllm import pool  # noqa: E402
from lw_vllm.device.copier import TorchCopier, block_order  # noqa: E402
from lw_vllm.identity import kv_layout  # noqa: E402
from lw_vllm.meta import Xfer  # noqa: E402
from lw_vllm.worker.worker_side import WorkerSide  # noqa: E402

NB, LAYERS, BS, HEAD_SIZE = 6, 3, 16, 4
KV_HEADS = 4
DENSE = ("LBHNC", "LBNHC", "LHBNC")  # every layer's view is dense: the copier moves its blocks
INTERLEAVED = ("BLHNC", "BLNHC", "BHLNC")  # layers inside each block: no dense layer view
EXPECTED = {"LBHNC": HEAD_MAJOR, "LBNHC": TOKEN_MAJOR, "LHBNC": HEAD_MAJOR,
            "BLHNC": HEAD_MAJOR, "BLNHC": TOKEN_MAJOR, "BHLNC": HEAD_MAJOR}


def test_every_layout_vllm_has_is_covered() -> None:
    assert sorted(DENSE + INTERLEAVED) == sorted(m.name for m in KVCacheLayout)


def _views(layout: str, heads: int, kernel_block: int | None = None) -> list[torch.Tensor]:
    """One engine rank's per-layer KV views as vLLM 0.32 allocates them (``allocate_kv_cache``:
    one backing buffer, strides from the layout) -- float16, ``[NB, heads, BS, 2 * HEAD_SIZE]``."""
    lay = KVCacheLayout[layout]
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=torch.float16)
    fixed_block = LAYERS * spec.page_size_bytes if lay.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NB, LAYERS, lay,
                                                             fixed_strides=(None, fixed_block, None, None, None))
    size = NB * LAYERS * spec.page_size_bytes
    t = KVCacheTensor(size=size, layers=[f"l{i}" for i in range(LAYERS)], layer_stride=layer_stride,
                      block_stride=block_stride)
    return create_kv_cache_views(torch.zeros(size, dtype=torch.int8), spec, NB, lay, t,
                                 kernel_block_size=kernel_block)


def _reference() -> np.ndarray:
    """The full model's KV: ``[layer, block, kv head, token, content]`` as int16, distinct everywhere."""
    rng = np.random.default_rng(7)
    return rng.integers(-(2**15), 2**15, size=(LAYERS, NB, KV_HEADS, BS, 2 * HEAD_SIZE), dtype=np.int16)


def _kernel_view(v: torch.Tensor) -> torch.Tensor:
    """``v`` as int16 ``[block, kernel block, heads, tokens of a kernel block, content]``."""
    r = v.shape[0] // NB
    return v.view(torch.int16).view(NB, r, *v.shape[1:])


def _logical(v: torch.Tensor) -> np.ndarray:
    """The KV a view holds as ``[block, head, token, content]`` (kernel blocks put back together)."""
    k = _kernel_view(v)
    return k.permute(0, 2, 1, 3, 4).reshape(NB, v.shape[1], BS, v.shape[3]).numpy()


def _fill(views: list[torch.Tensor], ref: np.ndarray, tp: int, rank: int) -> None:
    """What rank ``rank`` of an engine at ``tp`` holds: its heads of the full KV, by logical index."""
    per = KV_HEADS // tp
    for layer, v in enumerate(views):
        k = _kernel_view(v)
        part = torch.from_numpy(ref[layer, :, rank * per:(rank + 1) * per])  # [NB, per, BS, C]
        k.copy_(part.reshape(NB, per, k.shape[1], k.shape[3], k.shape[4]).permute(0, 2, 1, 3, 4))


def _holds(views: list[torch.Tensor], ref: np.ndarray, tp: int, rank: int, blocks: list[int]) -> bool:
    per = KV_HEADS // tp
    return all(np.array_equal(_logical(v)[blocks], ref[layer, blocks, rank * per:(rank + 1) * per])
               for layer, v in enumerate(views))


def _key(tp: int, rank: int, block: int) -> str:
    return f"{rank_tag(tp_rank=rank, tp_size=tp)}/b{block}"


def _save(backend: MemoryBackend, views: list[torch.Tensor], tp: int, rank: int, blocks: list[int]) -> None:
    copier = TorchCopier(views, NB)
    layout = ObjectLayout(tuple(copier.block_nbytes(i) for i in range(LAYERS)))
    with LayerPipeline(backend, copier, layout, tp_rank=rank, tp_size=tp) as pipe:
        pipe.start_save([ReqSave("r", [_key(tp, rank, b) for b in blocks], blocks)])
        for layer in range(LAYERS):
            pipe.save_layer(layer)
        res = pipe.finish_save()
    assert len(res.committed_keys) == len(blocks), res


def _load_split(backend: MemoryBackend, views: list[torch.Tensor], order: str, src_tp: int, tp: int, rank: int,
                blocks: list[int]) -> None:
    copier = TorchCopier(views, NB)
    layout = ObjectLayout(tuple(copier.block_nbytes(i) for i in range(LAYERS)))
    split = split_heads(KV_HEADS, src_tp, tp, rank, order=order, tokens=BS)
    keys = [[_key(src_tp, p, b) for b in blocks] for p in split.src_ranks]
    with LayerPipeline(backend, copier, layout, tp_rank=rank, tp_size=tp) as pipe:
        pipe.start_load([ReqLoad("r", keys[0], blocks, split=split, more_keys=keys[1:])])
        for layer in range(LAYERS):
            pipe.wait_layer(layer)
        res = pipe.finish_load()
    assert res.ok, res


@pytest.mark.parametrize("layout", DENSE + INTERLEAVED)
@pytest.mark.parametrize("heads", [KV_HEADS, 1])
def test_the_copier_sees_the_order_the_layout_names(layout: str, heads: int) -> None:
    views = _views(layout, heads)
    assert kv_layout.order_of(layout) == EXPECTED[layout]
    want = ONE_HEAD if heads == 1 else EXPECTED[layout]
    assert {block_order(v, NB) for v in views} == {want}
    assert kv_layout.check_tensors(EXPECTED[layout], layout, {f"l{i}": want for i in range(LAYERS)}) \
        == EXPECTED[layout]


@pytest.mark.parametrize("layout", INTERLEAVED)
def test_layouts_without_dense_layer_views_are_refused_by_the_copier(layout: str) -> None:
    with pytest.raises(NotImplementedError, match="is not a dense layout"):
        TorchCopier(_views(layout, KV_HEADS), NB)


def test_head_major_kernel_blocks_inside_a_block_are_refused_naming_the_fix() -> None:
    views = _views("LBHNC", KV_HEADS, kernel_block=BS // 2)  # [2 kernel blocks, heads, BS/2 tokens]
    found = {f"l{i}": block_order(v, NB) for i, v in enumerate(views)}
    assert set(found.values()) == {"SHN"}
    with pytest.raises(NotImplementedError, match=r"LBHNC promises head-major blocks.*'SHN'.*--block-size"):
        kv_layout.check_tensors(HEAD_MAJOR, "LBHNC", found)


def test_token_major_kernel_blocks_inside_a_block_are_just_more_tokens() -> None:
    views = _views("LBNHC", KV_HEADS, kernel_block=BS // 2)
    assert {block_order(v, NB) for v in views} == {TOKEN_MAJOR}


def test_layers_of_different_orders_are_refused() -> None:
    with pytest.raises(NotImplementedError, match="ordered differently"):
        kv_layout.check_tensors(HEAD_MAJOR, "LBHNC", {"l0": HEAD_MAJOR, "l1": TOKEN_MAJOR})


def test_an_unresolved_layout_takes_the_tensors_order() -> None:
    assert kv_layout.check_tensors(None, None, {"l0": TOKEN_MAJOR}) == TOKEN_MAJOR
    assert kv_layout.check_tensors(None, None, {"l0": "SHN"}) is None
    assert kv_layout.check_tensors(None, None, {"l0": ONE_HEAD}) is None


@pytest.mark.parametrize("layout,kernel_block", [(name, None) for name in DENSE] + [("LBNHC", BS // 2)],
                         ids=[*DENSE, "LBNHC-kernel-blocks"])
@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2), (4, 2), (2, 4), (4, 1)])
def test_a_block_read_across_tp_sizes_is_what_the_reader_engine_holds(layout, kernel_block, src_tp, dst_tp) -> None:
    ref = _reference()
    order = kv_layout.order_of(layout)
    assert order is not None
    backend = MemoryBackend(1 << 22)
    blocks = [4, 0, 2]
    for p in range(src_tp):
        saver = _views(layout, KV_HEADS // src_tp, kernel_block)
        _fill(saver, ref, src_tp, p)
        _save(backend, saver, src_tp, p, blocks)
    for d in range(dst_tp):
        reader = _views(layout, KV_HEADS // dst_tp, kernel_block)
        _load_split(backend, reader, order, src_tp, dst_tp, d, blocks)
        assert _holds(reader, ref, dst_tp, d, blocks), (layout, d)
        assert all(not _logical(v)[[1, 3, 5]].any() for v in reader)  # blocks not loaded stay untouched


def test_token_major_blocks_read_as_head_major_are_scrambled() -> None:
    """What the split did before it read the order: TP=2 ranks' token-major blocks put together by
    head ranges differ from the TP=1 engine's block in most of their bytes."""
    ref = _reference()
    backend = MemoryBackend(1 << 22)
    for p in range(2):
        saver = _views("LBNHC", KV_HEADS // 2)
        _fill(saver, ref, 2, p)
        _save(backend, saver, 2, p, [1])
    reader = _views("LBNHC", KV_HEADS)
    _load_split(backend, reader, HEAD_MAJOR, 2, 1, 0, [1])
    assert not _holds(reader, ref, 1, 0, [1])
    want = _views("LBNHC", KV_HEADS)
    _fill(want, ref, 1, 0)
    got_b = TorchCopier(reader, NB).layers[0][:, 1].numpy().tobytes()
    want_b = TorchCopier(want, NB).layers[0][:, 1].numpy().tobytes()
    assert sum(a != b for a, b in zip(got_b, want_b)) > len(want_b) // 2


# --- keys and the worker's split (fake vLLM configs: no engine) ---

def _configs(layout: str | None, tp: int = 1, kv_heads: int = 2, mla: bool = False):
    spec = SimpleNamespace(block_size=BS, page_size_bytes=1024 // tp)
    kc = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])])
    mc = SimpleNamespace(model="tiny-test", dtype="float16", use_mla=mla, hf_config=SimpleNamespace(n=1),
                         get_total_num_kv_heads=lambda: kv_heads)
    vc = SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto", kv_cache_layout=layout),
                         parallel_config=SimpleNamespace(tensor_parallel_size=tp))
    return vc, kc


def _fp(layout: str | None, tp: int = 1, **kw) -> str:
    vc, kc = _configs(layout, tp, **kw)
    return pool.key_space(vc, kc, parse_config({"backend": "embedded"})).layout_fp


def test_layout_fp_differs_between_block_orders_and_only_there() -> None:
    assert _fp("LBHNC") != _fp("LBNHC")
    assert _fp("LBHNC") == _fp("LHBNC") == _fp("HND")  # the same bytes in every block
    assert _fp("LBNHC") == _fp("NHD")
    assert _fp(None) not in (_fp("LBHNC"), _fp("LBNHC"))
    # One kv head per rank: both orders are the same bytes, so the keys are too.
    assert _fp("LBHNC", 2) == _fp("LBNHC", 2)
    assert _fp("LBHNC", mla=True) == _fp("LBNHC", mla=True)


def test_the_key_space_of_another_tp_size_carries_that_sizes_order() -> None:
    vc1, kc1 = _configs("LBNHC", 1, kv_heads=4)
    vc2, kc2 = _configs("LBNHC", 2, kv_heads=4)
    cfg = parse_config({"backend": "embedded"})
    assert pool.key_space(vc1, kc1, cfg, 2) == pool.key_space(vc2, kc2, cfg)
    vc3, kc3 = _configs("LBHNC", 2, kv_heads=4)
    assert pool.key_space(vc1, kc1, cfg, 2) != pool.key_space(vc3, kc3, cfg)


@pytest.mark.parametrize("layout,order", [("LBHNC", HEAD_MAJOR), ("LBNHC", TOKEN_MAJOR)])
def test_the_worker_splits_by_its_engines_order(layout: str, order: str) -> None:
    vc, kc = _configs(layout)
    w = WorkerSide(vc, kc, parse_config({"backend": "embedded"}), "kv_both")
    ld = w.plan_load(Xfer("r", [b"\x01" * 16], [3], src_tp=2))
    assert ld is not None and ld.split == split_heads(2, 2, 1, 0, order=order, tokens=BS)


def test_a_worker_whose_layout_is_unknown_does_not_split(caplog) -> None:
    vc, kc = _configs(None)
    w = WorkerSide(vc, kc, parse_config({"backend": "embedded"}), "kv_both")
    assert w.plan_load(Xfer("r", [b"\x01" * 16], [7], src_tp=2)) is None
    assert w.take_load_errors() == {7}
    assert any("does not say how heads and tokens are ordered" in r.getMessage() for r in caplog.records)
