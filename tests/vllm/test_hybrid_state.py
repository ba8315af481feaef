"""Recurrent-state hybrids on real vLLM (CPU): a gated delta-net model (Qwen3-Next style, bf16)
with prefix caching on (vLLM's "align" state mode) saves, besides its attention chunks, the state
vLLM hands off at each retained chunk boundary (state_plan, state_store); a fresh process over the
same pool restores the longest prefix whose attention chunks and boundary state are both there.

Run once with the recurrent (SSM) state cache forced to float32 and once to bf16
(``mamba_ssm_cache_dtype``): left auto, vLLM's CPU platform picks one by the CPU (float32 with
AVX512-BF16, the model's bf16 without: lw_dev.state_sizes), so forcing each covers both on any
machine; each run asserts from its engine record that its dtype ran, and sizes the state with it.
Both runs ask for blocks of 256 tokens (vLLM would pick 128 for a bf16 state) and share one pool,
so their attention chunks share keys and only the state keys keep their states apart: each saver
first computes a probe prompt the other run's saver may have left in the pool, chunks and states,
and must not hit it (its chunks are found, the other dtype's states are not its own).

Per run, one saver engine (chunked prefill of 512 tokens, states retained every block: boundaries
512, 1024 and 1280 of a 1300-token prompt) and one loader engine, each running one prompt at a
time. The saver also gives the references: a prompt again, or after one sharing its prefix, is a
hit in vLLM's own prefix cache of the length the loader's pool hit has, which a restored state
matches bit for bit (on CPUs without AVX512-BF16 such a hit differs from a prompt computed whole
by ~1e-4, so that is no reference for a hit). In the loader:

* the saved prompt hits up to its last boundary (1280 tokens), with the saver's output for it;
* a prompt sharing 900 tokens finds the attention chunks up to 768 but no state past 512: its
  hit is shorter (512, the last boundary with a state), with the output it gets without the pool;
* a prompt sharing 300 tokens finds one chunk and no state at 256: no hit, computed whole;
* a state that fails to load (the pool's ``open`` fails once) fails the request's load: vLLM
  recomputes it whole, with the saver's output;
* a state read that takes a second (``open`` stalls; it runs beside the receive of the chunks,
  off the forward thread: state_loads) holds the request until it landed: a full hit, the
  saver's output.

Each run's prompts carry its own ``cache_salt`` (the dtype's name; the references for the other
prompts another), so its chunks are its own; only the probe is shared.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from lw_bench.models import GDN_SPEC
from lw_dev.harness import assert_same_greedy, pool_dir, random_tokens, run_engine, run_faulty
from lw_dev.state_sizes import gdn_state_nbytes, ssm_dtype

pytestmark = pytest.mark.slow

SSM_DTYPES = ("float32", "bfloat16")
ASKED_BLOCK = 256
P = random_tokens(51, 1300)
Q = P[:900] + random_tokens(52, 400)
R = P[:300] + random_tokens(53, 700)
S = random_tokens(54, 600)  # one state, at 512
T = random_tokens(55, 600)  # one state, at 512
PROBE = random_tokens(56, 600)  # both runs' savers compute it first, unsalted
_filled: set[str] = set()  # the runs whose saver already computed the probe into the shared pool


@pytest.fixture(scope="module")
def shared_pool() -> Iterator[str]:
    p = pool_dir("lw-test-pool")
    yield p
    shutil.rmtree(p, ignore_errors=True)


def _job(pool_path: str, phases: list, ssm: str) -> dict:
    return {
        "model": "gdn", "max_tokens": 6, "max_model_len": 2048, "phases": phases,
        "engine": {"enable_prefix_caching": True, "max_num_batched_tokens": 512, "block_size": ASKED_BLOCK,
                   "prefix_cache_retention_interval": ASKED_BLOCK, "mamba_ssm_cache_dtype": ssm},
        "extra": {"embedded_path": pool_path, "embedded_capacity_bytes": 64 << 20, "use_layerwise": True},
    }


@pytest.mark.parametrize("ssm", SSM_DTYPES)
def test_gdn_state_saved_and_restored_by_a_fresh_engine(shared_pool: str, ssm: str) -> None:
    def own(p: list[int]) -> dict:
        return {"ids": p, "salt": ssm}

    def ref_of(p: list[int]) -> dict:
        return {"ids": p, "salt": f"{ssm}-ref"}

    # The references take the path the loader's requests take, in vLLM's own prefix cache: a hit
    # of the same length (the state and the chunks restored, the rest computed), or none; one
    # prompt per phase in both engines (a request alone, its prefill split at the same chunk ends).
    # The CPU build's kernels without AVX512-BF16 give a prefix-cache hit other log-probs than a
    # prompt computed whole (1.5e-4 here), and move them by ~1e-3 with the batch around a request:
    # a lost state's order of effect.
    prompts = [PROBE, own(P), own(P), ref_of(P), ref_of(Q), ref_of(R), own(S), own(T), own(T)]
    saver = run_engine(_job(shared_pool, [[p] for p in prompts], ssm))
    engine = saver["engine"]
    assert ssm_dtype(engine) == ssm, engine  # the forced dtype is the one that ran, on this CPU too
    state = gdn_state_nbytes(ssm_dtype=ssm)
    assert engine["state_bytes"] == state, engine
    block = engine["block_size"]
    # One block of one full-attention layer: K and V, 2 kv heads of 64 in bf16.
    page = 2 * GDN_SPEC["num_key_value_heads"] * GDN_SPEC["head_dim"] * 2 * block

    (probe,) = saver["phases"][0]["outputs"]
    assert probe["stats"]["promised_tokens"] == 0 and probe["stats"]["loaded_bytes"] == 0, probe["stats"]
    if _filled - {ssm}:  # the other dtype's saver computed it here: its chunks were found, unsaved
        assert probe["stats"]["saved_chunks"] == 0, probe["stats"]
    _filled.add(ssm)

    out = [ph["outputs"][0] for ph in saver["phases"]]
    assert out[1]["stats"]["saved_chunks"] == 1300 // block, out[1]["stats"]
    # P again (a 1280-token hit), Q after P (512: no state at 768), R (none), S computed, T again (512).
    ref = [out[2], out[4], out[5], out[6], out[8]]
    assert [o["num_cached_tokens"] for o in ref] == [1280, 512, 0, 0, 512], [o["num_cached_tokens"] for o in ref]

    # Only a state load calls the pool's open (chunks stream in through open_streaming).
    res, log = run_faulty(_job(shared_pool, [
        {"prompts": [own(P)]}, {"prompts": [own(Q)]}, {"prompts": [own(R)]},
        {"prompts": [own(S)], "rules": [{"op": "open", "action": "fail", "times": 1}]},
        # The state read takes a second: its chunks are in long before, and the request waits for it.
        {"prompts": [own(T)], "rules": [{"op": "open", "action": "stall", "seconds": 1.0, "times": 1}]},
    ], ssm), keep_pool=True)
    assert ssm_dtype(res["engine"]) == ssm, res["engine"]
    got = [ph["outputs"][0] for ph in res["phases"][:3]]
    for o, hit in zip(got, (1280, 512, 0)):
        st = o["stats"]
        assert st["promised_tokens"] == hit and st["loaded_tokens"] == hit and st["failed_blocks"] == 0, st
        # Both attention layers' chunks, and the state object at the hit's end.
        assert st["loaded_bytes"] == 2 * (hit // block) * page + (state if hit else 0), st
    # The connector's counters count the same: the chunk objects of both hits, 2 state objects.
    chunks = (1280 + 512) // block
    m = [ph["metrics"] for ph in res["phases"][2:]]  # cumulative: after P, Q and R; after S; after T
    assert m[0]["vllm:lw_pool_loaded_objects"] == chunks + 2, m[0]
    assert m[0]["vllm:lw_pool_loaded_bytes"] == chunks * 2 * page + 2 * state, m[0]
    # A lost state moves this tiny random model's log-probs by a few 1e-3 only (a zeroed one: 3.5e-3
    # at the second token), so the default tolerance would hardly see it; a restored state gives
    # the log-probs of vLLM's own prefix-cache hit in the saver, bit for bit.
    for r, o in zip(ref, got):
        assert_same_greedy(r, o, lp_tol=1e-4)

    failed = res["phases"][3]["outputs"][0]
    assert res["phases"][3]["rule_hits"] == [1]
    assert failed["stats"]["promised_tokens"] == 512 and failed["stats"]["loaded_tokens"] == 0, failed["stats"]
    assert failed["stats"]["failed_blocks"] > 0, failed["stats"]
    assert_same_greedy(ref[3], failed, lp_tol=1e-4)
    # The state that did not land counts nowhere; the chunks read beside it before their receive
    # was stopped do (whole layers of at most its 512 tokens' chunks), in the request and in the counters.
    moved = failed["stats"]["loaded_bytes"]
    assert moved % page == 0 and moved <= 2 * (512 // block) * page, failed["stats"]
    assert m[1]["vllm:lw_pool_loaded_bytes"] - m[0]["vllm:lw_pool_loaded_bytes"] == moved, m
    assert m[1]["vllm:lw_pool_loaded_objects"] - m[0]["vllm:lw_pool_loaded_objects"] <= 512 // block, m

    slow = res["phases"][4]["outputs"][0]
    assert res["phases"][4]["rule_hits"] == [1]
    st = slow["stats"]
    assert st["promised_tokens"] == st["loaded_tokens"] == 512 and st["failed_blocks"] == 0, st
    assert st["loaded_bytes"] == 2 * (512 // block) * page + state, st
    assert_same_greedy(ref[4], slow, lp_tol=1e-4)
    assert "Traceback" not in log
