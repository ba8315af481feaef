"""Streaming PD without vLLM: the decoder worker's receive state machine (lw_vllm.pd.stream_recv)
against the in-process streaming backend, and the prefiller's per-layer publish in the save
pipeline (lw_core.pipeline.save, ``stream_publish``)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from lw_core.backend import ObjectMissing
from lw_core.backends.memory import MemoryBackend
from lw_core.config import ConfigError, parse_config
from lw_core.pipeline import LayerPipeline
from lw_core.pipeline.host_copier import HostCopier
from lw_core.plan import ObjectLayout, ReqSave
from lw_vllm.pd.stream_recv import Receive, StreamReceiver, receive

pytestmark = pytest.mark.timeout(60)

NL, LB, NBLK = 4, 4096, 16
LAYOUT = ObjectLayout((LB,) * NL)


def payload(key: str, layer: int) -> np.ndarray:
    return np.random.default_rng(abs(hash((key, layer))) % (1 << 32)).integers(0, 256, LB, dtype=np.uint8)


class NpCopier:
    """KV blocks as numpy rows; ``direct``: reads land straight in them (like host KV)."""

    def __init__(self, direct: bool) -> None:
        self.kv = [np.zeros((NBLK, LB), np.uint8) for _ in range(NL)]
        self.direct = direct

    def kv_views(self, layer, blocks):
        return [memoryview(self.kv[layer][b]) for b in blocks] if self.direct else None

    def to_kv(self, layer, blocks, srcs):
        for b, s in zip(blocks, srcs):
            self.kv[layer][b] = np.frombuffer(s, np.uint8)

    def wait(self, token, timeout_s):
        return True


class Writer:
    """A prefiller: reserves ``keys`` (after ``reserve_after_s``), writes and publishes layer by
    layer; ``stop_after`` layers then stalls (``abort``: aborts instead); else commits."""

    def __init__(self, be, keys, *, reserve_after_s=0.0, layer_s=0.01, stop_after=None, abort=False):
        self.be, self.keys = be, keys
        self.args = (reserve_after_s, layer_s, stop_after, abort)
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        reserve_after_s, layer_s, stop_after, abort = self.args
        time.sleep(reserve_after_s)
        hs = self.be.reserve(self.keys, LAYOUT.nbytes)
        for layer in range(NL):
            if stop_after is not None and layer == stop_after:
                if abort:
                    self.be.abort(hs)
                return
            time.sleep(layer_s)
            self.be.write(hs, [LAYOUT.offsets[layer]] * len(hs), [payload(k, layer) for k in self.keys])
            self.be.publish(hs, LAYOUT.offsets[layer] + LB)
        self.be.commit(hs)


def check_loaded(cp: NpCopier, keys, blocks, n):
    for i in range(n):
        for layer in range(NL):
            assert np.array_equal(cp.kv[layer][blocks[i]], payload(keys[i], layer)), (i, layer)


@pytest.fixture
def be():
    b = MemoryBackend(capacity_bytes=8 << 20)
    yield b
    b.close()


KEYS = [f"c{i}" for i in range(3)]
BLOCKS = [5, 2, 9]


@pytest.mark.parametrize("direct", [True, False], ids=["kv-views", "staged"])
def test_receive_pulls_every_layer_of_a_reservation_made_after_it_started(be, direct):
    w = Writer(be, KEYS, reserve_after_s=0.1)  # the receiver retries open_streaming meanwhile
    cp = NpCopier(direct)
    good, err = receive(be, cp, LAYOUT, KEYS, BLOCKS, time.monotonic() + 10, threading.Event())
    w.t.join(5)
    assert (good, err) == (3, None)
    check_loaded(cp, KEYS, BLOCKS, 3)


def test_committed_objects_are_read_as_they_are(be):
    Writer(be, KEYS, layer_s=0).t.join(5)
    assert be.lookup(KEYS) == 3
    cp = NpCopier(True)
    assert receive(be, cp, LAYOUT, KEYS, BLOCKS, time.monotonic() + 5, threading.Event()) == (3, None)
    check_loaded(cp, KEYS, BLOCKS, 3)


def test_stalled_prefill_fails_every_chunk_at_the_deadline(be):
    Writer(be, KEYS, stop_after=2)  # layers 0, 1 published, then nothing
    cp = NpCopier(True)
    t0 = time.monotonic()
    good, err = receive(be, cp, LAYOUT, KEYS, BLOCKS, t0 + 0.8, threading.Event())
    took = time.monotonic() - t0
    assert good == 0 and "layer 2" in err, err
    assert 0.7 <= took < 3.0, took


def test_abandoned_chunk_ends_the_prefix_promptly(be):
    Writer(be, KEYS[:1], layer_s=0).t.join(5)  # chunk 0 committed earlier
    Writer(be, KEYS[1:], stop_after=1, abort=True)  # chunks 1, 2: layer 0 then aborted
    cp = NpCopier(False)
    t0 = time.monotonic()
    good, err = receive(be, cp, LAYOUT, KEYS, BLOCKS, t0 + 20, threading.Event())
    assert good == 1 and err, err
    assert time.monotonic() - t0 < 5  # the abort answers, not the 20 s deadline
    check_loaded(cp, KEYS, BLOCKS, 1)


def test_never_reserved_key_keeps_the_prefix_before_it(be):
    Writer(be, KEYS[:2], layer_s=0)
    cp = NpCopier(True)
    good, err = receive(be, cp, LAYOUT, KEYS, BLOCKS, time.monotonic() + 0.5, threading.Event())
    assert good == 2 and "chunk 2" in err, err
    check_loaded(cp, KEYS, BLOCKS, 2)


class TimedCopier(NpCopier):
    """Staged copies, recording when each (layer, block) landed."""

    def __init__(self) -> None:
        super().__init__(False)
        self.landed: dict[tuple[int, int], float] = {}

    def to_kv(self, layer, blocks, srcs):
        super().to_kv(layer, blocks, srcs)
        for b in blocks:
            self.landed[(layer, b)] = time.monotonic()


def test_a_prompt_prefilled_in_two_steps_is_pulled_step_by_step(be):
    """Chunked prefill: the prefiller reserves and publishes chunks 0-1 in its first step and chunk
    2 only in its second. The first step's chunks land, every layer, before the second step even
    reserves; then the late chunk catches up and everything is loaded."""
    first = Writer(be, KEYS[:2], layer_s=0.02)
    second_reserved: list[float] = []

    def second_step() -> None:
        first.t.join(5)
        time.sleep(0.4)
        second_reserved.append(time.monotonic())
        Writer(be, KEYS[2:], layer_s=0.02).t.join(5)

    threading.Thread(target=second_step, daemon=True).start()
    cp = TimedCopier()
    good, err = receive(be, cp, LAYOUT, KEYS, BLOCKS, time.monotonic() + 10, threading.Event())
    assert (good, err) == (3, None)
    check_loaded(cp, KEYS, BLOCKS, 3)
    first_done = max(cp.landed[(layer, b)] for layer in range(NL) for b in BLOCKS[:2])
    assert first_done < second_reserved[0], "the first step's chunks waited for the second step"
    assert min(cp.landed[(layer, BLOCKS[2])] for layer in range(NL)) > second_reserved[0]


def test_chunks_opened_late_catch_up_and_the_prefix_still_ends_at_a_failure(be):
    """Chunk 0 is published to its last layer before chunk 1 is reserved; chunk 1 is aborted after
    its layer 0: chunk 0 is good, 1 and 2 fail promptly (chained), nothing from 1 counts."""
    Writer(be, KEYS[:1], layer_s=0)
    Writer(be, KEYS[1:2], reserve_after_s=0.2, layer_s=0.1, stop_after=1, abort=True)  # reserved 0.1 s: seen
    cp = NpCopier(False)
    t0 = time.monotonic()
    good, err = receive(be, cp, LAYOUT, KEYS, BLOCKS, t0 + 20, threading.Event())
    assert good == 1 and "chunk 1" in err, err
    assert time.monotonic() - t0 < 5
    check_loaded(cp, KEYS, BLOCKS, 1)


def test_receiver_reports_each_request_once_with_its_failed_blocks_and_cancel_ends_it(be):
    rx = StreamReceiver(be, NpCopier(True), LAYOUT, deadline_s=30)
    w = Writer(be, KEYS[:2])
    rx.start("ok", KEYS[:2], BLOCKS[:2])
    rx.start("stuck", ["never"], [7])
    with pytest.raises(RuntimeError, match="twice"):
        rx.start("ok", KEYS[:2], BLOCKS[:2])
    w.t.join(5)
    done = []
    deadline = time.monotonic() + 10
    while not done and time.monotonic() < deadline:
        done = rx.take_done(idle_wait_s=0.05)
    assert [(d.req_id, d.good, d.failed_blocks) for d in done] == [("ok", 2, [])]
    assert rx.busy
    t0 = time.monotonic()
    rx.cancel({"stuck"})
    got = []
    while not got and time.monotonic() - t0 < 5:
        got = rx.take_done(idle_wait_s=0.05)
    assert [(d.req_id, d.good, d.failed_blocks) for d in got] == [("stuck", 0, [7])]
    assert not rx.busy and rx.take_done() == []
    rx.close()


class Recording(MemoryBackend):
    def __init__(self):
        super().__init__(capacity_bytes=8 << 20)
        self.calls: list[tuple[str, int]] = []

    def publish(self, handles, upto):
        self.calls.append(("publish", upto))
        super().publish(handles, upto)
        # A streaming reader reads the layer just published, and nothing beyond it, before the commit.
        (r,) = self.open_streaming([handles[0].key])
        out = np.empty(LB, np.uint8)
        self.read([r], [upto - LB], [out])
        assert (out == 3).all()  # the KV blocks' bytes (HostCopier fill)
        if upto < LAYOUT.nbytes:
            with pytest.raises(ObjectMissing):
                self.read([r], [upto], [out])
        self.release([r])

    def commit(self, handles):
        self.calls.append(("commit", len(handles)))
        return super().commit(handles)


@pytest.mark.parametrize("stream_publish", [True, False])
def test_save_pipeline_publishes_each_layer_in_order_before_the_commit(stream_publish):
    be = Recording()
    try:
        cp = HostCopier.allocate(NL, NBLK, LB, fill=3)
        pipe = LayerPipeline(be, cp, LAYOUT, layerwise=True, save_threads=2, stream_publish=stream_publish)
        try:
            pipe.start_save([ReqSave("r", ["a", "b"], [1, 2])])
            for layer in range(NL):
                pipe.save_layer(layer)
            res = pipe.finish_save()
        finally:
            pipe.close()
        assert sorted(res.committed_keys) == ["a", "b"], res
        want = [("publish", (i + 1) * LB) for i in range(NL)] if stream_publish else []
        assert be.calls == [*want, ("commit", 2)]
    finally:
        be.close()


def test_pd_streaming_is_off_by_default_and_refused_on_a_backend_without_streaming():
    from lw_vllm import pool

    assert parse_config({}).pd_streaming is False
    cfg = parse_config({"pd_streaming": True})
    assert cfg.pd_streaming is True

    class Plain:
        name = "plain"

    with pytest.raises(ConfigError, match=r"pd_streaming=true.*backend 'plain' does not have it"):
        pool.check_streaming(cfg, Plain())  # type: ignore[arg-type]
    pool.check_streaming(cfg, MemoryBackend(capacity_bytes=1 << 20))  # has the extension: accepted


def test_cancel_ends_a_layer_wait_long_before_the_deadline(be):
    """The prefill failed (metaserver error) while the receive waits for a layer: the cancel ends
    it within a wait slice, not at the 30 s deadline, and nothing counts as landed."""
    Writer(be, KEYS, stop_after=2)  # layers 0, 1 published, then the prefill stalls
    rx = StreamReceiver(be, NpCopier(True), LAYOUT, deadline_s=30)
    rx.start("r", KEYS, BLOCKS)
    time.sleep(0.3)  # the receive is now waiting for layer 2
    assert rx.busy
    t0 = time.monotonic()
    rx.cancel({"r"})
    got = []
    while not got and time.monotonic() - t0 < 5:
        got = rx.take_done(idle_wait_s=0.05)
    assert time.monotonic() - t0 < 2.0
    assert [(d.req_id, d.good, d.failed_blocks) for d in got] == [("r", 0, BLOCKS)]
    assert "cancelled" in got[0].error
    rx.close()


def _recv_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lw-recv")]


def _collect(rx: StreamReceiver, n: int, timeout_s: float) -> dict[str, tuple[int, float]]:
    """req_id -> (good, seconds after the call) for ``n`` reports, within ``timeout_s``."""
    got: dict[str, tuple[int, float]] = {}
    t0 = time.monotonic()
    while len(got) < n and time.monotonic() - t0 < timeout_s:
        for d in rx.take_done(idle_wait_s=0.05):
            assert d.req_id not in got, f"{d.req_id} reported twice"
            got[d.req_id] = (d.good, time.monotonic() - t0)
    return got


def test_receive_threads_are_bounded_and_a_ready_request_is_not_stuck_behind_late_ones(be):
    """More receiving requests than ``threads``: at most that many worker threads exist, and
    requests whose prefill never comes (they wait for keys nobody reserves) do not hold the
    workers while a later request's layers are published: it lands long before their deadline."""
    before = len(_recv_threads())
    rx = StreamReceiver(be, NpCopier(True), LAYOUT, deadline_s=20, threads=2)
    try:
        for i in range(6):
            rx.start(f"late{i}", [f"never{i}"], [10 + i])
        rx.start("ready", KEYS, BLOCKS)
        t0 = time.monotonic()
        Writer(be, KEYS, reserve_after_s=0.2)
        got = _collect(rx, 1, 10)
        assert list(got) == ["ready"] and got["ready"][0] == 3, got
        assert time.monotonic() - t0 < 5, "the ready request waited behind the late ones"
        assert len(_recv_threads()) - before <= 2 and rx.worker_count == 2
        check_loaded(rx.copier, KEYS, BLOCKS, 3)
        assert rx.busy  # the late ones still wait for their deadline
    finally:
        rx.close()
    got = _collect(rx, 6, 5)  # close stops them; each is reported once, failed
    assert sorted(got) == [f"late{i}" for i in range(6)] and all(g == 0 for g, _ in got.values()), got


