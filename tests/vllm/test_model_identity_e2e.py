"""The model's identity, not its path, on real engines (CPU): the same weights copied to a second
path (another host's layout) hit what the first path saved; other weights written over the first
path do not, and their output stays their own. Three engine processes, ~1.5 min on 2 cores."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lw_bench import models
from lw_dev.harness import assert_same_greedy, random_tokens, run_engine

pytestmark = pytest.mark.slow

PROMPT = random_tokens(21, 100)  # 3 full chunks of 32 and a tail
ENGINE = {"enable_prefix_caching": False, "block_size": 32}


def _job(model: Path, pool_path: str) -> dict:
    return {"model": str(model), "max_tokens": 8, "phases": [[PROMPT]], "engine": ENGINE,
            "extra": {"embedded_path": pool_path, "embedded_capacity_bytes": 64 << 20}}


def test_copy_at_another_path_hits_other_weights_at_the_same_path_miss(tmp_path: Path, pool_path: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LW_POOL_CACHE_DIR", str(tmp_path / "digests"))
    host_a = tmp_path / "host-a" / "model"
    host_b = tmp_path / "host-b" / "models" / "same-weights"
    shutil.copytree(models.gqa_model(), host_a)
    shutil.copytree(models.gqa_model(), host_b)

    a = run_engine(_job(host_a, pool_path))["phases"][0]["outputs"][0]
    assert a["stats"]["saved_chunks"] == len(PROMPT) // 32
    b = run_engine(_job(host_b, pool_path))["phases"][0]["outputs"][0]
    assert b["stats"]["loaded_tokens"] == b["stats"]["promised_tokens"] == len(PROMPT) // 32 * 32
    assert_same_greedy(a, b)

    # New weights written over host A's path (same shapes, same file names and sizes).
    other = models.gqa_model(seed=1)
    assert (other / "model.safetensors").stat().st_size == (host_a / "model.safetensors").stat().st_size
    shutil.copy2(other / "model.safetensors", host_a / "model.safetensors")
    c = run_engine(_job(host_a, pool_path))["phases"][0]["outputs"][0]
    assert c["stats"]["promised_tokens"] == 0, "other weights must not load the first model's KV"
    ref = run_engine({**_job(other, pool_path), "extra": None})["phases"][0]["outputs"][0]
    assert_same_greedy(ref, c)
    assert c["tokens"] != a["tokens"]  # the test would not notice a wrong hit otherwise
