"""The shared segment-streaming pieces (lw_core.backends.segment_stream) against a fake store: the
poll loop's answers for published, aborted, committed and abandoned reservations, the head layout
and the argument checks every streaming backend uses."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest

from lw_core.backends.segment_stream import abort_key, seg_key, wait_published
from lw_core.backends.segment_stream.checks import check_lengths, check_range, check_timeout, check_upto
from lw_core.backends.segment_stream.head import HEAD, pack_head, unpack_head
from lw_core.backends.segment_stream.policy import QuietPeriod
from lw_core.procs import Owner, boot_id, current_owner


@dataclass(eq=False)
class Handle:
    key: str
    nbytes: int
    token: bytes | None
    boot: bytes = b""
    owner: Owner | None = None
    dead: bool = False
    whole: bool = False


class FakeStore:
    """A set of object names; ``committed`` maps a key to the token its object carries."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.committed: dict[str, bytes] = {}
        self.polls = 0

    def exists(self, names: list[str]) -> list[int]:
        self.polls += 1
        return [int(n in self.names or n in self.committed) for n in names]

    def adopt(self, handles: Any) -> None:
        for h in handles:
            h.whole = self.committed.get(h.key) == h.token
            h.dead = not h.whole


def wait(store: FakeStore, hs: list[Handle], upto: int, timeout_s: float) -> list[bool]:
    return wait_published("fake", store, hs, upto, timeout_s, lambda h: h.whole)


def test_published_aborted_committed_and_replaced_each_answer_at_once():
    st = FakeStore()
    pub, ab, com, other, idle = (Handle(k, 100, bytes([i]) * 8) for i, k in enumerate("pacoi"))
    st.names |= {seg_key("p", pub.token, 50), abort_key("a", ab.token)}
    st.committed.update(c=com.token, o=b"z" * 8)  # "o" was committed by a later reservation
    t0 = time.monotonic()
    assert wait(st, [pub, ab, com, other], 50, 5.0) == [True, False, True, False]
    assert time.monotonic() - t0 < 1.0 and st.polls == 1
    assert ab.dead and other.dead and com.whole and not pub.dead
    t0 = time.monotonic()
    assert wait(st, [idle], 50, 0.1) == [False] and 0.09 <= time.monotonic() - t0 < 1.0  # the deadline
    assert not idle.dead  # not known dead: the caller may wait again
    assert wait(st, [idle], 0, 0.0) == [True]  # nothing to wait for
    assert wait(st, [ab], 0, 0.0) == [False]  # but a dead handle is never ready


def test_a_writer_on_this_machine_that_is_gone_fails_its_waiters():
    st = FakeStore()
    me = current_owner()
    gone = Handle("g", 10, b"g" * 8, boot_id(), Owner(me.pidns, me.pid, me.start + 1))  # same pid, other start
    alive = Handle("l", 10, b"l" * 8, boot_id(), me)
    assert wait(st, [gone, alive], 10, 0.05) == [False, False]
    assert gone.dead and not alive.dead


