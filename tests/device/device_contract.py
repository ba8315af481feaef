"""Copier and pipeline contract checks shared by the device tests: ``test_device_path_fake`` runs
them on CPU tensors through the recording fake ops, ``test_device_copier`` on a real CUDA device.

Each check takes ``make(tensors, num_blocks) -> TorchCopier`` and ``dev`` (where KV tensors live).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from lw_core.backends.memory import MemoryBackend
from lw_core.pipeline import LayerPipeline
from lw_core.plan import ObjectLayout, ReqLoad, ReqSave
from lw_core.tp_split import split_heads
from lw_vllm.device.copier import block_order

NB = 8
Make = Callable[[list[torch.Tensor], int], object]


def layouts() -> dict[str, torch.Tensor]:
    """CPU float tensors in the KV layouts vLLM hands over (see tests/vllm/test_copier.py)."""
    g = torch.Generator().manual_seed(0)
    return {
        "gqa": torch.randn(NB, 2, 16, 64, generator=g),
        "kv_outer": torch.randn(2, NB, 16, 2, 32, generator=g),  # [2, nb, ...]: K and V apart
        "mla_fp16": torch.randn(NB, 1, 16, 576, generator=g).half(),
    }


def block_bytes(t: torch.Tensor, b: int) -> bytes:
    t = t.cpu()
    if t.shape[0] == 2 and t.shape[1] == NB:
        return b"".join(t[k, b].contiguous().view(torch.uint8).numpy().tobytes() for k in range(2))
    return t[b].contiguous().view(torch.uint8).numpy().tobytes()


def sync(dev: torch.device) -> None:
    if dev.type != "cpu":
        torch.accelerator.synchronize()


def check_round_trip(make: Make, dev: torch.device, name: str) -> None:
    src_cpu = layouts()[name]
    src, dst = src_cpu.to(dev), torch.zeros_like(src_cpu).to(dev)
    a, b = make([src], NB), make([dst], NB)
    n = a.block_nbytes(0)
    ids = [5, 1, 3]
    # pageable destinations: done when from_kv returns
    pageable = [bytearray(n) for _ in ids]
    assert a.wait(a.from_kv(0, ids, pageable, after=a.compute_event()), 10.0)
    for i, buf in zip(ids, pageable):
        assert bytes(buf) == block_bytes(src_cpu, i)
    # pinned staging from host_buffer: done once the token is
    staged = a.host_buffer(len(ids) * n)
    views = [staged[j * n : (j + 1) * n] for j in range(len(ids))]
    assert a.wait(a.from_kv(0, ids, views, after=a.compute_event()), 10.0)
    assert staged.tobytes() == b"".join(block_bytes(src_cpu, i) for i in ids)
    # loads from both kinds of host memory
    b.begin_load()
    b.make_visible(b.to_kv(0, [0, 7], pageable[:2]))
    b.make_visible(b.to_kv(0, [2], views[2:]))
    sync(dev)
    out = dst.cpu()
    assert block_bytes(out, 0) == block_bytes(src_cpu, 5)
    assert block_bytes(out, 7) == block_bytes(src_cpu, 1)
    assert block_bytes(out, 2) == block_bytes(src_cpu, 3)
    for j in (1, 3, 4, 5, 6):
        assert not any(block_bytes(out, j)), f"block {j} was never loaded but changed"


class NoViews(MemoryBackend):
    """A store that is not host-addressable: every transfer stages through read/write."""

    def view(self, handle, offset, nbytes):
        return None


def _kv(dev: torch.device, layers: int, fill: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    mk = (lambda: torch.randint(0, 256, (NB, 4, 96), generator=g, dtype=torch.uint8)) if fill else (
        lambda: torch.zeros(NB, 4, 96, dtype=torch.uint8))
    return [mk().to(dev) for _ in range(layers)]


def check_pipeline_save_then_load(make: Make, dev: torch.device, views: bool) -> None:
    layers = 3
    backend = MemoryBackend(64 << 20) if views else NoViews(64 << 20)
    src, dst = _kv(dev, layers, True), _kv(dev, layers, False)
    cs, cd = make(src, NB), make(dst, NB)
    layout = ObjectLayout(tuple(cs.block_nbytes(i) for i in range(layers)))
    keys, blocks = ["k0", "k1", "k2", "k3", "k4"], [6, 0, 3, 5, 1]
    with LayerPipeline(backend, cs, layout, max_transfer_blocks=2, save_timeout_s=10.0) as pipe:
        pipe.start_save([ReqSave("r", keys, blocks)])
        for layer in range(layers):
            pipe.save_layer(layer)
        res = pipe.finish_save()
    assert res.ok and sorted(res.committed_keys) == sorted(keys), res.errors
    targets = [2, 7, 4, 0, 1]
    with LayerPipeline(backend, cd, layout, prefetch_depth=2, max_transfer_blocks=2, layer_timeout_s=10.0) as pipe:
        pipe.start_load([ReqLoad("r", keys, targets)])
        for layer in range(layers):
            pipe.wait_layer(layer)
        load = pipe.finish_load()
    assert load.ok and not load.failed_block_ids, load.errors
    sync(dev)
    for layer in range(layers):
        s, d = src[layer].cpu(), dst[layer].cpu()
        for b_src, b_dst in zip(blocks, targets):
            assert torch.equal(d[b_dst], s[b_src]), (layer, b_src, b_dst)
        assert not d[[3, 5, 6]].any()  # never loaded
    backend.close()


class GatedReads(NoViews):
    """Reads of the layer at ``offset`` block until ``gate`` is set; ``returned`` is set after."""

    def __init__(self, *a, offset: int, **kw):
        super().__init__(*a, **kw)
        self.offset, self.gate, self.returned = offset, threading.Event(), threading.Event()

    def read(self, handles, offsets, dsts):
        if self.offset in offsets:
            self.gate.wait(10.0)
            super().read(handles, offsets, dsts)
            self.returned.set()
            return
        super().read(handles, offsets, dsts)


def check_late_load_never_lands(make: Make, dev: torch.device) -> None:
    """A layer whose read misses its deadline: its bytes never reach the KV, even once they arrive."""
    src = _kv(torch.device("cpu"), 2, True)
    dst = _kv(dev, 2, False)
    cd = make(dst, NB)
    layout = ObjectLayout((cd.block_nbytes(0), cd.block_nbytes(1)))
    backend = GatedReads(64 << 20, offset=layout.offsets[1])
    hs = backend.reserve(["a", "b"], layout.nbytes)
    for h, blk in zip(hs, (1, 2)):
        backend.write([h], [0], [src[0][blk].numpy().tobytes() + src[1][blk].numpy().tobytes()])
    backend.commit(hs)
    try:
        with LayerPipeline(backend, cd, layout, layer_timeout_s=0.3) as pipe:
            pipe.start_load([ReqLoad("r", ["a", "b"], [4, 6])])
            pipe.wait_layer(0)
            pipe.wait_layer(1)  # misses: the read is held at the gate
            res = pipe.finish_load()
            assert sorted(res.failed_block_ids) == [4, 6] and res.deadline_misses == [1]
            backend.gate.set()
            assert backend.returned.wait(10.0)
            time.sleep(0.2)  # the worker now finds the step cancelled and drops the batch
        sync(dev)
        assert not dst[1].cpu().any(), "a late load wrote into the KV cache"
        assert torch.equal(dst[0].cpu()[4], src[0][1]) and torch.equal(dst[0].cpu()[6], src[0][2])
    finally:
        backend.gate.set()
        backend.close()


# --- GQA read across TP sizes, in vLLM 0.32's head-major (CPU) and token-major (CUDA default) layouts ---

KV_HEADS, TOKENS, CONTENT = 4, 16, 8  # content: K and V of one head and token (float16)
ORDER_OF = {"LBHNC": "HN", "LBNHC": "NH"}


def gqa_views(dev: torch.device, layout: str, heads: int, layers: int) -> list[torch.Tensor]:
    """Per-layer KV views as vLLM 0.32 hands them over: logical ``[blocks, heads, tokens, content]``
    float16 over one buffer, each layer's blocks dense, a block ``[heads, tokens, content]`` in memory
    (``LBHNC``) or ``[tokens, heads, content]`` (``LBNHC``: the view is a permutation of it)."""
    buf = torch.zeros(layers, NB, heads * TOKENS * CONTENT, dtype=torch.float16, device=dev)
    if layout == "LBHNC":
        return [buf[i].view(NB, heads, TOKENS, CONTENT) for i in range(layers)]
    return [buf[i].view(NB, TOKENS, heads, CONTENT).permute(0, 2, 1, 3) for i in range(layers)]


def _gqa_reference(layers: int) -> torch.Tensor:
    """The full KV ``[layer, block, kv head, token, content]``, int16, distinct everywhere."""
    g = torch.Generator().manual_seed(11)
    return torch.randint(-(2**15), 2**15, (layers, NB, KV_HEADS, TOKENS, CONTENT), generator=g, dtype=torch.int16)


def _rank_part(ref: torch.Tensor, layer: int, tp: int, rank: int) -> torch.Tensor:
    per = KV_HEADS // tp
    return ref[layer, :, rank * per:(rank + 1) * per]


def check_cross_tp(make: Make, dev: torch.device, layout: str) -> None:
    """Blocks saved by the ranks of one TP size, read by those of another (P2 -> D1, P1 -> D2),
    through the device copies and the pipeline's ranged reads: each reader rank then holds exactly
    the heads the engine at its size holds, in its layout."""
    layers, blocks = 2, [5, 0, 3]
    ref = _gqa_reference(layers)
    order = ORDER_OF[layout]
    for src_tp, dst_tp in ((2, 1), (1, 2)):
        backend = MemoryBackend(16 << 20)
        for p in range(src_tp):
            kv = gqa_views(dev, layout, KV_HEADS // src_tp, layers)
            assert {block_order(v, NB) for v in kv} == {order}
            for layer, v in enumerate(kv):
                v.view(torch.int16).copy_(_rank_part(ref, layer, src_tp, p).to(dev))
            c = make(kv, NB)
            obj = ObjectLayout(tuple(c.block_nbytes(i) for i in range(layers)))
            with LayerPipeline(backend, c, obj, tp_rank=p, tp_size=src_tp, save_timeout_s=10.0) as pipe:
                pipe.start_save([ReqSave("r", [f"p{p}of{src_tp}/{b}" for b in blocks], blocks)])
                for layer in range(layers):
                    pipe.save_layer(layer)
                assert pipe.finish_save().ok
        for d in range(dst_tp):
            kv = gqa_views(dev, layout, KV_HEADS // dst_tp, layers)
            c = make(kv, NB)
            obj = ObjectLayout(tuple(c.block_nbytes(i) for i in range(layers)))
            split = split_heads(KV_HEADS, src_tp, dst_tp, d, order=order, tokens=TOKENS)
            keys = [[f"p{p}of{src_tp}/{b}" for b in blocks] for p in split.src_ranks]
            targets = [1, 7, 4]
            with LayerPipeline(backend, c, obj, tp_rank=d, tp_size=dst_tp, layer_timeout_s=10.0) as pipe:
                pipe.start_load([ReqLoad("r", keys[0], targets, split=split, more_keys=keys[1:])])
                for layer in range(layers):
                    pipe.wait_layer(layer)
                res = pipe.finish_load()
            assert res.ok, res.errors
            sync(dev)
            for layer, v in enumerate(kv):
                got, want = v.view(torch.int16).cpu(), _rank_part(ref, layer, dst_tp, d)
                for b_src, b_dst in zip(blocks, targets):
                    assert torch.equal(got[b_dst], want[b_src]), (layout, src_tp, dst_tp, d, layer, b_src)
                assert not got[[0, 2, 3, 5, 6]].any()  # never loaded
        backend.close()
