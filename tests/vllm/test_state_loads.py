"""Recurrent-state loads off the forward thread (state_loads), without an engine: the read runs on
a thread of its own, a receive that ends before its request's state landed is held (vLLM must not
run the request or free its blocks while the state is written), and a state read that fails fails
the request's load, its running receive flagged so the worker stops it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import torch

from lw_core.backends.memory import MemoryBackend
from lw_core.keys import KeySpace
from lw_dev.faulty_backend import FaultyBackend
from lw_vllm.hybrid import state_layout
from lw_vllm.hybrid.state_loads import StateLoads
from lw_vllm.hybrid.state_store import StateStore
from lw_vllm.pd.stream_recv import RecvDone

KS = KeySpace(model_fp="m", layout_fp="l")
TAG = "tp0of1-pp0of1"
NBLOCKS = 4


class MambaSpec(SimpleNamespace):
    pass


class FullAttentionSpec(SimpleNamespace):
    pass


def _layout() -> state_layout.StateLayout:
    state = dict(block_size=4, page_size_bytes=64, mamba_cache_mode="align", num_speculative_blocks=0,
                 shapes=((2, 3), (4,)), dtypes=(torch.bfloat16, torch.float32))
    return state_layout.state_layout(SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=MambaSpec(**state), layer_names=["m.layers.0.la", "m.layers.2.la"]),
        SimpleNamespace(kv_cache_spec=FullAttentionSpec(block_size=4, page_size_bytes=64),
                        layer_names=["m.layers.1.attn", "m.layers.3.attn"]),
    ]))


def _caches(lay: state_layout.StateLayout, fill: bool) -> dict[str, list[torch.Tensor]]:
    out = {}
    for name in lay.layers:
        ts = [torch.zeros(NBLOCKS, 2, 3, dtype=torch.bfloat16), torch.zeros(NBLOCKS, 4)]
        if fill:
            for t in ts:
                t.copy_(torch.randn(t.shape).to(t.dtype))
        out[name] = ts
    return out


class ThreadRecorder:
    """Passes calls through to ``inner``, noting which thread read."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.read_threads = inner, []

    def read(self, *a: Any) -> None:
        self.read_threads.append(threading.current_thread().name)
        self.inner.read(*a)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _stores(rules: list[dict[str, Any]]) -> tuple[dict, dict, StateLoads, ThreadRecorder]:
    lay = _layout()
    pool = MemoryBackend(1 << 20)
    src, dst = _caches(lay, True), _caches(lay, False)
    assert StateStore(pool, KS, TAG, lay, src, NBLOCKS).save(b"h", [3]) == "saved"
    rec = ThreadRecorder(FaultyBackend(pool, rules))
    return src, dst, StateLoads(StateStore(rec, KS, TAG, lay, dst, NBLOCKS)), rec


def _landed(src: dict, dst: dict) -> bool:
    return all(torch.equal(s[3], d[1]) for name in src for s, d in zip(src[name], dst[name]))


def test_the_state_is_read_off_the_callers_thread_and_an_ended_receive_waits_for_it() -> None:
    src, dst, loads, rec = _stores([{"op": "read", "action": "stall", "seconds": 0.5}])
    try:
        t0 = time.monotonic()
        loads.start("r", b"h", [1])
        assert time.monotonic() - t0 < 0.25  # the caller (start_load_kv, before the forward) did not read
        chunks = RecvDone("r", [5, 6], 2, (0.0, 1.0), nbytes=128)
        other = RecvDone("s", [7], 1, (0.0, 1.0), nbytes=64)  # no state: reported at once
        ready, outcome = loads.settle([chunks, other])
        assert ready == [other] and outcome == {} and loads.busy
        assert not any(t[1].any() for ts in dst.values() for t in ts)  # nothing reported before it landed
        ready, outcome = loads.settle([], wait_s=5.0)
        assert ready == [chunks] and outcome == {"r": None} and not loads.busy
        assert _landed(src, dst)
        assert rec.read_threads and all(n.startswith("lw-state-load") for n in rec.read_threads), rec.read_threads
        assert loads.settle([]) == ([], {})  # reported once
    finally:
        loads.close()


def test_a_state_read_that_fails_fails_the_load_and_flags_its_running_receive() -> None:
    src, dst, loads, _ = _stores([{"op": "read", "action": "fail", "times": 1}])
    try:
        loads.start("r", b"h", [1])
        deadline = time.monotonic() + 5.0
        while not loads.failed_running() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loads.failed_running() == {"r"}  # the worker cancels the receive: the load fails whole
        chunks = RecvDone("r", [5, 6], 1, (0.0, 1.0), error="cancelled")
        ready, outcome = loads.settle([chunks])
        assert ready == [chunks] and outcome["r"] is not None and "read failed" in outcome["r"], outcome
        assert loads.failed_running() == set() and not loads.busy
        # Missing object: same outcome, never a wrong state.
        loads.start("q", b"other", [2])
        ready, outcome = loads.settle([RecvDone("q", [8], 1, (0.0, 1.0))], wait_s=5.0)
        assert outcome == {"q": "state object missing"} and not dst[next(iter(dst))][0][2].any()
    finally:
        loads.close()
