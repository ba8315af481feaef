"""Hybrid models' KV cache groups without an engine: which layers a pool object holds, which group
names the chunks, what is refused, and how a chunk's anchor block maps to each layer's group."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from lw_core.pipeline.host_copier import HostCopier
from lw_vllm import pool
from lw_vllm.hybrid.group_copier import NULL_BLOCK, GroupCopier


class FullAttentionSpec(SimpleNamespace):
    pass


class SlidingWindowSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


class ChunkedLocalAttentionSpec(SimpleNamespace):
    pass


def _cfg(*groups: tuple[type, list[str], int]) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=kind(block_size=bs, page_size_bytes=64), layer_names=names)
        for kind, names, bs in groups])


def test_layers_in_model_order_and_the_full_group_anchors() -> None:
    kc = _cfg((SlidingWindowSpec, ["m.layers.0.attn", "m.layers.2.attn"], 16),
              (FullAttentionSpec, ["m.layers.1.attn", "m.layers.3.attn"], 16))
    assert pool.anchor_group(kc) == 1
    assert pool.layer_names(kc) == ["m.layers.0.attn", "m.layers.1.attn", "m.layers.2.attn", "m.layers.3.attn"]
    assert pool.layer_groups(kc)["m.layers.2.attn"] == 0
    assert pool.block_size(kc) == 16
    pool.check_supported(SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=1)), kc)


def test_state_layers_are_not_in_the_objects() -> None:
    kc = _cfg((MambaSpec, ["m.layers.0.mixer"], 1024), (FullAttentionSpec, ["m.layers.1.attn"], 256))
    assert pool.state_groups(kc) == [0]
    assert pool.layer_names(kc) == ["m.layers.1.attn"]
    pool.check_supported(SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=1)), kc)


@pytest.mark.parametrize("groups, words", [
    (((ChunkedLocalAttentionSpec, ["a"], 16), (FullAttentionSpec, ["b"], 16)), "ChunkedLocalAttentionSpec"),
    (((SlidingWindowSpec, ["a"], 16), (SlidingWindowSpec, ["b"], 16)), "full-attention"),
    (((SlidingWindowSpec, ["a"], 32), (FullAttentionSpec, ["b"], 16)), "different block sizes"),
])
def test_unsupported_hybrids_are_refused_naming_why(groups: tuple, words: str) -> None:
    vc = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=1))
    with pytest.raises(NotImplementedError, match=words):
        pool.check_supported(vc, _cfg(*groups))


def test_group_copier_maps_anchor_blocks_and_skips_null_blocks() -> None:
    host = HostCopier.allocate(2, 8, 4, fill=0)  # layer 0: anchor group, layer 1: the other group
    gc = GroupCopier(host, [-1, 0])
    gc.add_rows([5, 6, 7], [[NULL_BLOCK, 2, 3]])
    srcs = [np.full(4, v, dtype=np.uint8) for v in (1, 2, 3)]
    gc.to_kv(0, [5, 6, 7], srcs)
    gc.to_kv(1, [5, 6, 7], srcs)
    dst = [np.zeros(4, dtype=np.uint8) for _ in range(3)]
    host.from_kv(0, [5, 6, 7], dst)
    assert [int(d[0]) for d in dst] == [1, 2, 3]
    host.from_kv(1, [0, 2, 3], dst)
    assert [int(d[0]) for d in dst] == [0, 2, 3]  # the null block was not written
    with pytest.raises(ValueError, match="null block"):
        gc.from_kv(1, [5], dst[:1])
    assert gc.kv_views(1, [5, 6]) is None
    with pytest.raises(ValueError, match="do not match"):
        gc.add_rows([1, 2], [[3]])


def test_chunks_with_a_null_block_in_any_group_are_not_saved() -> None:
    from lw_vllm.hybrid.group_blocks import GroupBlocks
    from lw_vllm.request.request_state import ReqState

    gb = GroupBlocks(1, [0])
    st = ReqState(req=SimpleNamespace(request_id="r"))
    gb.set(st, ([NULL_BLOCK, NULL_BLOCK, 7, 8], [1, 2, 3, 4]))
    gb.add(st, ([NULL_BLOCK, 9], [5, 6]))
    assert st.block_ids == [1, 2, 3, 4, 5, 6] and st.more_blocks == [[0, 0, 7, 8, 0, 9]]
    assert gb.savable_runs(st, 0, 6) == [(2, 4), (5, 6)]
    x = gb.xfer(st, [bytes([i]) for i in range(6)], 2, 4)
    assert x.block_ids == [3, 4] and x.more == [[7, 8]] and x.hashes == [b"\x02", b"\x03"]
    dense = ReqState(req=SimpleNamespace(request_id="d"))
    GroupBlocks(0, []).set(dense, ([4, 5, 6],))
    assert GroupBlocks.savable_runs(dense, 1, 3) == [(1, 3)] and dense.more_blocks == []


def test_the_receiver_reads_no_bytes_for_blocks_outside_the_window() -> None:
    from lw_core.plan import ObjectLayout
    from lw_vllm.pd.stream_recv import _read_layer

    class Backend:
        def __init__(self) -> None:
            self.read_handles: list[int] = []

        def read(self, handles: list, offs: list, dsts: list) -> None:
            for h, d in zip(handles, dsts):
                self.read_handles.append(h)
                np.asarray(d)[...] = h

    host = HostCopier.allocate(2, 8, 4, fill=0)
    gc = GroupCopier(host, [-1, 0])
    gc.add_rows([5, 6, 7], [[NULL_BLOCK, NULL_BLOCK, 3]])
    be = Backend()
    layout = ObjectLayout((4, 4))
    assert _read_layer(be, gc, layout, 1, [10, 11, 12], [5, 6, 7]) == (3, 4)
    assert be.read_handles == [12]  # only the chunk inside the window
    assert _read_layer(be, gc, layout, 0, [10, 11, 12], [5, 6, 7]) == (3, 12)
    assert be.read_handles == [12, 10, 11, 12]


def test_streaming_pd_of_a_recurrent_state_model_starts_and_ends_its_streamed_hits_at_a_state(tmp_path) -> None:
    """A state hybrid streams too (tests/pd/test_pd_streaming_gdn.py): pd_streaming starts, and the
    coordinator knows a streamed hit must end where the prefiller is handed a state (the chunks
    stream per layer, the state lands last: tests/pd/test_pd_streaming_state.py)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")
    import torch

    from lw_core.config import parse_config
    from lw_vllm.scheduler.scheduler_side import SchedulerSide

    state = MambaSpec(block_size=256, page_size_bytes=64, mamba_cache_mode="align", num_speculative_blocks=0,
                      shapes=((2, 3),), dtypes=(torch.float32,))
    kc = SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=state, layer_names=["m.layers.0.mixer"]),
        SimpleNamespace(kv_cache_spec=FullAttentionSpec(block_size=256, page_size_bytes=64),
                        layer_names=["m.layers.1.attn"])])
    vc = SimpleNamespace(
        model_config=SimpleNamespace(model="tiny-gdn", dtype="bfloat16", use_mla=False, hf_config=SimpleNamespace()),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto", enable_prefix_caching=True, mamba_cache_mode="align"),
        scheduler_config=SimpleNamespace(async_scheduling=False))
    cfg = parse_config({"pd_streaming": True, "embedded_path": str(tmp_path / "pool"),
                        "embedded_capacity_bytes": 1 << 20})
    side = SchedulerSide(vc, kc, cfg, "kv_consumer")
    try:
        assert not side.inert and side.states is not None and side.pd.states
    finally:
        side.shutdown()
