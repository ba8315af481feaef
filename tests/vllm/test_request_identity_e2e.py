"""Pool keys separate what token ids do not say, on real vLLM (CPU): ``prompt_embeds`` prompts (whose
token ids vLLM sets to 0) and LoRA adapters (by content, not name).

One engine, vLLM's own prefix cache off, so every hit is the pool's:
phase 0 saves an embeddings prompt E1 and a prompt P under adapter "x" -> A;
phase 1 sends E2 (other embeddings, same length) and P under "x" re-pointed at B: no hit may
happen (before the fix both hit the phase-0 objects and loaded another prompt's or adapter's KV);
phase 2 sends E1 and P under "x" -> A again: both hit every full chunk, with phase 0's output.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lw_dev.harness import assert_same_greedy, random_tokens, run_engine

pytestmark = pytest.mark.slow

BLOCK = 32
N = 4 * BLOCK + 5  # four full chunks and a partial one


def test_embeds_and_lora_identity_separate_keys(pool_path: str, tmp_path: Path) -> None:
    from lw_bench.models import lora_adapter

    a = str(lora_adapter(tmp_path / "adapter-a", seed=1))
    b = str(lora_adapter(tmp_path / "adapter-b", seed=2))
    p = random_tokens(11, N)
    e1, e2 = {"embeds": 1, "n": N}, {"embeds": 2, "n": N}
    x_a, x_b = {"ids": p, "lora": {"name": "x", "id": 1, "path": a}}, {"ids": p, "lora": {"name": "x", "id": 2, "path": b}}
    job = {
        "model": "gqa", "max_tokens": 6,
        "engine": {"enable_prefix_caching": False, "block_size": BLOCK, "enable_prompt_embeds": True,
                   "enable_lora": True, "max_lora_rank": 8, "max_loras": 2},
        "extra": {"embedded_path": pool_path, "embedded_capacity_bytes": 64 << 20, "use_layerwise": True},
        # One kind per phase: vLLM 0.32's CPU LoRA path fails on a batch mixing embeddings and
        # token-id prompts ("einsum(): subscript b has size 266 ... 133").
        "phases": [[e1], [x_a], [e2], [x_b], [e1], [x_a]],
    }
    res = run_engine(job)
    outs = [ph["outputs"][0] for ph in res["phases"]]
    first, other, again = outs[0:2], outs[2:4], outs[4:6]
    for o in first:
        assert o["stats"]["loaded_tokens"] == 0 and o["stats"]["saved_chunks"] == 4, o["stats"]
    for o in other:  # other embeddings, other adapter under the same name: nothing of phase 0 fits
        assert o["stats"]["promised_tokens"] == 0 and o["stats"]["loaded_tokens"] == 0, o["stats"]
    for ref, o in zip(first, again):
        assert o["stats"]["loaded_tokens"] == 4 * BLOCK and o["stats"]["failed_blocks"] == 0, o["stats"]
        assert_same_greedy(ref, o)
