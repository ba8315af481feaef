"""LayerwiseStoreConnector on real vLLM (CPU): a second, fresh engine process that loads prefixes
from the pool gives the same greedy output as an engine without any connector.

Every engine is its own process (``run_engine``): engine A saves, engine B (another process, as a
second instance would be) looks up and loads. Tiny float32 models: a Llama-style GQA model (block
32) and a DeepSeek-V2-style MLA model (vLLM's CPU MLA forces block 16; it also disables vLLM's own
prefix cache, so the pool is the only source of hits there).
"""

from __future__ import annotations

import pytest

from lw_dev.harness import EngineFailed, assert_same_greedy, random_tokens, run_engine

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
BLOCK = {"gqa": 32, "mla": 16}


_toks = random_tokens


P1 = _toks(1, 167)  # several full chunks and a partial tail
P2 = P1[:64] + _toks(2, 50)  # shares only its first 64 tokens with P1 (partial hit)
P3 = _toks(3, 12)  # shorter than a chunk
P4 = _toks(4, 100)  # never saved: a miss
MIXED = [P1, P2, P3, P4]
LONG = _toks(5, 300)  # chunked prefill (max_num_batched_tokens 64)
EVICT = [_toks(100 + i, 130) for i in range(8)]  # 8 x 4 chunks = 32 objects of 64 KiB


def _engine_kw(model: str, **kw: object) -> dict:
    # GQA: turn off vLLM's local prefix cache so that every hit in engine B comes from the pool
    # and "loaded == promised == expected" is exact (MLA has none on CPU anyway).
    e = {"enable_prefix_caching": False}
    if model == "gqa":
        e["block_size"] = 32
    e.update(kw)
    return e


@pytest.fixture(scope="module")
def baseline():
    """Greedy output without any connector, per model (one engine each, several phases)."""
    cache: dict[str, list] = {}

    def get(model: str) -> list:
        if model not in cache:
            phases = [MIXED, [LONG], EVICT] if model == "gqa" else [MIXED]
            res = run_engine({"model": model, "max_tokens": MAX_TOKENS, "extra": None, "phases": phases,
                              "engine": _engine_kw(model)})
            cache[model] = [ph["outputs"] for ph in res["phases"]]
        return cache[model]

    return get


def _extra(pool_path: str, layerwise: bool, **kw: object) -> dict:
    e = {"embedded_path": pool_path, "embedded_capacity_bytes": 64 << 20, "use_layerwise": layerwise}
    e.update(kw)
    return e


