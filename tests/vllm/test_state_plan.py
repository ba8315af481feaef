"""Recurrent-state objects without an engine (state_layout, state_plan, state_store): which models
the pool restores, which boundary hand-offs are saved, how long a hit is, where the state loads,
and a state's bytes round trip through the pool."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lw_core.backends.memory import MemoryBackend
from lw_core.keys import KeySpace
from lw_vllm.hybrid import state_layout
from lw_vllm.hybrid.state_plan import StatePlan
from lw_vllm.hybrid.state_store import StateStore
from lw_vllm.meta import StateXfer, Xfer
from lw_vllm.metrics import Collector
from lw_vllm.request.request_state import ReqState
from lw_vllm.scheduler.pool_lookup import PoolLookup

BS = 4
KS = KeySpace(model_fp="m", layout_fp="l")
TAGS = ["tp0of2-pp0of1", "tp1of2-pp0of1"]


class FullAttentionSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


def _cfg(mode: str = "align", state_bs: int = BS, spec_blocks: int = 0, shapes: tuple = ((2, 3), (4,)),
         dtypes: tuple = (torch.bfloat16, torch.float32)) -> SimpleNamespace:
    state = dict(block_size=state_bs, page_size_bytes=64, mamba_cache_mode=mode, num_speculative_blocks=spec_blocks,
                 shapes=shapes, dtypes=dtypes)
    return SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=MambaSpec(**state), layer_names=["m.layers.2.la", "m.layers.0.la"]),
        SimpleNamespace(kv_cache_spec=FullAttentionSpec(block_size=BS, page_size_bytes=64),
                        layer_names=["m.layers.1.attn", "m.layers.3.attn"]),
    ])


def test_states_are_restorable_in_align_mode_only() -> None:
    assert state_layout.why_not_restorable(_cfg()) is None
    assert "align" in str(state_layout.why_not_restorable(_cfg(mode="none")))
    assert "speculative" in str(state_layout.why_not_restorable(_cfg(spec_blocks=1)))
    assert "block size" in str(state_layout.why_not_restorable(_cfg(state_bs=2 * BS)))


def test_layout_in_model_order_and_its_own_key_space() -> None:
    lay = state_layout.state_layout(_cfg())
    assert lay.layers == ("m.layers.0.la", "m.layers.2.la") and lay.groups == (0, 0) and lay.group_ids == (0,)
    assert lay.tensor_nbytes == ((12, 16), (12, 16)) and lay.nbytes == 56
    sks = state_layout.state_keyspace(KS, lay)
    assert sks.model_fp == KS.model_fp and sks.layout_fp != KS.layout_fp


@pytest.mark.parametrize("other", [
    {"dtypes": (torch.float16, torch.float32)},  # --mamba-ssm-cache-dtype float16 against bfloat16: same bytes
    {"dtypes": (torch.bfloat16, torch.int32)},
    {"shapes": ((3, 2), (4,))},  # a conv state stored the other way round (VLLM_SSM_CONV_STATE_LAYOUT)
    {"mode": "none"},
])
def test_states_of_other_dtypes_shapes_or_modes_never_share_keys(other: dict) -> None:
    """Two engines whose state tensors differ in dtype, shape or cache mode, byte sizes alike, key
    their states apart (one never loads the other's bits); the same layout keys alike."""
    lay, alt = state_layout.state_layout(_cfg()), state_layout.state_layout(_cfg(**other))
    assert alt.tensor_nbytes == lay.tensor_nbytes
    assert state_layout.state_keyspace(KS, alt) != state_layout.state_keyspace(KS, lay)
    assert state_layout.state_keyspace(KS, state_layout.state_layout(_cfg())) == state_layout.state_keyspace(KS, lay)


def _st(rid: str, prompt_len: int) -> ReqState:
    st = ReqState(req=SimpleNamespace(request_id=rid), prompt_len=prompt_len)
    st.hashes = [bytes([i]) * 4 for i in range(prompt_len // BS + 1)]
    return st


def _plan(backend: object = None) -> StatePlan:
    lookup = PoolLookup(backend, KS, TAGS, {}, [], 5.0, Collector())  # type: ignore[arg-type]
    return StatePlan(lookup, KS, TAGS, state_layout.state_layout(_cfg()), BS)


def test_saves_take_live_requests_chunk_boundaries_inside_the_prompt_with_real_blocks() -> None:
    reqs = {r: _st(r, 10) for r in ("a", "b", "c", "x")}
    so = SimpleNamespace(
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads={
            "a": [(0, 7, 4), (0, 8, 6), (0, 9, 12), (0, 0, 8)],  # 4 kept; 6 not a chunk end; 12 past the prompt; null
            "b": [(0, 5, 8)],  # preempted this step
            "c": [(0, 6, 8)],  # finished this step
            "gone": [(0, 3, 4)],  # not tracked
            "x": [(1, 3, 4)],  # no state group's block
        }),
        preempted_req_ids={"b"}, finished_req_ids={"c"})
    out = _plan().saves(so, reqs, lambda st: st.hashes)
    assert out == [StateXfer("a", reqs["a"].hashes[0], [7])]
    assert _plan().saves(SimpleNamespace(kv_connector_block_state=None), reqs, lambda st: st.hashes) == []


def test_a_hit_ends_at_the_longest_boundary_with_every_ranks_state() -> None:
    class Pool:
        keys = {KS.key(t, h) for t in TAGS for h in (b"h1", b"h3")} | {KS.key(TAGS[0], b"h4")}

        def lookup(self, keys: list[str]) -> int:
            n = 0
            while n < len(keys) and keys[n] in self.keys:
                n += 1
            return n

    hashes = [b"h0", b"h1", b"h2", b"h3", b"h4"]
    plan = _plan(Pool())
    assert plan.longest(hashes, 0, 5) == 4  # boundary 5 (h4) lacks rank 1's state
    assert plan.longest(hashes, 0, 3) == 2
    assert plan.longest(hashes, 2, 3) == 2  # nothing past the local hit
    assert plan.longest(hashes, 0, 1) == 0


def test_the_state_loads_into_the_block_at_the_boundary() -> None:
    plan = _plan()
    st = _st("a", 10)
    st.load = (0, 2)
    plan.allocated(st, ([0, 11, 12], [1, 2, 3]))  # state group: a null, then the boundary's block
    x = plan.with_state(Xfer("a", st.hashes[:2], [1, 2], 0, []))
    assert x.state == [11] and x.hashes == st.hashes[:2]
    st.load = (0, 1)
    plan.allocated(st, ([0, 11], [1, 2]))  # vLLM gave the null block: recompute, never load garbage
    bad = plan.with_state(Xfer("a", st.hashes[:1], [1], 0, []))
    assert bad.hashes == [] and bad.state == []


@pytest.mark.parametrize("one_tensor", [False, True])
def test_state_bytes_round_trip_through_the_pool(one_tensor: bool) -> None:
    lay = state_layout.state_layout(_cfg())
    nblocks = 5

    def caches() -> dict[str, object]:
        out: dict[str, object] = {}
        for name in lay.layers:
            if one_tensor:  # vLLM's CPU build: one row of state bytes per block
                out[name] = torch.zeros(nblocks, 1, 1, 28, dtype=torch.uint8)
            else:
                out[name] = [torch.zeros(nblocks, 2, 3, dtype=torch.bfloat16), torch.zeros(nblocks, 4)]
        return out

    backend = MemoryBackend(1 << 20)
    src, dst = caches(), caches()
    for name in lay.layers:
        for t in src[name] if isinstance(src[name], list) else [src[name]]:  # type: ignore[union-attr]
            t.copy_(torch.randn(t.shape).to(t.dtype) if t.is_floating_point() else torch.randint(0, 255, t.shape, dtype=t.dtype))
    a = StateStore(backend, KS, TAGS[0], lay, src, nblocks)
    b = StateStore(backend, KS, TAGS[0], lay, dst, nblocks)
    assert a.save(b"h", [3]) == "saved" and a.save(b"h", [3]) == "present"
    assert b.load(b"other", [1]) == "state object missing"
    assert b.load(b"h", [1]) is None
    for name in lay.layers:
        s = src[name] if isinstance(src[name], list) else [src[name]]
        d = dst[name] if isinstance(dst[name], list) else [dst[name]]
        for ts, td in zip(s, d):  # type: ignore[arg-type]
            assert torch.equal(ts[3], td[1]) and not td[0].any() and not td[3].any()


def test_state_tensors_that_do_not_match_the_spec_are_refused() -> None:
    lay = state_layout.state_layout(_cfg())
    bad = {n: [torch.zeros(5, 2, 2, dtype=torch.bfloat16), torch.zeros(5, 4)] for n in lay.layers}
    with pytest.raises(NotImplementedError, match="state tensors"):
        StateStore(MemoryBackend(1 << 20), KS, TAGS[0], lay, bad, 5)


def test_engine_record_names_what_vllm_decided_for_the_states() -> None:
    """The stats file's engine record (engine_facts): per group its kind, block and page size, a
    state group's tensor shapes, dtypes and cache mode; the pool's block and a state object's bytes."""
    from lw_vllm.scheduler.engine_facts import engine_facts

    vc = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16),
                         cache_config=SimpleNamespace(cache_dtype="auto", mamba_ssm_cache_dtype="auto"))
    kc = _cfg()
    rec = engine_facts(vc, kc, state_layout.state_layout(kc))
    assert rec == {
        "block_size": BS, "dtype": "bfloat16", "kv_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto",
        "groups": [{"kind": "MambaSpec", "layers": 2, "block_size": BS, "page_size_bytes": 64, "shapes": [[2, 3], [4]],
                    "dtypes": ["bfloat16", "float32"], "mamba_cache_mode": "align"},
                   {"kind": "FullAttentionSpec", "layers": 2, "block_size": BS, "page_size_bytes": 64}],
        "state_bytes": 56,
    }
    assert engine_facts(vc, kc, None)["state_bytes"] is None  # the pool keeps no states (inert)
