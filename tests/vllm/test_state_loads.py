"""Recurrent-state loads off the forward thread (state_loads), without an engine: the read runs on
a thread of its own, a receive that ends before its request's state landed is held (vLLM must not
run the request or free its blocks while the state is written), and a state read that fails fails
the request's load, its running receive flagged so the worker stops it. Deadlines: a state read
stuck past ``layer_wait_timeout_s`` fails its load, never lands, and does not hold the loads after
it; a step's state saves end within ``save_timeout_s`` (recurrent_states), and one that finishes
late publishes the state of its step, not what its block holds by then."""

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


def _stores(rules: list[dict[str, Any]], timeout_s: float = 30.0,
            threads: int = 1) -> tuple[dict, dict, StateLoads, ThreadRecorder]:
    lay = _layout()
    pool = MemoryBackend(1 << 20)
    src, dst = _caches(lay, True), _caches(lay, False)
    assert StateStore(pool, KS, TAG, lay, src, NBLOCKS).save(b"h", [3]) == "saved"
    rec = ThreadRecorder(FaultyBackend(pool, rules))
    return src, dst, StateLoads(StateStore(rec, KS, TAG, lay, dst, NBLOCKS), timeout_s, threads=threads), rec


def _landed(src: dict, dst: dict, row: int = 1) -> bool:
    return all(torch.equal(s[3], d[row]) for name in src for s, d in zip(src[name], dst[name]))


def _untouched(dst: dict, row: int) -> bool:
    return not any(t[row].any() for ts in dst.values() for t in ts)


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


def test_a_state_read_stuck_past_its_deadline_fails_never_lands_and_does_not_hold_later_loads() -> None:
    deadline_s, stall_s = 0.3, 1.5
    src, dst, loads, _ = _stores([{"op": "open", "action": "stall", "seconds": stall_s, "times": 1}],
                                 timeout_s=deadline_s, threads=1)
    try:
        t0 = time.monotonic()
        loads.start("r", b"h", [1])
        stuck = RecvDone("r", [5], 1, (0.0, 1.0))
        ready, outcome = loads.settle([stuck], wait_s=5.0)  # never past the load's deadline
        assert ready == [stuck] and "deadline" in str(outcome["r"]), outcome
        assert time.monotonic() - t0 < deadline_s + 1.0 < stall_s
        assert loads.stats.take().data["load_deadline_misses"] == 1  # type: ignore[union-attr]
        # The one load thread is still stuck in the pool: the next load gets a fresh one.
        loads.start("q", b"h", [2])
        ready, outcome = loads.settle([RecvDone("q", [6], 1, (0.0, 1.0))], wait_s=5.0)
        assert outcome == {"q": None} and _landed(src, dst, row=2)
        time.sleep(max(0.0, t0 + stall_s + 0.3 - time.monotonic()))  # the stuck read returned meanwhile
        assert _untouched(dst, 1)  # ... and did not land: its block may be another request's by now
    finally:
        loads.close()


def test_state_saves_end_within_the_save_deadline_and_a_late_one_publishes_its_steps_state() -> None:
    from lw_vllm.meta import StateXfer
    from lw_vllm.metrics import Collector
    from lw_vllm.worker.recurrent_states import RecurrentStates

    deadline_s, stall_s = 0.3, 1.0
    lay = _layout()
    pool = MemoryBackend(1 << 20)
    src, dst = _caches(lay, True), _caches(lay, False)
    step_state = {n: [t[3].clone() for t in ts] for n, ts in src.items()}
    stalled = FaultyBackend(pool, [{"op": "reserve", "action": "stall", "seconds": stall_s, "times": 1}])
    states = RecurrentStates(StateStore(stalled, KS, TAG, lay, src, NBLOCKS), Collector(), save_timeout_s=deadline_s)
    try:
        t0 = time.monotonic()
        states.save([StateXfer("r", b"h", [3])])
        assert time.monotonic() - t0 < deadline_s + 0.5 < stall_s  # the step goes on
        data = states.stats.take().data  # type: ignore[union-attr]
        assert data["save_deadline_misses"] == 1 and data["save_failed_objects"] == 1 and data["saved_objects"] == 0
        for ts in src.values():  # vLLM hands the block to another request
            for t in ts:
                t[3].zero_()
        reader = StateStore(pool, KS, TAG, lay, dst, NBLOCKS)
        deadline = time.monotonic() + 5.0
        while reader.load(b"h", [1]) is not None:  # the late save commits the copy taken in its step
            assert time.monotonic() < deadline, "the late save never committed"
            time.sleep(0.05)
        assert all(torch.equal(a, d[1]) for n in dst for a, d in zip(step_state[n], dst[n]))
    finally:
        states.close()
