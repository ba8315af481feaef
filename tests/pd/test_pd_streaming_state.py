"""Streaming PD for recurrent-state models without vLLM: the receive's tail (lw_vllm.pd.stream_recv),
the state after the last chunk, which the prefiller saves whole after its forward (state_store),
so after the chunks' layers are published. It lands after the chunks; the receive does not end
before it has (vLLM would run the request from a state that is not there); a state that never
comes (prefill reported done without it, deadline, cancel) fails the whole receive, so vLLM
recomputes the request."""

from __future__ import annotations

import time

import pytest
import torch
from test_pd_streaming_recv import BLOCKS, KEYS, LAYOUT, NpCopier, Writer, check_loaded

from lw_core.backends.memory import MemoryBackend
from lw_core.keys import KeySpace
from lw_vllm.hybrid import state_layout
from lw_vllm.hybrid.state_store import StateStore
from lw_vllm.pd.stream_recv import StreamReceiver

pytestmark = pytest.mark.timeout(60)

KS = KeySpace(model_fp="m", layout_fp="l")
NSTATE = 4


class MambaSpec:
    def __init__(self, block_size: int = 4) -> None:
        self.block_size, self.page_size_bytes, self.mamba_cache_mode, self.num_speculative_blocks = block_size, 64, "align", 0
        self.shapes, self.dtypes = ((2, 3), (4,)), (torch.bfloat16, torch.float32)


class FullAttentionSpec:
    def __init__(self, block_size: int = 4, page_size_bytes: int = 64) -> None:
        self.block_size, self.page_size_bytes = block_size, page_size_bytes


class _Group:
    def __init__(self, spec: object, names: list[str]) -> None:
        self.kv_cache_spec, self.layer_names = spec, names


class _Cfg:
    def __init__(self) -> None:
        self.kv_cache_groups = [_Group(MambaSpec(), ["m.layers.0.la"]), _Group(FullAttentionSpec(), ["m.layers.1.attn"])]


LAY = state_layout.state_layout(_Cfg())


def _store(be: MemoryBackend, fill: bool) -> StateStore:
    caches = {n: [torch.zeros(NSTATE, 2, 3, dtype=torch.bfloat16), torch.zeros(NSTATE, 4)] for n in LAY.layers}
    if fill:
        for ts in caches.values():
            for t in ts:
                t.copy_(torch.randn(t.shape).to(t.dtype))
    return StateStore(be, KS, "tp0of1-pp0of1", LAY, caches, NSTATE)


def _same_state(a: StateStore, row_a: int, b: StateStore, row_b: int) -> bool:
    return all(torch.equal(ta[row_a], tb[row_b]) for xa, xb in zip(a.tensors, b.tensors) for ta, tb in zip(xa, xb))


class Counting:
    """A tail that counts its tries."""

    def __init__(self, store: StateStore, h: bytes, blocks: list[int]) -> None:
        self.store, self.h, self.blocks, self.tries = store, h, blocks, 0
        self.landed_at: float | None = None

    def __call__(self) -> str | None:
        self.tries += 1
        why = self.store.load(self.h, self.blocks)
        if why is None:
            self.landed_at = time.monotonic()
        return why


def _wait_done(rx: StreamReceiver, timeout_s: float) -> list:
    got: list = []
    t0 = time.monotonic()
    while not got and time.monotonic() - t0 < timeout_s:
        got = rx.take_done(idle_wait_s=0.02)
    return got


@pytest.fixture
def be():
    b = MemoryBackend(capacity_bytes=8 << 20)
    yield b
    b.close()


def test_the_state_saved_after_the_chunks_lands_and_the_receive_waits_for_it(be):
    src, dst = _store(be, True), _store(be, False)
    tail = Counting(dst, b"last", [1])
    rx = StreamReceiver(be, NpCopier(True), LAYOUT, deadline_s=30)
    try:
        rx.start("r", KEYS, BLOCKS, tail, LAY.nbytes)
        Writer(be, KEYS, layer_s=0.01).t.join(5)  # the forward: every layer of every chunk published
        time.sleep(0.3)  # the chunks have landed; the state is not saved yet
        assert rx.take_done() == [] and rx.busy and tail.tries >= 2 and tail.landed_at is None
        saved_at = time.monotonic()
        assert src.save(b"last", [2]) == "saved"  # the prefiller's wait_for_save
        got = _wait_done(rx, 5)
        assert [(d.req_id, d.good, d.failed_blocks, d.error) for d in got] == [("r", 3, [], None)]
        assert got[0].nbytes == 3 * LAYOUT.nbytes + LAY.nbytes  # the chunks and the state
        assert tail.landed_at is not None and tail.landed_at - saved_at < 0.1  # the backoff tops out at 20 ms
        assert _same_state(src, 2, dst, 1) and not _same_state(src, 2, dst, 0)
        check_loaded(rx.copier, KEYS, BLOCKS, 3)
    finally:
        rx.close()


