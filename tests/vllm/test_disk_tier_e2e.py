"""The embedded pool's disk tier on real vLLM (CPU): a DRAM pool holds about thirty of the tiny
models' chunks (20 chunks per prompt), so saving two more long prompts evicts the
first prompt's chunks from DRAM and the tier writes them to disk. After a "restart" (the next engine opens a new, empty DRAM
pool over the same disk directory) the first prompt is a pool hit served from disk, with the saver's
greedy output, for GQA and MLA, layerwise and bulk. Then vLLM's prefix-cache reset with the
connector's cache (the connector's ``reset_cache``) removes the model's objects from DRAM and disk:
the same prompt is a miss, computed with the same output, and no file of the model is left."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lw_dev.harness import assert_same_greedy, pool_dir, random_tokens, run_engine

pytestmark = pytest.mark.slow

CHUNKS = 20  # full chunks per prompt


# DRAM for about 30 chunks: GQA's are 64 KiB (32 tokens), MLA's 144 KiB (16 tokens, the CPU MLA
# backend's block, of 576 latent floats a token).
@pytest.mark.parametrize("model, layerwise, block, dram_bytes", [("gqa", True, 32, 2 << 20),
                                                                 ("mla", False, 16, 9 << 19)])
def test_chunks_evicted_to_disk_are_hits_after_a_restart(tmp_path: Path, model: str, layerwise: bool, block: int,
                                                         dram_bytes: int) -> None:
    p1, p2, p3 = (random_tokens(seed, CHUNKS * block + 5) for seed in (51, 52, 53))
    disk = str(tmp_path / "disk-tier")

    def job(dram: str, phases: list) -> dict:
        return {
            "model": model, "max_tokens": 6, "max_model_len": 1024, "phases": phases,
            "engine": {"enable_prefix_caching": False, "block_size": block},
            "extra": {"embedded_path": dram, "embedded_capacity_bytes": dram_bytes, "use_layerwise": layerwise,
                      "embedded_disk_path": disk, "embedded_disk_capacity_bytes": 64 << 20},
        }

    first, second = pool_dir(), pool_dir()
    try:
        saved = run_engine(job(first, [[p1], [p2], [p3]]))["phases"]
        ref = saved[0]["outputs"][0]
        assert ref["stats"]["saved_chunks"] == CHUNKS, ref["stats"]
        from lw_core.backends.embedded.disk_format import SUFFIX

        files = [p for p in Path(disk).iterdir() if p.name.endswith(SUFFIX)]
        assert len(files) >= CHUNKS, sorted(p.name for p in Path(disk).iterdir())  # P1's chunks went to disk
        after = run_engine(job(second, [[p1], {"prompts": [p1], "reset": True}]))["phases"]
        left = [p.name for p in Path(disk).iterdir() if p.name.endswith(SUFFIX)]
    finally:
        for p in (first, second):
            shutil.rmtree(p, ignore_errors=True)
    hit = after[0]["outputs"][0]
    st = hit["stats"]
    n = CHUNKS * block
    assert st["promised_tokens"] == n and st["loaded_tokens"] == n and st["failed_blocks"] == 0, st
    assert_same_greedy(ref, hit)
    # The reset: the pool forgot the prompt (DRAM and disk), which is computed again, the same.
    assert after[1]["reset_ok"] is True
    miss = after[1]["outputs"][0]
    assert miss["stats"]["promised_tokens"] == 0 and miss["stats"]["saved_chunks"] == CHUNKS, miss["stats"]
    assert_same_greedy(ref, miss)
    assert left == []  # every file was this model's; the re-saved chunks stay in DRAM