def test_the_poll_loop_checks_its_arguments():
    h = Handle("k", 10, b"t" * 8)
    for bad in (-1, 11, True, 1.0):
        with pytest.raises(ValueError, match=r"fake: wait_published upto=.* must be an int in \[0, 10\] for 'k'"):
            wait(FakeStore(), [h], bad, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fake: wait_published timeout_s=nan must be >= 0"):
        wait(FakeStore(), [h], 1, float("nan"))


def test_checks_name_the_backend_the_call_and_the_bounds():
    h = Handle("k", 10, b"t" * 8)
    check_upto("x", "publish", h, 10)
    with pytest.raises(ValueError, match=r"x: publish upto=11 must be an int in \[0, 10\] for 'k'"):
        check_upto("x", "publish", h, 11)
    check_timeout("x", 0.0)
    with pytest.raises(ValueError, match="x: wait_published timeout_s=-1 must be >= 0"):
        check_timeout("x", -1)
    with pytest.raises(ValueError, match="1 handles, 2 offsets, 1 buffers: lengths differ"):
        check_lengths([h], [0, 1], [b""])
    check_range("read", h, 4, 6)
    with pytest.raises(ValueError, match=r"read of k: range \[4, 11\) outside the object's 10 bytes"):
        check_range("read", h, 4, 7)


def test_a_head_reads_back_only_under_its_magic():
    me = current_owner()
    raw = pack_head(b"lwtsHED1", b"t" * 8, 123, boot_id(), me)
    assert len(raw) == HEAD.size
    head = unpack_head(b"lwtsHED1", raw)
    assert head is not None and (head.token, head.nbytes, head.boot, head.owner) == (b"t" * 8, 123, boot_id(), me)
    assert unpack_head(b"lwxxHED1", raw) is None and unpack_head(b"lwtsHED1", raw[:-1]) is None
    with pytest.raises(ValueError, match="8 bytes"):
        pack_head(b"short", b"t" * 8, 1, boot_id(), me)


def test_a_quiet_period_starts_on_a_timeout_and_ends():
    q = QuietPeriod(0.05)
    assert not q
    q.start()
    assert q
    time.sleep(0.06)
    assert not q


def test_removals_come_due_in_time_stay_bounded_and_retry_a_bounded_number_of_times():
    from lw_core.backends.segment_stream.policy import MAX_TRIES, RETRY_S
    from lw_core.backends.segment_stream.removals import Removals

    q: Removals[str] = Removals(max_queued=3)
    assert q.next_at() is None and q.take_due(1e9) == []
    assert q.add(["a", "b"], 10.0) == [] and q.add(["m"], 5.0) == []
    assert q.add(["c"], 20.0) == ["a"]  # the oldest goes beyond the bound
    assert len(q) == 3 and q.next_at() == 5.0
    assert [d.item for d in q.take_due(10.0)] == ["b", "m"] and len(q) == 1
    (c,) = q.take_due(20.0)
    q.retry([c], 20.0)
    assert q.next_at() == 20.0 + RETRY_S
    (c,) = q.take_all()
    assert c.tries == 1 and len(q) == 0
    c.tries = MAX_TRIES
    q.retry([c], 30.0)  # refused too often: left to eviction
    assert len(q) == 0
    with pytest.raises(ValueError, match="max_queued=0 must be >= 1"):
        Removals(0)


def test_publish_checks_name_the_handle_the_switch_and_the_lost_keys():
    from lw_core.backend import BackendError, ObjectMissing
    from lw_core.backends.segment_stream.checks import check_publish, require_streaming, unpublishable

    h = Handle("k", 10, b"t" * 8)
    check_publish("x", [h], 10, lambda h: True)
    with pytest.raises(BackendError, match="x: publish needs handles from reserve, got Handle"):
        check_publish("x", [h], 10, lambda h: False)
    with pytest.raises(ValueError, match=r"x: publish upto=11 must be an int in \[0, 10\]"):
        check_publish("x", [h], 11, lambda h: True)
    require_streaming("x", True, "XBackend", "why")
    with pytest.raises(BackendError, match=r"pd_streaming=true \(XBackend\(streaming=True\)\) so that why"):
        require_streaming("x", False, "XBackend", "why")
    e = unpublishable("x", ["a", "b", "c", "d"])
    assert isinstance(e, ObjectMissing) and str(e) == "x: 4 reservation(s) cannot be published: aborted: ['a', 'b', 'c']"


def test_the_reaper_removes_after_the_grace_and_the_rest_at_close():
    import threading

    from lw_core.backends.segment_stream.reaper import Reaper

    removed: list[tuple[float, list[str]]] = []
    done = threading.Event()

    def remove(items):
        removed.append((time.monotonic(), list(items)))
        done.set()

    r: Reaper[str] = Reaper("test-reaper", remove, grace_s=0.2)
    t0 = time.monotonic()
    r.later(["a", "b"])
    time.sleep(0.1)
    assert removed == [] and len(r) == 2  # within the grace
    assert done.wait(5.0)
    assert removed[0][1] == ["a", "b"] and removed[0][0] - t0 >= 0.2 and len(r) == 0
    r.grace_s = 60.0
    r.later(["c"])
    r.close()  # leaving: what waits goes now
    assert removed[-1][1] == ["c"]
    r.later(["d"])  # after close (an abort during close): removed by nobody but queued at once
    assert len(r) == 1
    with pytest.raises(ValueError, match="grace_s=-1 must be >= 0"):
        Reaper("x", remove, grace_s=-1)


def test_the_collector_retries_refused_removals_from_later_calls_and_rests_when_quiet():
    from lw_core.backend import BackendUnavailable
    from lw_core.backends.segment_stream.collector import Collector

    leased = {"s1"}
    calls: list[list[str]] = []
    fail = [False]

    def remove(names):
        calls.append(list(names))
        if fail[0]:
            raise BackendUnavailable("store timed out")
        return [n not in leased for n in names]

    c = Collector("test", remove)
    c.remove(["s0", "s1"])
    assert calls == [["s0", "s1"]] and len(c) == 1  # s1 refused: queued for a retry
    c.collect(every_s=0.0)
    assert len(calls) == 1  # not due yet (RETRY_S)
    c.later(["m"], 0.0)  # e.g. a marker whose keep is over
    fail[0] = True
    c.collect(every_s=0.0)  # the store fails: "m" goes back for a retry
    assert calls[-1] == ["m"] and len(c) == 2
    fail[0] = False
    c.quiet.start()
    c.later(["n"], 0.0)
    c.collect(every_s=0.0)
    assert calls[-1] == ["m"]  # quiet: nothing is tried
    c.quiet.until = 0.0
    c.collect(every_s=0.0)
    assert calls[-1] == ["n"] and len(c) == 2
    c.clear()
    assert len(c) == 0
