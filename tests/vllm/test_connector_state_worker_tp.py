"""The worker part turning a load saved at another TP size (``Xfer.src_tp``) into the pipeline's
ranged load: that size's key space and saver-rank tags, and the head split of this rank; a size
whose split cannot work fails the request's blocks (recomputed) instead of reading wrong bytes.
Cheap: no engine (outside vLLM's parallel groups a worker is rank 0 of TP 1)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

from lw_core.config import parse_config  # noqa: E402
from lw_core.tp_split import split_heads  # noqa: E402
from lw_vllm import pool  # noqa: E402
from lw_vllm.meta import Xfer  # noqa: E402
from lw_vllm.worker.worker_side import WorkerSide  # noqa: E402

PAGE = 2048  # one block of one layer at TP 1: 2 kv heads


def _worker(kv_heads: int | None = 2) -> WorkerSide:
    spec = SimpleNamespace(block_size=16, page_size_bytes=PAGE)
    kc = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])])
    mc = SimpleNamespace(model="tiny-test", dtype="float32", use_mla=False, hf_config=SimpleNamespace())
    if kv_heads is not None:
        mc.get_total_num_kv_heads = lambda: kv_heads
    # vLLM's CPU layout (head-major blocks); tests/vllm/test_kv_layouts.py covers the others.
    vc = SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto", kv_cache_layout="LBHNC"),
                         parallel_config=SimpleNamespace(tensor_parallel_size=1))
    return WorkerSide(vc, kc, parse_config({"backend": "embedded"}), "kv_both")


def test_own_tp_loads_its_own_objects() -> None:
    w = _worker()
    ld = w.plan_load(Xfer("r", [b"\x01" * 16], [3]))
    assert ld is not None and ld.split is None and ld.keys == w.keyspace.keys(w.tag, [b"\x01" * 16])


def test_saved_at_tp2_reads_both_saver_ranks_objects() -> None:
    w = _worker()
    hashes = [b"\x01" * 16, b"\x02" * 16]
    ld = w.plan_load(Xfer("r", hashes, [3, 4], src_tp=2))
    ks2 = pool.key_space(w.vllm_config, w.kv_cache_config, w.cfg, 2)
    assert ks2 != w.keyspace
    assert ld is not None and ld.split == split_heads(2, 2, 1, 0, tokens=16)
    assert ld.keys == ks2.keys("tp0of2-pp0of1", hashes) and ld.more_keys == [ks2.keys("tp1of2-pp0of1", hashes)]
    assert ld.block_ids == [3, 4]


@pytest.mark.parametrize("kv_heads,src_tp", [(2, 4), (None, 2)], ids=["indivisible", "heads-unknown"])
def test_a_split_that_cannot_work_fails_the_blocks(kv_heads, src_tp, caplog) -> None:
    w = _worker(kv_heads)
    assert w.plan_load(Xfer("r", [b"\x01" * 16], [7], src_tp=src_tp)) is None
    assert w.take_load_errors() == {7}
    rep = w.take_report()
    assert rep is not None and rep.failed == {"r": 1}
    assert any(f"tensor_parallel_size={src_tp}" in r.getMessage() for r in caplog.records)
