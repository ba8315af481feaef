"""Direct copies on a real CUDA device: the embedded pool's arena registered with the GPU, batches
moved by the GPU's own gather/scatter and by one batched DMA, a failed registration that leaves no
CUDA error behind, and leases, views and commits that wait for the copies that use them.

Skipped where there is no CUDA device (``scripts/device-check.sh`` runs it on a GPU machine).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here; scripts/device-check.sh runs these on a GPU machine"
)

from recording_backend import Recording, ViewsOnly  # noqa: E402

from lw_core.backends.embedded import EmbeddedBackend  # noqa: E402
from lw_core.pipeline import LayerPipeline  # noqa: E402
from lw_core.plan import ObjectLayout, ReqLoad, ReqSave  # noqa: E402
from lw_vllm.device.copier import TorchCopier  # noqa: E402
from lw_vllm.device.device_streams import TorchDeviceOps  # noqa: E402
from lw_vllm.device.host_register import HostRegistry  # noqa: E402

DEV = torch.device("cuda", 0)
NB, LAYERS, MiB = 16, 3, 1 << 20
SLEEP_CYCLES = 400_000_000
KEYS, SRC, DST = [f"k{i}" for i in range(6)], [9, 0, 3, 15, 5, 12], [2, 7, 4, 1, 14, 11]


def _kv(fill: bool) -> list[torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(5)
    if fill:
        return [torch.randint(0, 256, (NB, 4, 96), generator=g, dtype=torch.uint8, device=DEV) for _ in range(LAYERS)]
    return [torch.zeros(NB, 4, 96, dtype=torch.uint8, device=DEV) for _ in range(LAYERS)]


def _layout(c: TorchCopier) -> ObjectLayout:
    return ObjectLayout(tuple(c.block_nbytes(i) for i in range(LAYERS)))


def _save(backend, c, keys=KEYS, blocks=SRC, **kw):
    with LayerPipeline(backend, c, _layout(c), max_transfer_blocks=4, save_timeout_s=30.0, **kw) as pipe:
        pipe.start_save([ReqSave("r", keys, blocks)])
        for layer in range(LAYERS):
            pipe.save_layer(layer)
        return pipe.finish_save()


def _load(backend, c, keys=KEYS, blocks=DST, **kw):
    with LayerPipeline(backend, c, _layout(c), prefetch_depth=2, max_transfer_blocks=4, layer_timeout_s=30.0, **kw) as pipe:
        pipe.start_load([ReqLoad("r", keys, blocks)])
        for layer in range(LAYERS):
            pipe.wait_layer(layer)
        return pipe.finish_load()


def _same(src, dst, src_blocks=SRC, dst_blocks=DST) -> None:
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        s, d = src[layer].cpu(), dst[layer].cpu()
        for b_src, b_dst in zip(src_blocks, dst_blocks):
            assert torch.equal(d[b_dst], s[b_src]), (layer, b_src, b_dst)


@pytest.fixture
def pool(pool_path):
    b = EmbeddedBackend(pool_path, capacity_bytes=8 * MiB)
    yield b
    b.close()


def _copies_done(*copiers: TorchCopier):
    """Whether everything enqueued so far on the copiers' side streams has completed."""

    def done() -> bool:
        return all(c.dev.ops.query(c.dev.ops.record(s)) for c in copiers for s in (c.dev.h2d_stream, c.dev.d2h_stream))

    return done


@pytest.mark.parametrize("by", ["address", "views"])
@pytest.mark.parametrize("mechanism", ["kernel", "batch_dma", "auto"])
def test_save_and_load_move_directly_between_the_registered_arena_and_the_kv(pool, mechanism, by):
    pool = pool if by == "address" else ViewsOnly(pool)
    if mechanism == "batch_dma" and not TorchDeviceOps(DEV).can_batch_copy:
        pytest.skip("cuda-python's driver bindings (cuda.bindings) are not installed: no batched DMA")
    src, dst = _kv(True), _kv(False)
    cs, cd = TorchCopier(src, NB, mechanism=mechanism), TorchCopier(dst, NB, mechanism=mechanism)
    assert _save(pool, cs).ok
    assert _load(pool, cd).ok
    _same(src, dst)
    how = "batch_dma" if mechanism == "batch_dma" else "kernel"  # auto: 384-byte segments -> kernel
    assert cs.mechanism_counts[how] > 0 and cd.mechanism_counts[how] > 0, (cs.mechanism_counts, cd.mechanism_counts)
    assert cs.mechanism_counts["staged"] == cd.mechanism_counts["staged"] == 0
    assert cs.register_failures == cd.register_failures == 0
    cs.close()
    cd.close()


def test_a_failed_registration_is_counted_leaves_no_cuda_error_and_stages(pool):
    other = HostRegistry(TorchDeviceOps(DEV))  # someone else registered the arena: CUDA refuses it again
    assert other.register(pool.host_regions(), 0) == 0
    src, dst = _kv(True), _kv(False)
    cs, cd = TorchCopier(src, NB), TorchCopier(dst, NB)
    try:
        assert _save(pool, cs).ok
        assert torch.ones(1024, device=DEV).sum().item() == 1024  # no stale CUDA error surfaces here
        assert _load(pool, cd).ok
        _same(src, dst)
        assert cs.register_failures + cd.register_failures == 1  # tried once, not again
        assert cd.mechanism_counts["staged"] > 0 and cd.mechanism_counts["kernel"] == 0
    finally:
        other.release(0)


def test_a_direct_load_after_busy_compute_is_checked_and_released_only_once_its_copies_completed(pool):
    src, dst = _kv(True), _kv(False)
    assert _save(pool, TorchCopier(src, NB)).ok
    cd = TorchCopier(dst, NB)
    _load(pool, cd, keys=KEYS[:1], blocks=[0])  # warm-up (registration, first launches)
    torch.cuda.synchronize()
    rec = Recording(pool, _copies_done(cd))
    torch.cuda._sleep(SLEEP_CYCLES)  # the compute stream is busy: the step's loads wait for it
    res = _load(rec, cd)
    assert res.ok, res.errors
    _same(src, dst)
    assert [c[2] for c in rec.calls if c[0] == "intact"] == [True]
    assert rec.wait_for("release")[-1] == ("release", len(KEYS), True)
    cd.close()


def test_a_direct_save_reads_the_block_after_its_compute_and_commits_after_its_copy(pool):
    kv = _kv(False)
    cs = TorchCopier(kv, NB)
    _save(pool, cs, keys=["warm"], blocks=[0])  # warm-up
    torch.cuda.synchronize()
    rec = Recording(pool, _copies_done(cs))
    torch.cuda._sleep(SLEEP_CYCLES)
    for layer in range(LAYERS):
        kv[layer][SRC] = layer + 1  # the "attention" writing the blocks, behind the sleep
    res = _save(rec, cs)
    assert res.ok, res.errors
    assert [c for c in rec.calls if c[0] == "commit"] == [("commit", len(KEYS), True)]
    dst = _kv(False)
    assert _load(pool, TorchCopier(dst, NB)).ok
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        assert dst[layer][DST].eq(layer + 1).all(), "the save read a block before its compute wrote it"
    cs.close()