def test_a_state_already_saved_lands_with_the_chunks(be):
    src, dst = _store(be, True), _store(be, False)
    Writer(be, KEYS, layer_s=0).t.join(5)
    assert src.save(b"last", [0]) == "saved"
    tail = Counting(dst, b"last", [3])
    rx = StreamReceiver(be, NpCopier(False), LAYOUT, deadline_s=30)
    try:
        rx.start("r", KEYS, BLOCKS, tail)
        got = _wait_done(rx, 5)
        assert [(d.good, d.error) for d in got] == [(3, None)] and tail.tries == 1
        assert _same_state(src, 0, dst, 3)
    finally:
        rx.close()


def test_prefill_done_without_the_state_fails_the_whole_receive_at_once(be):
    """The prefiller saves the state before it answers: told the prefill is done, one more try
    misses it and every block is recomputed (chunks without their state are no use), long before
    the 30 s deadline."""
    dst = _store(be, False)
    Writer(be, KEYS, layer_s=0).t.join(5)
    tail = Counting(dst, b"last", [1])
    rx = StreamReceiver(be, NpCopier(True), LAYOUT, deadline_s=30)
    try:
        rx.start("r", KEYS, BLOCKS, tail, LAY.nbytes)
        time.sleep(0.2)
        assert rx.take_done() == []
        before = tail.tries
        t0 = time.monotonic()
        rx.prefilled({"r"})
        got = _wait_done(rx, 10)
        assert time.monotonic() - t0 < 1.0
        assert [(d.good, d.failed_blocks) for d in got] == [(0, BLOCKS)]
        assert got[0].nbytes == 3 * LAYOUT.nbytes  # the chunks were read, the state was not
        assert "recurrent state was not there when its prefill was reported done" in got[0].error
        assert "state object missing" in got[0].error and tail.tries > before
    finally:
        rx.close()


def test_a_state_that_never_comes_fails_the_receive_at_its_deadline(be):
    dst = _store(be, False)
    Writer(be, KEYS, layer_s=0).t.join(5)
    rx = StreamReceiver(be, NpCopier(True), LAYOUT, deadline_s=0.8)
    try:
        t0 = time.monotonic()
        rx.start("r", KEYS, BLOCKS, Counting(dst, b"last", [1]))
        got = _wait_done(rx, 10)
        took = time.monotonic() - t0
        assert [(d.good, d.failed_blocks) for d in got] == [(0, BLOCKS)]
        assert "did not land in time" in got[0].error and 0.7 <= took < 3.0, (took, got[0].error)
    finally:
        rx.close()


def test_a_cancel_ends_the_wait_for_the_state(be):
    dst = _store(be, False)
    Writer(be, KEYS, layer_s=0).t.join(5)
    rx = StreamReceiver(be, NpCopier(True), LAYOUT, deadline_s=30)
    try:
        rx.start("r", KEYS, BLOCKS, Counting(dst, b"last", [1]))
        time.sleep(0.2)
        t0 = time.monotonic()
        rx.cancel({"r"})  # the prefill failed (metaserver error) or the request was aborted
        got = _wait_done(rx, 10)
        assert time.monotonic() - t0 < 1.0 and [(d.good, d.failed_blocks) for d in got] == [(0, BLOCKS)]
    finally:
        rx.close()


def test_a_chunk_that_does_not_arrive_ends_the_receive_without_trying_the_state(be):
    src, dst = _store(be, True), _store(be, False)
    Writer(be, KEYS[:2], layer_s=0).t.join(5)  # chunk 2 never reserved
    assert src.save(b"last", [0]) == "saved"
    tail = Counting(dst, b"last", [1])
    rx = StreamReceiver(be, NpCopier(True), LAYOUT, deadline_s=30)
    try:
        rx.start("r", KEYS, BLOCKS, tail)
        time.sleep(0.1)
        rx.prefilled({"r"})
        got = _wait_done(rx, 10)
        assert [(d.good, d.failed_blocks) for d in got] == [(2, [BLOCKS[2]])] and tail.tries == 0
    finally:
        rx.close()