def test_queued_receives_keep_their_deadline_and_recompute_at_it(be):
    """One worker, three requests that never get their prefill: their deadlines all count from
    ``start``, so they end together at about the deadline, not one deadline after another."""
    rx = StreamReceiver(be, NpCopier(True), LAYOUT, deadline_s=0.8, threads=1)
    try:
        for i in range(3):
            rx.start(f"r{i}", [f"never{i}"], [i])
        got = _collect(rx, 3, 10)
        assert sorted(got) == ["r0", "r1", "r2"], got
        assert all(g == 0 for g, _ in got.values()), got
        assert max(t for _, t in got.values()) < 0.8 + 1.0, got  # sequential deadlines would take 2.4 s
    finally:
        rx.close()


def test_stream_recv_threads_is_a_bounded_config_key():
    assert parse_config({}).stream_recv_threads == 4
    assert parse_config({"stream_recv_threads": 1}).stream_recv_threads == 1
    for bad in (0, 257, "4", 2.5):
        with pytest.raises(ConfigError, match="stream_recv_threads"):
            parse_config({"stream_recv_threads": bad})
    with pytest.raises(ValueError, match="threads"):
        StreamReceiver(None, None, LAYOUT, 1.0, threads=0)


def test_a_burst_of_receives_gets_its_workers_after_the_pool_went_idle(be):
    """Workers are started as receives queue up, also right after the pool was idle (a woken
    worker that has not taken its receive yet does not count as free)."""
    Writer(be, KEYS, layer_s=0).t.join(5)
    rx = StreamReceiver(be, NpCopier(True), LAYOUT, deadline_s=20, threads=3)
    try:
        rx.start("first", KEYS, BLOCKS)  # committed: ends at once, its worker goes idle
        assert list(_collect(rx, 1, 5)) == ["first"]
        time.sleep(0.1)
        for i in range(3):
            rx.start(f"late{i}", [f"never{i}"], [i])
        assert rx.worker_count == 3
    finally:
        rx.close()


