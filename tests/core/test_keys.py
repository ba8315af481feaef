import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from lw_core.keys import HashExtra, KeySpace, chunk_hashes, partial_chunk_hash, rank_tag

tokens_st = st.lists(st.integers(0, 2**31 - 1), max_size=200)
chunk_st = st.integers(1, 32)


@settings(max_examples=200, deadline=None)
@given(tokens_st, tokens_st, chunk_st)
def test_prefix_property(a, b, chunk):
    """Equal leading full chunks -> equal leading hashes; the first differing chunk and every
    later one differ (the chain carries the change forward)."""
    ha, hb = chunk_hashes(a, chunk), chunk_hashes(b, chunk)
    assert len(ha) == len(a) // chunk
    common = 0
    while common < min(len(ha), len(hb)) and a[common * chunk : (common + 1) * chunk] == b[common * chunk : (common + 1) * chunk]:
        common += 1
    assert ha[:common] == hb[:common]
    for i in range(common, min(len(ha), len(hb))):
        assert ha[i] != hb[i]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=200), chunk_st, st.data())
def test_any_token_change_changes_all_later_keys(tokens, chunk, data):
    i = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[i] = (changed[i] + data.draw(st.integers(1, 1000))) % 2**31
    h0, h1 = chunk_hashes(tokens, chunk), chunk_hashes(changed, chunk)
    first = i // chunk
    assert h0[:first] == h1[:first]
    assert all(x != y for x, y in zip(h0[first:], h1[first:]))


@settings(max_examples=100, deadline=None)
@given(tokens_st.filter(lambda t: len(t) >= 4), st.text(max_size=5), st.text(max_size=5))
def test_salt_and_lora_isolate_tenants(tokens, s1, s2):
    base = chunk_hashes(tokens, 4)
    salted = chunk_hashes(tokens, 4, HashExtra(cache_salt="t1" + s1))
    other = chunk_hashes(tokens, 4, HashExtra(cache_salt="t2" + s2))
    lora = chunk_hashes(tokens, 4, HashExtra(lora="content:abc"))
    assert not set(base) & set(salted)
    assert not set(salted) & set(other)
    assert not set(base) & set(lora)


def test_keys_equal_across_processes_without_hashseed():
    code = (
        "from lw_core.keys import chunk_hashes, HashExtra;"
        "print(','.join(h.hex() for h in chunk_hashes(list(range(100)), 16, HashExtra(cache_salt='s'))))"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], env={"PYTHONHASHSEED": seed}, capture_output=True, text=True, check=True).stdout
        for seed in ("0", "1", "random")
    }
    assert len(outs) == 1
    assert outs.pop().strip().split(",") == [h.hex() for h in chunk_hashes(list(range(100)), 16, HashExtra(cache_salt="s"))]


def test_partial_chunk_key_is_request_scoped():
    toks = list(range(20))
    assert partial_chunk_hash(list(range(16)), 16, "r1") is None
    p1, p2 = partial_chunk_hash(toks, 16, "r1"), partial_chunk_hash(toks, 16, "r2")
    assert p1 != p2
    assert p1 not in chunk_hashes(toks + [0] * 12, 16)


def test_object_keys_carry_fingerprints_and_rank():
    ks = KeySpace.for_model(model="m", dtype="float32", block_size=16, layer_block_bytes=[4096] * 4, kv_dtype="float32")
    other_layout = KeySpace.for_model(model="m", dtype="float32", block_size=32, layer_block_bytes=[4096] * 4, kv_dtype="float32")
    other_model = KeySpace.for_model(model="m2", dtype="float32", block_size=16, layer_block_bytes=[4096] * 4, kv_dtype="float32")
    h = chunk_hashes(list(range(16)), 16)
    k = ks.keys(rank_tag(tp_rank=1, tp_size=2), h)[0]
    assert k.startswith("lw1/") and "/tp1of2-pp0of1/" in k and k.endswith(h[0].hex())
    assert len({k, other_layout.keys("x", h)[0], other_model.keys("x", h)[0]}) == 3
    assert rank_tag(tp_rank=0, tp_size=4, mla=True) == rank_tag(tp_rank=3, tp_size=4, mla=True)
