"""Background saves (kv_both, ``save_in_background``) on real vLLM (CPU), with a KV cache so small
that vLLM preempts requests while their saves may still run: the greedy output equals an engine
without the pool, every saving request is freed (the engine would stall on its blocks otherwise),
and a second pass of the same prompts hits what the background saves committed."""

from __future__ import annotations

import pytest

from lw_dev.harness import assert_same_greedy, random_tokens, run_engine

pytestmark = pytest.mark.slow

PROMPTS = [random_tokens(300 + i, 150 + 20 * i) for i in range(6)]
BLOCK = 32
MAX_TOKENS = 48
# 24 blocks of 32 tokens (64 KiB each): two or three requests fit at once, so decoding six preempts.
ENGINE = {"enable_prefix_caching": False, "block_size": BLOCK}
JOB = {"model": "gqa", "max_tokens": MAX_TOKENS, "engine": ENGINE, "max_model_len": 512,
       "kv_cache_memory_bytes": 24 * 64 << 10, "metrics": True}


def test_saves_off_the_step_survive_preemption_and_give_the_same_greedy_output(pool_path: str) -> None:
    ref = run_engine({**JOB, "extra": None, "phases": [PROMPTS]})["phases"][0]
    assert ref["metrics"].get("vllm:num_preemptions", 0) > 0, "the KV cache is not small enough to preempt"
    extra = {"embedded_path": pool_path, "embedded_capacity_bytes": 64 << 20, "use_layerwise": True}
    res = run_engine({**JOB, "extra": extra, "phases": [PROMPTS, PROMPTS]})
    first, second = res["phases"]
    assert first["metrics"]["vllm:num_preemptions"] > 0
    for r, g in zip(ref["outputs"], first["outputs"]):
        assert_same_greedy(r, g)
        assert g["stats"] is not None and g["stats"]["saved_chunks"] > 0  # freed late, then its line
    # The second pass finds each prompt's full chunks in the pool; a request preempted again finds
    # more on resuming (vLLM recomputes prompt + output, whose chunks the first pass saved too).
    for p, r, g in zip(PROMPTS, ref["outputs"], second["outputs"]):
        assert_same_greedy(r, g)
        st = g["stats"]
        assert st["promised_tokens"] >= (len(p) - 1) // BLOCK * BLOCK > 0 and st["promised_tokens"] % BLOCK == 0
        assert st["loaded_tokens"] == st["promised_tokens"]
    m = second["metrics"]
    assert m["vllm:lw_pool_saved_objects"] >= sum(len(p) // BLOCK for p in PROMPTS)
    assert m.get("vllm:lw_pool_load_failed_blocks", 0) == 0