def _wait_done(rx: StreamReceiver, timeout_s: float) -> list:
    got: list = []
    t0 = time.monotonic()
    while not got and time.monotonic() - t0 < timeout_s:
        got = rx.take_done(idle_wait_s=0.02)
    return got


def test_prefill_done_ends_the_receive_at_a_chunk_never_reserved(be):
    """The prefiller committed chunks 0-1 and answered; chunk 2 it never reserved (a refused
    reservation, a partial chunk it discards, another model or layout's keys). Told the prefill is
    done, the receive opens chunk 2 once more and ends: 0-1 landed, 2 recomputed, long before the
    30 s deadline."""
    Writer(be, KEYS[:2], layer_s=0).t.join(5)
    rx = StreamReceiver(be, NpCopier(True), LAYOUT, deadline_s=30)
    try:
        rx.start("r", KEYS, BLOCKS)
        time.sleep(0.3)  # chunks 0-1 land; chunk 2 is retried
        assert rx.busy and rx.take_done() == []
        t0 = time.monotonic()
        rx.prefilled({"r", "unknown"})  # the metaserver's ok answer (an unknown id is ignored)
        got = _wait_done(rx, 10)
        took = time.monotonic() - t0
        assert took < 1.0, f"{took:.1f} s after the answer: the receive waited for its deadline"
        assert [(d.req_id, d.good, d.failed_blocks) for d in got] == [("r", 2, [BLOCKS[2]])]
        assert "chunk 2 of 3 was neither reserved nor committed when its prefill was reported done" in got[0].error
        check_loaded(rx.copier, KEYS, BLOCKS, 2)
    finally:
        rx.close()