@pytest.mark.parametrize("model", ["gqa", "mla"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["bulk", "layerwise"])
def test_pool_hits_give_the_same_greedy_output(model: str, layerwise: bool, pool_path: str, baseline) -> None:
    bs = BLOCK[model]
    ref = baseline(model)[0]
    job_a = {"model": model, "max_tokens": MAX_TOKENS, "phases": [[P1]], "engine": _engine_kw(model),
             "extra": _extra(pool_path, layerwise)}
    if model == "gqa" and not layerwise:
        job_a["kv_role"] = "kv_producer"  # saves, never loads
    if model == "mla" and layerwise:
        # The seed's JSON: the alias name and use_layerwise, without kv_connector_module_path.
        job_a["connector"] = "AscendStoreConnector"
        job_a["extra"]["backend"] = "embedded"
    a = run_engine(job_a)["phases"][0]["outputs"][0]
    assert a["stats"]["promised_tokens"] == 0 and a["stats"]["saved_chunks"] == len(P1) // bs
    assert_same_greedy(ref[0], a)

    b = run_engine({"model": model, "max_tokens": MAX_TOKENS, "phases": [MIXED], "engine": _engine_kw(model),
                    "extra": _extra(pool_path, layerwise)})["phases"][0]["outputs"]
    expected_hits = [(len(P1) - 1) // bs * bs, 64, 0, 0]
    for i, (r, g, hit) in enumerate(zip(ref, b, expected_hits)):
        assert_same_greedy(r, g)
        st = g["stats"]
        assert st["promised_tokens"] == hit, f"prompt {i}: lookup promised {st['promised_tokens']}, expected {hit}"
        assert st["loaded_tokens"] == st["promised_tokens"] and st["failed_blocks"] == 0, st
    assert b[0]["stats"]["loaded_tokens"] > 0


@pytest.fixture(scope="module")
def long_pool(tmp_path_factory: pytest.TempPathFactory):
    """Engine A saves LONG while prefilling it in chunks of 64 tokens (saves across steps)."""
    import os
    import shutil
    import uuid

    path = f"/dev/shm/lw-test-long-{uuid.uuid4().hex[:8]}" if os.access("/dev/shm", os.W_OK) else str(
        tmp_path_factory.mktemp("long-pool"))
    a = run_engine({"model": "gqa", "max_tokens": MAX_TOKENS, "phases": [[LONG]],
                    "engine": _engine_kw("gqa", max_num_batched_tokens=64, max_model_len=512),
                    "extra": _extra(path, True)})
    yield path, a["phases"][0]["outputs"][0]
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_layerwise_depths_with_chunked_prefill(depth: int, long_pool, baseline) -> None:
    path, a = long_pool
    ref = baseline("gqa")[1][0]
    assert a["stats"]["saved_chunks"] == len(LONG) // 32
    assert_same_greedy(ref, a)
    b = run_engine({"model": "gqa", "max_tokens": MAX_TOKENS, "phases": [[LONG]],
                    "engine": _engine_kw("gqa", max_num_batched_tokens=64, max_model_len=512),
                    "extra": _extra(path, True, layerwise_prefetch_layers=depth, layerwise_max_transfer_blocks=3)})
    g = b["phases"][0]["outputs"][0]
    assert_same_greedy(ref, g)
    assert g["stats"]["promised_tokens"] == (len(LONG) - 1) // 32 * 32
    assert g["stats"]["loaded_tokens"] == g["stats"]["promised_tokens"]


def test_eviction_under_pressure_keeps_output_correct(pool_path: str, baseline) -> None:
    ref = baseline("gqa")[2]
    # 1 MiB holds 16 objects of 64 KiB (4 layers x 16 KiB); the prompts make 32.
    extra = _extra(pool_path, True, embedded_capacity_bytes=1 << 20)
    job = {"model": "gqa", "max_tokens": MAX_TOKENS, "engine": _engine_kw("gqa"), "extra": extra,
           "phases": [[p] for p in EVICT]}
    a = run_engine(job)
    # B runs the prompts newest first: in A's order each miss would evict the next prompt's
    # chunks before it is looked up (LRU flooding) and nothing could hit.
    b = run_engine({**job, "phases": job["phases"][::-1]})
    b["phases"] = b["phases"][::-1]
    promised = []
    for ph_a, ph_b, r in zip(a["phases"], b["phases"], ref):
        ga, gb = ph_a["outputs"][0], ph_b["outputs"][0]
        assert_same_greedy(r, ga)
        assert_same_greedy(r, gb)
        assert gb["stats"]["loaded_tokens"] == gb["stats"]["promised_tokens"]
        promised.append(gb["stats"]["promised_tokens"])
    full = (130 - 1) // 32 * 32
    assert sum(promised) > 0, "nothing survived in the pool"
    assert min(promised) < full, f"no prompt lost chunks to eviction: {promised}"


@pytest.mark.parametrize(
    "extra,needle",
    [({"layerwise_prefetch_layers": 0}, "layerwise_prefetch_layers"), ({"use_layerwize": True}, "use_layerwize")],
    ids=["bad-value", "unknown-key"],
)
def test_bad_extra_config_fails_start_up_naming_the_key(extra: dict, needle: str, pool_path: str) -> None:
    with pytest.raises(EngineFailed) as ei:
        run_engine({"model": "gqa", "max_tokens": 1, "phases": [[P3]], "engine": _engine_kw("gqa"),
                    "extra": {"embedded_path": pool_path, **extra}})
    assert "kv_connector_extra_config" in ei.value.output and needle in ei.value.output
