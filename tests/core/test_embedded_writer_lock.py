"""``WriterLock`` alone: the writer lock across processes (an flock with a deadline), across one
backend's threads, re-entry while re-attaching (``exclusive``), and ``create.lock``'s longer wait."""

from __future__ import annotations

import fcntl
import os
import threading

import pytest

from lw_core.backend import BackendUnavailable
from lw_core.backends.embedded.records import CREATE_BYTES_PER_S
from lw_core.backends.embedded.writer_lock import WriterLock


@pytest.fixture
def lock(tmp_path):
    lk = WriterLock(str(tmp_path), timeout_s=0.2, capacity=4 << 20)
    lk.open_files()
    yield lk
    lk.close_files()


def _other_holder(path: str, name: str) -> int:
    """Another open file description holding the flock (as another process would)."""
    fd = os.open(os.path.join(path, name), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_opens_both_lock_files_in_the_pool_directory(lock, tmp_path):
    assert sorted(os.listdir(tmp_path)) == ["create.lock", "writer.lock"]


def test_writer_lock_held_elsewhere_past_the_timeout_is_unavailable_naming_the_timeout(lock, tmp_path):
    fd = _other_holder(str(tmp_path), "writer.lock")
    try:
        with pytest.raises(BackendUnavailable, match=r"writer lock for more than lock_timeout_s=0.2s"):
            with lock.locked():
                pass
    finally:
        os.close(fd)
    with lock.locked():  # free again: taken at once
        pass


def test_writer_lock_is_released_after_the_block_even_on_error(lock, tmp_path):
    with pytest.raises(RuntimeError):
        with lock.locked():
            raise RuntimeError("boom")
    fd = _other_holder(str(tmp_path), "writer.lock")  # would raise BlockingIOError if still held
    os.close(fd)


def test_another_thread_holding_it_makes_this_one_wait_then_fail(lock):
    held, done = threading.Event(), threading.Event()

    def hold():
        with lock.locked():
            held.set()
            done.wait(5)

    t = threading.Thread(target=hold)
    t.start()
    try:
        held.wait(5)
        with pytest.raises(BackendUnavailable, match="writer lock busy in this process for 0.2s"):
            with lock.locked():
                pass
    finally:
        done.set()
        t.join()


def test_exclusive_lets_its_own_thread_take_the_writer_lock_and_keeps_others_out(lock):
    errors: list[BaseException] = []

    def other():
        try:
            with lock.locked():
                pass
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with lock.exclusive():
        with lock.locked():  # nested in the same thread: no self-deadlock
            pass
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert len(errors) == 1 and isinstance(errors[0], BackendUnavailable)
    with lock.locked():  # exclusive() gave the thread lock back
        pass


def test_create_lock_waits_longer_for_a_bigger_arena_and_names_the_file(tmp_path):
    cap = int(0.3 * CREATE_BYTES_PER_S)
    lk = WriterLock(str(tmp_path), timeout_s=0.1, capacity=cap)
    lk.open_files()
    fd = _other_holder(str(tmp_path), "create.lock")
    try:
        with pytest.raises(BackendUnavailable, match=r"create\.lock.* more than 0\.4s") as e:
            with lk.create_locked():
                pass
        assert f"time to create {cap} bytes" in str(e.value)
    finally:
        os.close(fd)
        lk.close_files()