def test_prefill_done_with_nothing_in_the_pool_fails_every_chunk_at_once(be):
    """A prefiller whose objects the decoder does not find at all (another pool, model or layout):
    the answer ends the receive, every block is recomputed."""
    rx = StreamReceiver(be, NpCopier(True), LAYOUT, deadline_s=30)
    try:
        rx.start("r", KEYS, BLOCKS)
        time.sleep(0.1)
        t0 = time.monotonic()
        rx.prefilled({"r"})
        got = _wait_done(rx, 10)
        assert time.monotonic() - t0 < 1.0
        assert [(d.req_id, d.good, d.failed_blocks) for d in got] == [("r", 0, BLOCKS)]
    finally:
        rx.close()


def test_the_last_open_comes_after_the_answer_and_reserved_chunks_go_on(be):
    """The answer may reach the decoder before its receive opened anything: the one last open is
    made after it, so committed chunks land. A chunk reserved but not committed yet is not cut by
    the answer: it is read as it is published."""
    Writer(be, KEYS[:1], layer_s=0).t.join(5)
    r = Receive(KEYS[:1], BLOCKS[:1], time.monotonic() + 30, threading.Event())
    r.prefilled.set()  # before the first advance: the first open is the last one
    cp = NpCopier(True)
    assert r.advance(be, cp, LAYOUT) and r.result == (1, None)
    r.release(be)
    check_loaded(cp, KEYS, BLOCKS, 1)

    w = Writer(be, KEYS[1:], layer_s=0.1)  # reserved now, publishes a layer every 0.1 s
    time.sleep(0.05)
    r = Receive(KEYS[1:], BLOCKS[1:], time.monotonic() + 30, threading.Event())
    r.prefilled.set()
    t0 = time.monotonic()
    assert r.advance(be, cp, LAYOUT) and r.result == (2, None)
    assert time.monotonic() - t0 >= 0.2  # it waited for the layers
    r.release(be)
    w.t.join(5)
    check_loaded(cp, KEYS[1:], BLOCKS[1:], 2)


