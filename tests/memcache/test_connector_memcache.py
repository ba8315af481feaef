"""LayerwiseStoreConnector with ``"backend": "memcache"`` on real vLLM (CPU): a fresh engine process
that loads prefixes from a memcache pool gives the same greedy output as an engine without any
connector.

Engine A (one process) saves, then exits; engine B (a fresh process) looks up and loads. Both are
memcache clients of one MetaService started by the fixture, lending no memory themselves: the
pool's DRAM is lent by ``lw-memcache hold`` (``LocalMemcache(holder=True)``), as a long-lived
client would in a deployment, since objects vanish with the client whose memory holds them.
Engines, tiny models and the greedy oracle are lw_dev's, as in tests/vllm.
"""

from __future__ import annotations

import pytest
from mc_support import needs_memcache

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")

from lw_dev.harness import assert_same_greedy, random_tokens, run_engine  # noqa: E402

pytestmark = [needs_memcache, pytest.mark.slow]

MAX_TOKENS = 8
BLOCK = {"gqa": 32, "mla": 16}  # vLLM's CPU MLA forces block 16


_toks = random_tokens


P1 = _toks(11, 167)  # several full chunks and a partial tail
P2 = P1[:64] + _toks(12, 50)  # shares only its first 64 tokens with P1 (partial hit)
P3 = _toks(13, 12)  # shorter than a chunk
P4 = _toks(14, 100)  # never saved: a miss
MIXED = [P1, P2, P3, P4]


def _engine_kw(model: str) -> dict:
    # No local prefix cache: every hit in engine B comes from the pool, so "loaded == promised ==
    # expected" is exact (MLA on CPU has none anyway).
    return {"enable_prefix_caching": False, **({"block_size": 32} if model == "gqa" else {})}


@pytest.fixture(scope="module")
def baseline():
    cache: dict[str, list] = {}

    def get(model: str) -> list:
        if model not in cache:
            res = run_engine({"model": model, "max_tokens": MAX_TOKENS, "extra": None, "phases": [MIXED],
                              "engine": _engine_kw(model)})
            cache[model] = res["phases"][0]["outputs"]
        return cache[model]

    return get


@pytest.fixture
def mc_pool(tmp_path):
    from lw_memcache.local import LocalMemcache

    m = LocalMemcache(dram_size="64MB", holder=True, workdir=tmp_path / "pool", stop_timeout_s=3)
    m.start()
    yield m
    m.stop()


@pytest.mark.parametrize(
    "model,layerwise", [("gqa", True), ("gqa", False), ("mla", True)], ids=["gqa-layerwise", "gqa-bulk", "mla-layerwise"]
)
def test_memcache_pool_hits_give_the_same_greedy_output(model: str, layerwise: bool, mc_pool, baseline) -> None:
    bs = BLOCK[model]
    ref = baseline(model)
    extra = {**mc_pool.extra_config, "use_layerwise": layerwise}
    assert extra["backend"] == "memcache"
    a = run_engine({"model": model, "max_tokens": MAX_TOKENS, "phases": [[P1]], "engine": _engine_kw(model),
                    "extra": extra})["phases"][0]["outputs"][0]
    assert a["stats"]["promised_tokens"] == 0 and a["stats"]["saved_chunks"] == len(P1) // bs, a["stats"]
    assert_same_greedy(ref[0], a)

    b = run_engine({"model": model, "max_tokens": MAX_TOKENS, "phases": [MIXED], "engine": _engine_kw(model),
                    "extra": extra})["phases"][0]["outputs"]
    expected_hits = [(len(P1) - 1) // bs * bs, 64, 0, 0]
    for i, (r, g, hit) in enumerate(zip(ref, b, expected_hits)):
        assert_same_greedy(r, g)
        st = g["stats"]
        assert st["promised_tokens"] == hit, f"prompt {i}: lookup promised {st['promised_tokens']}, expected {hit}"
        assert st["loaded_tokens"] == st["promised_tokens"] and st["failed_blocks"] == 0, st
    assert b[0]["stats"]["loaded_tokens"] > 0