def test_a_state_receive_waiting_does_not_hold_a_worker_from_a_ready_one(be):
    """One receive thread: a receive whose state has not come yet yields it to a queued receive
    whose objects are all there (no head-of-line blocking)."""
    src, dst = _store(be, True), _store(be, False)
    Writer(be, KEYS, layer_s=0).t.join(5)
    assert src.save(b"ready", [0]) == "saved"
    rx = StreamReceiver(be, NpCopier(True), LAYOUT, deadline_s=30, threads=1)
    try:
        rx.start("late", KEYS, BLOCKS, Counting(dst, b"late", [1]))
        time.sleep(0.1)
        rx.start("ready", KEYS, [0, 1, 3], Counting(dst, b"ready", [2]))
        got = _wait_done(rx, 5)
        assert [(d.req_id, d.good) for d in got] == [("ready", 3)]
        assert src.save(b"late", [3]) == "saved"
        got = _wait_done(rx, 5)
        assert [(d.req_id, d.good) for d in got] == [("late", 3)]
        assert _same_state(src, 0, dst, 2) and _same_state(src, 3, dst, 1)
    finally:
        rx.close()


# --- the scheduler's plan to the worker's receive, for a state model (no engine) ---

BLOCK, PAGE = 16, 4096


def _gdn_side(pool_dir: str, timeout_s: float, *, streaming: bool = True, role: str = "kv_consumer", **extra):
    """A gated delta-net engine's scheduler part (block ``BLOCK``) over a fresh embedded pool, and
    its KV cache config; ``extra``: more connector settings."""
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm.sh)")
    from types import SimpleNamespace

    from lw_core.config import parse_config
    from lw_vllm.scheduler.scheduler_side import SchedulerSide

    kc = SimpleNamespace(kv_cache_groups=[_Group(MambaSpec(BLOCK), ["m.layers.0.la"]),
                                          _Group(FullAttentionSpec(BLOCK, PAGE), ["m.layers.1.attn"])])
    vc = SimpleNamespace(
        model_config=SimpleNamespace(model="tiny-gdn", dtype="bfloat16", use_mla=False, hf_config=SimpleNamespace()),
        cache_config=SimpleNamespace(cache_dtype="auto", enable_prefix_caching=True, mamba_cache_mode="align"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        scheduler_config=SimpleNamespace(async_scheduling=False))
    cfg = parse_config({"embedded_path": pool_dir, "embedded_capacity_bytes": 4 << 20, "use_layerwise": True,
                        "pd_streaming": streaming, "metaserver_timeout_s": timeout_s, **extra})
    return SchedulerSide(vc, kc, cfg, role), kc


@pytest.mark.parametrize("state_saved", [True, False], ids=["state-saved", "state-never-saved"])
def test_streamed_hit_of_a_state_model_ends_at_the_handed_off_boundary_and_its_state_lands_last(
        meta, pool_dir, state_saved) -> None:
    """A GDN decoder with pd_streaming: the streamed hit is the prompt's last full boundary before
    its last token (where vLLM hands the prefiller a state), not the prompt less one token; the
    stream load names the block vLLM allocated for the state; the worker starts the receive at once
    (the state does not exist yet) and lands the state after the chunks. The prefiller commits the
    chunks, saves the state, then answers: the receive ends with every chunk and the state. A state
    never saved fails the whole receive at the answer (vLLM recomputes the request)."""
    from types import SimpleNamespace

    import numpy as np
    from test_scheduler_pd import _req

    from lw_core.plan import ObjectLayout
    from lw_vllm.hybrid.state_layout import state_keyspace
    from lw_vllm.metrics import Collector
    from lw_vllm.worker.recurrent_states import RecurrentStates
    from lw_vllm.worker.stream_loads import StreamLoads
    from lw_vllm.worker.worker_report import WorkerReport

    timeout_s = 5.0
    side, kc = _gdn_side(pool_dir, timeout_s)
    lay = state_layout.state_layout(kc)
    rx = StreamReceiver(side.backend, NpRows(), ObjectLayout((PAGE,)), timeout_s)
    try:
        assert side.states is not None and side.pd.states
        meta.mode, meta.bodies = "held", []
        dreq = _req(f"d-gdn-{state_saved}", 3 * BLOCK + 5, meta.url, f"par-gdn-{state_saved}")
        n, is_async = side.get_num_new_matched_tokens(dreq, 0)
        assert (n, is_async) == (3 * BLOCK, True)  # up to the state at 48, not 52 tokens
        attn_blocks, state_block = [5, 6, 7, 8], 9
        ids = ([0, 0, state_block, 0], attn_blocks)  # the state group: null blocks, then the state's
        side.update_state_after_alloc(dreq, SimpleNamespace(get_block_ids=lambda: ids), n)
        empty = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                                scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                                      resumed_req_ids=set(), num_computed_tokens=[]))
        plan = side.build_connector_meta(empty)
        (x,) = plan.stream_loads
        hashes = side.reqs[dreq.request_id].pd_hashes[:3]
        assert (x.hashes, x.block_ids, x.state) == (hashes, attn_blocks[:3], [state_block])

        skeys = state_keyspace(side.keyspace, lay)
        prefiller_states = _store_at(side.backend, skeys, side.tags[0], lay, fill=True)
        decoder_states = _store_at(side.backend, skeys, side.tags[0], lay, fill=False)
        states = RecurrentStates(decoder_states, Collector())
        counts = Collector()
        loads = StreamLoads(rx, side.keyspace, side.tags[0], None, states, WorkerReport(), counts)
        nxt = [plan]
        seen: list = []  # the receives StreamLoads took from the receiver
        take = rx.take_done

        def take_and_keep(idle_wait_s: float = 0.0) -> list:
            seen.extend(out := take(idle_wait_s))
            return out

        rx.take_done = take_and_keep  # type: ignore[method-assign]

        def step() -> list:
            loads.start(nxt[0])
            nxt[0] = side.build_connector_meta(empty)
            before = len(seen)
            loads.finish(set(), idle=True)
            return seen[before:]

        assert step() == [] and rx.busy  # started although neither the chunks nor the state exist
        assert not loads.take_failed_recving()
        keys = side.keyspace.keys(side.tags[0], hashes)
        hs = side.backend.reserve(keys, PAGE)
        side.backend.write(hs, [0] * 3, [np.full(PAGE, 10 + i, np.uint8) for i in range(3)])
        side.backend.commit(hs)
        time.sleep(0.2)
        assert step() == [] and rx.busy  # every chunk landed; the state has not been saved
        if state_saved:
            assert prefiller_states.save(hashes[-1], [3]) == "saved"
        meta.mode = "ok"
        meta.release()  # the prefiller answers after its saves
        t0 = time.monotonic()
        done: list = []
        while not done and time.monotonic() - t0 < 2 * timeout_s:
            done = step()
        assert time.monotonic() - t0 < timeout_s / 5, "the receive waited for its deadline"
        (d,) = done
        if state_saved:
            assert (d.good, d.failed_blocks, d.error) == (3, [], None), d
            assert d.nbytes == 3 * PAGE + lay.nbytes  # the chunks and the state (the worker's loaded_bytes)
            assert d.tail_landed  # the state is one more loaded object
            got = counts.take()
            assert got is not None and (got.data["loaded_objects"], got.data["loaded_bytes"]) == (4, d.nbytes), got
            assert all((rx.copier.kv[0][attn_blocks[i]] == 10 + i).all() for i in range(3))
            assert _same_state(prefiller_states, 3, decoder_states, state_block)
        else:
            assert (d.good, d.failed_blocks) == (0, attn_blocks[:3]) and "recurrent state" in d.error, d
            assert not d.tail_landed
            assert not _same_state(prefiller_states, 3, decoder_states, state_block)
    finally:
        rx.close()
        side.shutdown()


