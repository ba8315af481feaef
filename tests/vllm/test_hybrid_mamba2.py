"""Mamba2 hybrids on real vLLM (CPU): a Granite-4-style model (Mamba2 layers with full attention
every other layer, float32) with prefix caching on (vLLM's "align" state mode).

vLLM 0.32's CPU build fails every such prefill (``IndexError`` in ``mamba_mixer2``: its CPU SSD
scan returns no per-chunk states, and the state checkpoint store is a Triton kernel);
``lw_vllm.cpu_fixes.mamba2_fix`` supplies both. Then the pool serves Mamba2 hybrids as it serves gated
delta-net ones (state_plan, state_store): each retained chunk boundary's conv and SSM states are
saved with the chunks, and a fresh process restores the longest prefix with both.

Engines: a reference without pool or prefix caching; a saver (prefix caching on, chunked prefill
of 512 tokens, states retained every block); a loader over the saver's pool; and, on an affected
vLLM, one without the fix, which still fails. The saver and the loader run twice, with the SSM
state cache forced to float32 and to bf16 (``mamba_ssm_cache_dtype``), each asserting from its
engine record which dtype ran. With AVX512-BF16, vLLM's CPU platform keeps an explicit bf16 only
for a model whose config lists ``linear_attention`` layers (its test for gated delta-net, which this
model passes: transformers names Granite 4's Mamba layers so) and resets others to float32; should
it reset this one, the bf16 run is skipped, saying so.
"""

from __future__ import annotations

import pytest

from lw_bench.models import MAMBA2_SPEC
from lw_dev.harness import EngineFailed, assert_same_greedy, random_tokens, run_engine, run_faulty
from lw_dev.state_sizes import mamba2_state_nbytes, ssm_dtype

pytestmark = pytest.mark.slow

BLOCK = 128  # asked for (vLLM CPU's default); the tests take the block the engine reports
P = random_tokens(61, 1300)
Q = P[:900] + random_tokens(62, 400)
S = random_tokens(63, 600)  # a 512-token hit
ENGINE = {"enable_prefix_caching": True, "max_num_batched_tokens": 512, "block_size": BLOCK,
          "prefix_cache_retention_interval": BLOCK}


def _job(phases: list, *, pool_path: str | None, engine: dict | None = None) -> dict:
    extra = None if pool_path is None else {
        "embedded_path": pool_path, "embedded_capacity_bytes": 64 << 20, "use_layerwise": True}
    return {"model": "mamba2", "max_tokens": 6, "max_model_len": 2048, "phases": phases,
            "engine": ENGINE if engine is None else engine, "extra": extra}


def test_mamba2_prefix_caching_runs_on_cpu_with_the_fix_and_matches_no_caching() -> None:
    """With the fix, a Mamba2 prefill with prefix caching runs, and a repeated prompt hits vLLM's
    own prefix cache (its Mamba2 state restored from the block checkpoint) with the log-probs of an
    engine without prefix caching; without it, the prefill still fails on this vLLM."""
    ref = run_engine(_job([[P]], pool_path=None, engine={"enable_prefix_caching": False, "max_num_batched_tokens": 512}))
    got = run_engine(_job([[P], [P]], pool_path=None))
    first, again = got["phases"][0]["outputs"][0], got["phases"][1]["outputs"][0]
    assert again["num_cached_tokens"] >= 1024, again["num_cached_tokens"]
    for o in (first, again):
        assert_same_greedy(ref["phases"][0]["outputs"][0], o, lp_tol=1e-4)

    import vllm

    from lw_vllm.cpu_fixes import mamba2_fix

    if vllm.__version__.startswith(mamba2_fix.AFFECTED_VERSIONS):
        with pytest.raises(EngineFailed, match="IndexError"):
            run_engine(_job([[P]], pool_path=None), env={"LW_VLLM_MAMBA2_FIX": "0"})


@pytest.mark.parametrize("ssm", ["float32", "bfloat16"])
def test_mamba2_state_saved_and_restored_by_a_fresh_engine(pool_path: str, ssm: str) -> None:
    """The saved prompt hits up to its last boundary (1280) with the saver's greedy output; a
    prompt sharing 900 tokens hits its last whole block (896: states are retained every block);
    a state that fails to load is recomputed whole. Each hit moves the attention layers' chunks
    and one state object of the dtype that ran."""
    engine = {**ENGINE, "mamba_ssm_cache_dtype": ssm}
    saver = run_engine(_job([[P, {"ids": Q, "salt": "ref"}, S]], pool_path=pool_path, engine=engine))
    ran = ssm_dtype(saver["engine"])
    if ran != ssm:
        assert ssm != "float32" and ran == "float32", saver["engine"]
        pytest.skip(f"vLLM's CPU platform ran this Mamba2 SSM cache in {ran}, not the {ssm} asked for (on CPUs "
                    "with AVX512-BF16 it keeps an explicit bf16 only for models with linear_attention layers)")
    state = mamba2_state_nbytes(ssm_dtype=ssm)
    assert saver["engine"]["state_bytes"] == state, saver["engine"]
    block = saver["engine"]["block_size"]
    # One block of one attention layer: K and V, 2 kv heads of 32 (hidden 128 / 4 heads), float32.
    page = 2 * MAMBA2_SPEC["num_key_value_heads"] * (MAMBA2_SPEC["hidden_size"] // MAMBA2_SPEC["num_attention_heads"]) \
        * 4 * block
    ref = saver["phases"][0]["outputs"]
    assert ref[0]["stats"]["saved_chunks"] == 1300 // block, ref[0]["stats"]

    res, log = run_faulty(_job([
        {"prompts": [P, Q]},
        {"prompts": [S], "rules": [{"op": "open", "action": "fail", "times": 1}]},
    ], pool_path=pool_path, engine=engine))
    assert ssm_dtype(res["engine"]) == ssm, res["engine"]
    got = res["phases"][0]["outputs"]
    for o, hit in zip(got, (1280, 896 // block * block)):
        st = o["stats"]
        assert st["promised_tokens"] == hit and st["loaded_tokens"] == hit and st["failed_blocks"] == 0, st
        assert st["loaded_bytes"] == 2 * (hit // block) * page + state, st
    for r, o in zip(ref, got):
        assert_same_greedy(r, o, lp_tol=1e-4)

    failed = res["phases"][1]["outputs"][0]
    assert res["phases"][1]["rule_hits"] == [1]
    assert failed["stats"]["promised_tokens"] == 512 and failed["stats"]["loaded_tokens"] == 0, failed["stats"]
    assert failed["stats"]["failed_blocks"] > 0, failed["stats"]
    assert_same_greedy(ref[2], failed, lp_tol=1e-4)
    assert "Traceback" not in log