def test_a_receive_that_holds_is_reported_at_the_answer_and_keeps_its_chunks(be):
    """A request continuing from the prefill's first token: its receive is not reported when every
    chunk landed (vLLM would schedule it before the answer carrying the token), but at the answer;
    without an answer, at its deadline with its chunks good; cancelled while it holds (the
    prefill failed), its landed chunks still count. A receive that does not hold ends at once."""
    Writer(be, KEYS, layer_s=0).t.join(5)
    rx = StreamReceiver(be, NpCopier(True), LAYOUT, deadline_s=30)
    try:
        rx.start("plain", KEYS, BLOCKS)
        rx.start("held", KEYS, [1, 3, 4], holds=True)
        rx.start("failed", KEYS, [6, 7, 8], holds=True)
        assert [(d.req_id, d.good) for d in _wait_done(rx, 10)] == [("plain", 3)]
        time.sleep(0.3)  # "held" and "failed" landed long ago
        assert rx.take_done() == [] and rx.busy
        t0 = time.monotonic()
        rx.prefilled({"held"})
        got = _wait_done(rx, 10)
        assert time.monotonic() - t0 < 1.0
        assert [(d.req_id, d.good, d.failed_blocks) for d in got] == [("held", 3, [])]
        check_loaded(rx.copier, KEYS, [1, 3, 4], 3)
        rx.cancel({"failed"})
        got = _wait_done(rx, 10)
        assert [(d.req_id, d.good, d.failed_blocks) for d in got] == [("failed", 3, [])]
        assert not rx.busy
    finally:
        rx.close()
    rx = StreamReceiver(be, NpCopier(True), LAYOUT, deadline_s=0.5)
    try:
        t0 = time.monotonic()
        rx.start("late", KEYS[:2], BLOCKS[:2], holds=True)
        got = _wait_done(rx, 10)
        assert time.monotonic() - t0 >= 0.45  # held until its deadline
        assert [(d.req_id, d.good, d.failed_blocks) for d in got] == [("late", 2, [])]
    finally:
        rx.close()
    # Not landed yet when cancelled: nothing counts, as without ``holds``.
    rx = StreamReceiver(be, NpCopier(True), LAYOUT, deadline_s=30)
    try:
        rx.start("gone", ["never"], [7], holds=True)
        time.sleep(0.1)
        rx.cancel({"gone"})
        assert [(d.req_id, d.good) for d in _wait_done(rx, 10)] == [("gone", 0)]
    finally:
        rx.close()