def test_a_prompt_within_one_block_of_its_first_boundary_streams_nothing(meta, pool_dir) -> None:
    """A prompt of exactly one block: its last full boundary before the last token is 0, so there
    is no state to restore and the decoder computes it (nothing promised, no receive)."""
    side, _ = _gdn_side(pool_dir, 5.0)
    try:
        from test_scheduler_pd import _req

        meta.mode = "held"
        dreq = _req("d-gdn-one", BLOCK, meta.url, "par-gdn-one")
        assert side.get_num_new_matched_tokens(dreq, 0) == (0, False)
    finally:
        side.shutdown()


class NpRows:
    """One attention layer's KV blocks as numpy rows, read into directly."""

    def __init__(self) -> None:
        import numpy as np

        self.kv = [np.zeros((16, PAGE), np.uint8)]

    def kv_views(self, layer, blocks):
        return [memoryview(self.kv[layer][b]) for b in blocks]

    def wait(self, token, timeout_s):
        return True


def _store_at(be, keyspace, tag, lay, fill: bool) -> StateStore:
    rows = 16
    caches = {n: [torch.zeros(rows, 2, 3, dtype=torch.bfloat16), torch.zeros(rows, 4)] for n in lay.layers}
    if fill:
        for ts in caches.values():
            for t in ts:
                t.copy_(torch.randn(t.shape).to(t.dtype))
    return StateStore(be, keyspace, tag, lay, caches, rows)
