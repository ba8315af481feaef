"""The reader's side of the segment-streaming protocol: ``wait_published`` polls, over a store
adapter (``PollStore``), one existence call per poll for each waiting handle's segment ending at
``upto``, its abort marker and its object, with a pause growing from ``POLL_MIN_S`` to
``POLL_MAX_S``. A handle is ready once that segment exists or its object is committed (the backend
adopts it: ``whole``); it is dead (``False`` at once) once its marker exists, the committed object
is not its reservation's, or its writer is judged dead; else it is ``False`` at the deadline.

Handles are the backends' own streaming handles; this module reads ``key``, ``nbytes``, ``token``,
``boot``, ``owner`` and sets ``dead``."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from lw_core.backends.segment_stream.checks import check_timeout, check_upto
from lw_core.backends.segment_stream.names import abort_key, seg_key
from lw_core.procs import Owner, boot_id, current_owner, owner_alive


class PolledHandle(Protocol):
    """What the poll reads and sets of a backend's streaming handle."""

    key: str
    nbytes: int
    token: bytes | None  # None: a handle on a committed object (never polled)
    boot: bytes
    owner: Owner | None
    dead: bool


def _token(h: PolledHandle) -> bytes:
    if h.token is None:
        raise AssertionError(f"segment stream: {h.key!r} is polled without a reservation token")
    return h.token


# A waiter polls the store (one metadata call) with a pause growing from the first to the second.
POLL_MIN_S, POLL_MAX_S = 0.0005, 0.02


class WriterJudge:
    """Whether a writer is known dead: only one on this machine (same boot id) in our pid
    namespace can be judged, each once per poll (``next_poll``); any other is taken as alive and
    its readers fall back to their deadline."""

    def __init__(self) -> None:
        self.me, self.boot = current_owner(), boot_id()
        self._seen: dict[Owner, bool | None] = {}

    def next_poll(self) -> None:
        self._seen.clear()

    def dead(self, boot: bytes, owner: Owner | None) -> bool:
        if owner is None or boot != self.boot:
            return False
        if owner not in self._seen:
            self._seen[owner] = owner_alive(owner, self.me)
        return self._seen[owner] is False


def poll_names(todo: Sequence[PolledHandle], upto: int) -> list[str]:
    """What one poll asks the store whether it exists, for readers' handles (``key``, ``token``):
    each one's segment ending at ``upto``, then each one's abort marker, then each one's object."""
    return ([seg_key(h.key, _token(h), upto) for h in todo] + [abort_key(h.key, _token(h)) for h in todo]
            + [h.key for h in todo])


def read_poll(todo: Sequence[PolledHandle], exists: Sequence[int], judge: WriterJudge) -> tuple[list[int], list[int]]:
    """The answer to ``poll_names(todo, upto)`` (1 = exists), per handle (``dead``, ``boot``,
    ``owner``): marks aborted handles and those whose writer is judged dead (``dead = True``), and
    returns the indices into ``todo`` of the committed ones and of those published up to ``upto``."""
    n = len(todo)
    judge.next_poll()
    committed: list[int] = []
    published: list[int] = []
    for j, h in enumerate(todo):
        if exists[n + j] == 1:
            h.dead = True  # aborted
        elif exists[2 * n + j] == 1:
            committed.append(j)
        elif exists[j] == 1:
            published.append(j)
        elif judge.dead(h.boot, h.owner):
            h.dead = True  # the writer is gone and never commits
    return committed, published


H = TypeVar("H", bound=PolledHandle)
H_contra = TypeVar("H_contra", contravariant=True)


class PollStore(Protocol[H_contra]):
    """What ``wait_published`` needs of a backend's store."""

    def exists(self, names: list[str]) -> list[int]:
        """1 where the object exists, 0 where not, one answer per name (else raise)."""
        ...

    def adopt(self, handles: Sequence[H_contra]) -> None:
        """Handles whose key the poll found committed: make ``whole`` true for those that are this
        reservation's object, and set ``dead`` on the others."""
        ...


def wait_published(who: str, store: PollStore[H], handles: Sequence[H], upto: int, timeout_s: float,
                   whole: Callable[[H], bool]) -> list[bool]:
    """``StreamingBackend.wait_published`` for ``handles`` (already checked to be the backend's
    streaming handles); ``whole(h)``: ``h`` reads the committed object now."""
    hs = list(handles)
    for h in hs:
        check_upto(who, "wait_published", h, upto)
    check_timeout(who, timeout_s)
    deadline = time.monotonic() + timeout_s
    pause = POLL_MIN_S
    judge = WriterJudge()
    ready = [not h.dead and (upto == 0 or whole(h)) for h in hs]
    while True:
        at = [i for i, h in enumerate(hs) if not ready[i] and not h.dead]
        if at:
            todo = [hs[i] for i in at]
            committed, published = read_poll(todo, store.exists(poll_names(todo, upto)), judge)
            for j in published:
                ready[at[j]] = True
            if committed:
                store.adopt([todo[j] for j in committed])
                ready = [r or whole(h) for h, r in zip(hs, ready)]
        left = deadline - time.monotonic()
        if left <= 0 or all(r or h.dead for h, r in zip(hs, ready)):
            return [r and not h.dead for h, r in zip(hs, ready)]
        time.sleep(min(pause, left))
        pause = min(pause * 2, POLL_MAX_S)
