"""The device path's own code (``TorchCopier`` over ``InlineOps``: CPU tensors, copies inline) on a
real Mooncake client: saves copy each layer straight into the reservations in the put arena
(``write_buffers``) and are put from there, per-layer loads copy straight out of the get arena
(``read_lent``), both by the direct mechanism; with either arena off that half falls back to the
pipeline's staging. Bytes exact throughout."""

from __future__ import annotations

import pytest
import torch

from lw_core.pipeline import LayerPipeline
from lw_core.plan import ObjectLayout, ReqLoad, ReqSave
from lw_vllm.device.copier import TorchCopier
from lw_vllm.device.device_streams import InlineOps

NB, LAYERS = 16, 4
KEYS, SRC, DST = [f"dev{i}" for i in range(6)], [0, 3, 5, 7, 9, 11], [15, 2, 14, 1, 13, 4]


@pytest.mark.parametrize("put_arena, get_arena", [(True, True), (False, True), (True, False)],
                         ids=["both_arenas", "no_put_arena", "no_get_arena"])
def test_saves_and_per_layer_loads_move_directly_between_the_arenas_and_the_kv(cluster, make_client, put_arena, get_arena):
    b = make_client(cluster, load="per_layer", put_arena_bytes=(4 << 20) * put_arena, get_arena_bytes=(4 << 20) * get_arena)
    g = torch.Generator().manual_seed(3)
    src = [torch.randint(0, 256, (NB, 2, 4096), generator=g, dtype=torch.uint8) for _ in range(LAYERS)]
    dst = [torch.zeros(NB, 2, 4096, dtype=torch.uint8) for _ in range(LAYERS)]
    cs = TorchCopier(src, NB, ops=InlineOps(), mechanism="kernel")
    cd = TorchCopier(dst, NB, ops=InlineOps(), mechanism="kernel")
    layout = ObjectLayout(tuple(cs.block_nbytes(i) for i in range(LAYERS)))
    try:
        with LayerPipeline(b, cs, layout, max_transfer_blocks=4) as pipe:
            pipe.start_save([ReqSave("r", KEYS, SRC)])
            for layer in range(LAYERS):
                pipe.save_layer(layer)
            res = pipe.finish_save()
        assert res.ok and sorted(res.committed_keys) == sorted(KEYS), res.errors
        with LayerPipeline(b, cd, layout, max_transfer_blocks=4) as pipe:
            pipe.start_load([ReqLoad("r", KEYS, DST)])
            for layer in range(LAYERS):
                pipe.wait_layer(layer)
            res = pipe.finish_load()
        assert res.ok, res.errors
        for layer in range(LAYERS):
            for s, d in zip(SRC, DST):
                assert torch.equal(dst[layer][d], src[layer][s]), (layer, s, d)
        st = b.stats()
        total = len(KEYS) * layout.nbytes
        batches = LAYERS * 2  # 6 blocks in batches of 4
        assert cs.mechanism_counts["kernel"] == (batches if put_arena else 0)
        assert (st["put_direct_bytes"], st["put_staged_bytes"]) == ((total, 0) if put_arena else (0, total))
        assert cd.mechanism_counts["kernel"] == (batches if get_arena else 0)
        assert st.get("arena_range_gets", 0) == (batches if get_arena else 0)
        assert cs.mechanism_counts["staged"] == cd.mechanism_counts["staged"] == 0  # no pageable source either way
    finally:
        cs.close()
        cd.close()
        b.store.remove_all(True)
