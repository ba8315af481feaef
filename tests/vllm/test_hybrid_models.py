"""Hybrid models on real vLLM (CPU) with its hybrid KV cache manager on (the connector is
``SupportsHMA``); tiny random models built locally (lw_bench.models).

* Sliding window + full attention (Gemma 3 style, window 48 tokens, 32-token blocks): one engine
  saves two prompts; a fresh process loads them from the pool (asynchronously: vLLM takes a hybrid's
  load failures per request only) with the saver's greedy output; its windowed layers read only the
  blocks inside the window at the hit boundary from the pool (the rest are vLLM's null blocks). Then a
  read that fails on one layer makes vLLM recompute the request whole, with the same output.
* Gated delta-net + full attention (Qwen3-Next style, bf16): used to fail at start-up with the
  connector ("Failed to promote local KV cache specs to one unified type"). With prefix caching off
  vLLM keeps no block-aligned states, so the pool is inert for it: same output when sent again,
  nothing saved or loaded. With prefix caching on its states are saved and restored
  (test_hybrid_state).
"""

from __future__ import annotations

import pytest

from lw_bench.models import SWA_SPEC
from lw_dev.harness import assert_same_greedy, random_tokens, run_engine, run_faulty

pytestmark = pytest.mark.slow

BLOCK = 32  # vLLM raises the Gemma 3 model's 16-token blocks to 32 under HMA on this build
P1 = random_tokens(31, 6 * BLOCK + 8)  # six full chunks: the window (48) needs chunks 4 and 5 only
P2 = random_tokens(32, 2 * BLOCK + 26)


def _swa_job(pool_path: str, phases: list) -> dict:
    return {
        "model": "swa", "max_tokens": 6, "max_model_len": 1024, "phases": phases,
        "engine": {"enable_prefix_caching": False, "block_size": 16},
        "extra": {"embedded_path": pool_path, "embedded_capacity_bytes": 64 << 20, "use_layerwise": True},
    }


def test_sliding_window_hybrid_saves_and_a_fresh_engine_loads_with_the_same_output(pool_path: str) -> None:
    saved = run_engine(_swa_job(pool_path, [[P1, P2]]))["phases"][0]["outputs"]
    for o, chunks in zip(saved, (6, 2)):
        assert o["stats"]["loaded_tokens"] == 0 and o["stats"]["saved_chunks"] == chunks, o["stats"]

    res, log = run_faulty(_swa_job(pool_path, [
        {"prompts": [P1, P2]},
        {"prompts": [P1], "rules": [{"op": "read", "layer": 1, "action": "fail"}]},
    ]))
    hit, failed = res["phases"][0]["outputs"], res["phases"][1]["outputs"][0]
    # A block of one layer: K and V, 2 kv heads of 32 in float32, 32 tokens.
    page = 2 * SWA_SPEC["num_key_value_heads"] * SWA_SPEC["head_dim"] * 4 * BLOCK
    # P1's hit ends at token 192: the windowed layers (0 and 2) need chunks 4 and 5 only; P2's
    # ends at 64, so they need both its chunks. The full layers (1 and 3) need every chunk.
    for ref, o, chunks, windowed in zip(saved, hit, (6, 2), (2, 2)):
        st = o["stats"]
        assert st["promised_tokens"] == chunks * BLOCK and st["loaded_tokens"] == chunks * BLOCK, st
        assert st["failed_blocks"] == 0, st
        assert st["loaded_bytes"] == (2 * chunks + 2 * windowed) * page, st
        assert_same_greedy(ref, o)
    # The failed read ends the receive: vLLM recomputes the whole prompt and answers the same.
    assert res["phases"][1]["rule_hits"][0] >= 1
    assert failed["stats"]["failed_blocks"] > 0, failed["stats"]
    assert_same_greedy(saved[0], failed)
    assert "Traceback" not in log


def test_linear_attention_hybrid_runs_with_the_pool_inert(pool_path: str) -> None:
    job = {
        "model": "gdn", "max_tokens": 6, "max_model_len": 1024, "phases": [[P1, P2], [P1, P2]],
        "engine": {"enable_prefix_caching": False},
        "extra": {"embedded_path": pool_path, "embedded_capacity_bytes": 64 << 20, "use_layerwise": True},
    }
    first, again = (ph["outputs"] for ph in run_engine(job)["phases"])
    for ref, o in zip(first, again):
        for st in (ref["stats"], o["stats"]):
            assert st["saved_chunks"] == 0 and st["promised_tokens"] == 0 and st["loaded_tokens"] == 0, st
        assert_same_greedy(ref, o)
