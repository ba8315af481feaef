"""Streaming PD, decoder worker side (docs/guide/streaming-pd.md §2): pull a request's prompt chunks
layer by layer while the prefiller still computes them.

vLLM's async-load flow: the scheduler parks the request in ``WAITING_FOR_REMOTE_KVS`` with blocks
for the whole prompt; ``StreamReceiver.start`` queues one receive per request for a small pool of
worker threads (``stream_recv_threads``, off the forward pass); ``take_done`` hands finished
receives to ``get_finished`` (``finished_recving``) together with the blocks that did not load
(``get_block_ids_with_load_errors``, same pass), which vLLM recomputes. Every started receive ends,
by ``deadline_s`` after ``start`` at the latest (time spent queued counts), and is reported exactly
once, also when its request was aborted meanwhile (vLLM frees the blocks only then).

One receive: ``open_streaming`` the keys, retrying with backoff while a key has neither a
reservation nor an object yet (the prefiller has not reserved it); per layer ``wait_published``
for the opened chunks still good and a ranged ``read`` into that layer's blocks, while the keys
not opened yet are tried again between layers (a prompt prefilled in several steps is pulled step
by step: ``Receive``). Chunks are chained, so the good chunks are always a prefix: a chunk that
cannot be opened, whose layer is not published in time (deadline, aborted reservation, dead
prefiller) or whose read fails ends the prefix there; later chunks are failed too.

Once the prefill is reported done (``prefilled``: the metaserver's ok answer, which the prefiller
gives only after committing what it saved), a key still neither reserved nor committed never will
be (its reservation was refused, the prefiller does not save that chunk, e.g. a partial chunk with
``discard_partial_chunks``, or it names its objects otherwise: another model, layout or pool): the
receive tries to open the missing keys once more, after the report, and a chunk still missing then
ends the prefix at once instead of at the deadline.

The pool does not starve: a receive is a resumable state (``Receive``), and a worker waits for it
one slice at a time (an open retry's pause, or ``WAIT_SLICE_S`` of ``wait_published``). When a
slice brought nothing and other receives are queued, the worker puts it back at the end of the
queue and takes the next one, so receives waiting for a prefill that comes later (or never) cannot
hold the workers while another's layers are already published (no head-of-line blocking). With no
one queued a worker stays on its receive, as a thread of its own would.

A receive may carry a ``tail``: one more object to land after every chunk did, a recurrent-state
model's state at the last chunk's boundary (``state_store``), which the prefiller saves whole
after its forward, so after the chunks' layers are published. It is tried with the open backoff
until it lands; it is missing for good at the deadline, or when one try made after the prefill was
reported done still misses it (the prefiller saves it before its answer). A tail that does not land
fails the whole receive (``good`` 0): the chunks are no use without it.

A receive that ``holds`` (the request continues from the prefill's first token, which comes with
the metaserver's answer: ``lw_vllm.pd.first_token``) is not reported when everything landed but
once the prefill is reported done too, or at its deadline: vLLM schedules a request as soon as its
receive is reported, and the token must be the request's before that. It waits one slice at a time
like a layer wait, so it keeps no worker from a receive with work to do. Cancelled while it holds
(its prefill failed, the request finished), its landed chunks still count.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lw_core.backend import BackendError
from lw_core.plan import ObjectLayout

log = logging.getLogger(__name__)

OPEN_BACKOFF_S = (0.0005, 0.02)  # first and longest pause between open_streaming retries
# While requests are parked receiving and the step ran nothing, vLLM spins through empty steps
# (more than a core on a shared host, starving the prefiller being waited for): such a step waits
# up to this long for a receive to end. A new request is then scheduled at most this much later.
IDLE_WAIT_S = 0.005
# A layer wait is cut in slices this long, so a cancel (request aborted, prefill failed) ends it,
# and so a worker can turn to another queued receive.
WAIT_SLICE_S = 0.05


@dataclass(slots=True)
class RecvDone:
    req_id: str
    block_ids: list[int]
    good: int  # leading chunks whose every layer landed
    span: tuple[float, float]  # wall clock: receive start, end
    error: str | None = None
    nbytes: int = 0  # bytes read from the pool (into the KV cache)
    tail_landed: bool = False  # the receive's tail (a recurrent state) landed: one object more

    @property
    def failed_blocks(self) -> list[int]:
        return self.block_ids[self.good:]


def _never() -> bool:
    return False


# A receive's last object (``Receive``): tries to land it; None when it did, else why not (yet).
Tail = Callable[[], "str | None"]


class Receive:
    """One request's receive, advanced by ``advance`` until it ends (``result``).

    Each chunk has its own layer frontier (``next_layer``): the receive pulls, one layer batch at a
    time, the lowest layer any opened chunk still lacks, for every opened chunk at that layer, and
    between batches opens the chunks not opened yet. So a prompt the prefiller reserves in several
    steps (chunked prefill) is pulled step by step, each step's layers while that step computes,
    and chunks opened late catch up before the rest go on together."""

    def __init__(self, keys: Sequence[str], block_ids: Sequence[int], deadline: float,
                 stop: threading.Event, tail: Tail | None = None, tail_nbytes: int = 0,
                 holds: bool = False) -> None:
        self.keys, self.block_ids, self.deadline, self.stop = list(keys), list(block_ids), deadline, stop
        self.holds = holds  # ends only once ``prefilled`` too (module docstring)
        self.landed = False  # every chunk that can still be good landed, and the tail: it holds
        self.tail = tail  # landed once every chunk did (module docstring); None once it has
        self.tail_nbytes = tail_nbytes  # counted in ``nbytes`` once it landed
        self.tail_landed = False
        self._next_tail = 0.0
        self._tail_pause = OPEN_BACKOFF_S[0]
        self.handles: list[Any] = [None] * len(self.keys)  # opened so far
        self.next_layer = [0] * len(self.keys)
        self.limit = len(self.keys)  # chunks from here on cannot be good any more
        self.pause = OPEN_BACKOFF_S[0]
        self._next_open = 0.0  # monotonic time of the next open_streaming try
        self.prefilled = threading.Event()  # the prefill is done: what is missing now never comes
        self._last_open = False  # the one open try after ``prefilled`` was made
        self.error: str | None = None
        self.result: tuple[int, str | None] | None = None
        self.nbytes = 0  # read from the pool so far

    def advance(self, backend: Any, copier: Any, layout: ObjectLayout,
                others_waiting: Callable[[], bool] = _never) -> bool:
        """Run until the receive ends (True; ``result`` is set) or until a wait slice brought
        nothing while ``others_waiting()`` (False: call again later)."""
        nl = layout.num_layers
        while True:
            if self.stop.is_set():
                if self.landed:
                    return self._end(self.limit, self.error)
                return self._end(0, "request finished before its prompt arrived")
            last = self.prefilled.is_set() and not self._last_open
            if last:
                self._next_open = 0.0  # one more try, now that the prefiller committed what it saved
            self._open_more(backend)
            if last:
                self._last_open = True
                missing = next((i for i in range(self.limit) if self.handles[i] is None), None)
                if missing is not None:
                    self._cut(missing, f"chunk {missing} of {len(self.keys)} was neither reserved nor committed "
                                       "when its prefill was reported done")
            opened = next((i for i, h in enumerate(self.handles[:self.limit]) if h is None), self.limit)
            todo = [i for i in range(opened) if self.next_layer[i] < nl]
            if not todo:
                if opened >= self.limit:  # every chunk that can still be good has landed
                    if self.tail is None or self.limit < len(self.keys):
                        if not self._hold():
                            return self._end(self.limit, self.error)
                        if others_waiting():
                            return False
                        continue
                    if self._land_tail(others_waiting):
                        return self.result is not None
                    continue
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self._cut(opened, f"chunk {opened} of {len(self.keys)} was never reserved nor committed in time")
                    continue
                self.stop.wait(max(0.0, min(self._next_open - time.monotonic(), left)))
                if others_waiting():
                    return False
                continue
            layer = min(self.next_layer[i] for i in todo)
            idx = [i for i in todo if self.next_layer[i] == layer]
            upto = layout.offsets[layer] + layout.layer_nbytes[layer]
            try:
                ok, final = _wait_slice(backend, [self.handles[i] for i in idx], upto, self.deadline, self.stop)
            except BackendError as e:
                ok, final = [False] * len(idx), True
                self.error = self.error or f"wait for layer {layer}: {e}"
            if self.stop.is_set() and not all(ok):
                return self._end(0, "cancelled: the request finished or its prefill failed")
            if not final:
                if others_waiting():
                    return False
                continue
            bad = next((j for j, o in enumerate(ok) if not o), None)
            if bad is not None:
                self._cut(idx[bad], f"layer {layer} of chunk {idx[bad]} was not published in time (or was abandoned)")
                idx = idx[:bad]
            if idx:
                got, nbytes = _read_layer(backend, copier, layout, layer, [self.handles[i] for i in idx],
                                          [self.block_ids[i] for i in idx])
                self.nbytes += nbytes
                if got < len(idx):
                    self._cut(idx[got], f"read of layer {layer} of chunk {idx[got]} failed")
                for i in idx[:got]:
                    self.next_layer[i] = layer + 1

    def _land_tail(self, others_waiting: Callable[[], bool]) -> bool:
        """One try at the tail when its backoff pause is over, else a wait for it. True when the
        caller returns: the receive ended (``result`` set) or others wait (it comes back later)."""
        assert self.tail is not None
        now = time.monotonic()
        if now >= self._next_tail:
            after_done = self.prefilled.is_set()  # the prefiller saved it before its answer
            why = self.tail()
            if why is None:  # the caller goes on: the receive ends, or holds (``_hold``)
                self.tail, self.tail_landed = None, True
                self.nbytes += self.tail_nbytes
                return False
            if after_done:
                return self._end(0, f"the last chunk's recurrent state was not there when its prefill was "
                                    f"reported done ({why})")
            if time.monotonic() >= self.deadline:
                return self._end(0, f"the last chunk's recurrent state did not land in time ({why})")
            self._tail_pause = min(self._tail_pause * 2, OPEN_BACKOFF_S[1])
            self._next_tail = time.monotonic() + self._tail_pause
        left = self.deadline - time.monotonic()
        wait = max(0.0, min(self._next_tail - time.monotonic(), left))
        if self.prefilled.is_set():
            wait = 0.0  # the one more try, now
            self._next_tail = 0.0
        self.stop.wait(wait)
        if left <= 0:
            self._next_tail = 0.0  # a last try at the deadline, then it fails
        return others_waiting()

    def _hold(self) -> bool:
        """Everything landed: a receive that ``holds`` waits one slice for ``prefilled`` (True: the
        caller looks again); False: it ends now (it does not hold, the answer came, or the deadline
        passed: the request then computes its own first token)."""
        if not self.holds or self.prefilled.is_set():
            return False
        self.landed = True
        left = self.deadline - time.monotonic()
        if left <= 0:
            return False
        self.prefilled.wait(min(left, WAIT_SLICE_S))
        return True

    def _open_more(self, backend: Any) -> None:
        """Try to open the chunks below ``limit`` not opened yet, at most once per backoff pause
        (0.5 ms doubling to 20 ms while nothing new opens)."""
        missing = [i for i in range(self.limit) if self.handles[i] is None]
        now = time.monotonic()
        if not missing or now < self._next_open:
            return
        try:
            got = backend.open_streaming([self.keys[i] for i in missing])
        except BackendError as e:
            log.debug("open_streaming failed (retrying until the deadline): %s", e)
            got = [None] * len(missing)
        new = False
        for i, h in zip(missing, got):
            self.handles[i] = h
            new = new or h is not None
        self.pause = OPEN_BACKOFF_S[0] if new else min(self.pause * 2, OPEN_BACKOFF_S[1])
        self._next_open = time.monotonic() + self.pause

    def _cut(self, chunk: int, error: str) -> None:
        """Chunks are chained: from ``chunk`` on nothing can be good."""
        if chunk < self.limit:
            self.limit = chunk
            self.error = self.error or error

    def _end(self, good: int, error: str | None) -> bool:
        self.result = (good, error)
        return True

    def release(self, backend: Any) -> None:
        held = [h for h in self.handles if h is not None]
        self.handles = [None] * len(self.keys)
        if held:
            try:
                backend.release(held)
            except BackendError as e:
                log.debug("release of streaming handles failed: %s", e)


def receive(backend: Any, copier: Any, layout: ObjectLayout, keys: Sequence[str], block_ids: Sequence[int],
            deadline: float, stop: threading.Event, tail: Tail | None = None) -> tuple[int, str | None]:
    """Pull ``keys[i]`` into block ``block_ids[i]``, layer by layer, then ``tail``, on this thread;
    returns (good prefix, error)."""
    r = Receive(keys, block_ids, deadline, stop, tail)
    try:
        while not r.advance(backend, copier, layout):
            pass
        assert r.result is not None
        return r.result
    finally:
        r.release(backend)


def _wait_slice(backend: Any, handles: list[Any], upto: int, deadline: float,
                stop: threading.Event) -> tuple[list[bool], bool]:
    """One ``wait_published`` of at most a slice; returns (answer, final). A ``False`` answered
    well before its slice ended is final (abandoned reservation, dead writer), and so is any
    answer at the deadline or after a cancel."""
    left = deadline - time.monotonic()
    step = max(0.0, min(left, WAIT_SLICE_S))
    t0 = time.monotonic()
    ok = list(backend.wait_published(handles, upto, step))
    final = all(ok) or left <= WAIT_SLICE_S or stop.is_set() or time.monotonic() - t0 < step / 2
    return ok, final


def _read_layer(backend: Any, copier: Any, layout: ObjectLayout, layer: int, handles: list[Any],
                blocks: list[int]) -> tuple[int, int]:
    """Read one layer of each handle into its block; returns how many leading ones landed and the
    bytes that landed. Blocks vLLM will not read (a hybrid's sliding-window layers outside the
    window: ``copier.unread``) are neither read from the pool nor copied; they count as landed."""
    unread = getattr(copier, "unread", None)
    skip = unread(layer, blocks) if unread is not None else None
    if skip is not None and any(skip):
        keep = [j for j, s in enumerate(skip) if not s]
        got, nbytes = _read_layer(backend, copier, layout, layer, [handles[j] for j in keep],
                                  [blocks[j] for j in keep])
        return (len(blocks) if got == len(keep) else keep[got]), nbytes
    off, nb = layout.offsets[layer], layout.layer_nbytes[layer]
    direct = copier.kv_views(layer, blocks)
    if direct is not None:
        dsts = direct
        buf = None
    else:
        buf = np.empty(len(blocks) * nb, dtype=np.uint8)
        dsts = [buf[j * nb:(j + 1) * nb] for j in range(len(blocks))]
    good = len(handles)
    try:
        backend.read(handles, [off] * len(handles), dsts)
    except BackendError:
        good = 0
        for j, h in enumerate(handles):  # find the first one that fails; the rest are chained after it
            try:
                backend.read([h], [off], [dsts[j]])
            except BackendError:
                break
            good = j + 1
    if buf is not None and good:
        tok = copier.to_kv(layer, blocks[:good], dsts[:good])
        if not copier.wait(tok, 30.0):
            return 0, 0
    return good, good * nb


@dataclass(slots=True, eq=False)
class _Job:
    req_id: str
    recv: Receive
    t0: float  # wall clock at start


class StreamReceiver:
    """Receives run by at most ``threads`` worker threads (started as needed); results are
    collected by ``take_done``."""

    def __init__(self, backend: Any, copier: Any, layout: ObjectLayout, deadline_s: float, *,
                 threads: int = 4) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"StreamReceiver: threads={threads!r} must be an int >= 1 (stream_recv_threads)")
        self.backend, self.copier, self.layout, self.deadline_s = backend, copier, layout, deadline_s
        self.threads = threads
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)
        self._work = threading.Condition(self._lock)
        self._queue: collections.deque[_Job] = collections.deque()
        self._running: dict[str, _Job] = {}  # started, not yet reported done (queued or on a worker)
        self._done: list[RecvDone] = []
        self._workers: list[threading.Thread] = []
        self._idle = 0
        self._closing = False

    def start(self, req_id: str, keys: Sequence[str], block_ids: Sequence[int], tail: Tail | None = None,
              tail_nbytes: int = 0, holds: bool = False) -> None:
        """``tail``: landed after every chunk (``Receive``), on a receive worker thread; its
        ``tail_nbytes`` count in the receive's bytes once it has. ``holds``: reported only once
        ``prefilled`` too, or at the deadline (``Receive``)."""
        with self._lock:
            if req_id in self._running:
                raise RuntimeError(f"streaming receive for {req_id} started twice")
            if self._closing:  # shutting down: reported failed at once, never parked for good
                now = time.time()
                self._done.append(RecvDone(req_id, list(block_ids), 0, (now, now), "the receiver is closed"))
                self._ended.notify_all()
                return
            job = _Job(req_id, Receive(keys, block_ids, time.monotonic() + self.deadline_s, threading.Event(), tail,
                                        tail_nbytes, holds),
                       time.time())
            self._running[req_id] = job
            self._queue.append(job)
            # ``_idle`` may still count a worker that was woken but has not taken its job yet:
            # compare with the queue, not with zero, so a burst of starts still gets its workers.
            if len(self._queue) > self._idle and len(self._workers) < self.threads:
                t = threading.Thread(target=self._work_loop, name=f"lw-recv-{len(self._workers)}", daemon=True)
                self._workers.append(t)
                t.start()
            self._work.notify()

    def _others_waiting(self) -> bool:
        return bool(self._queue)

    def _work_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._idle += 1
                    self._work.wait()
                    self._idle -= 1
                if not self._queue:
                    return
                job = self._queue.popleft()
            self._step(job)

    def _step(self, job: _Job) -> None:
        r = job.recv
        try:
            ended = r.advance(self.backend, self.copier, self.layout, self._others_waiting)
        except Exception as e:  # a bug must cost a recompute, never a request parked for good
            log.exception("lw-vllm: streaming receive of %s failed", job.req_id)
            ended, r.result = True, (0, f"receive failed: {e!r}")
        if not ended:
            with self._lock:
                self._queue.append(job)
            return
        r.release(self.backend)
        good, error = r.result or (0, "receive ended without a result")
        with self._lock:
            self._running.pop(job.req_id, None)
            self._done.append(RecvDone(job.req_id, r.block_ids, good, (job.t0, time.time()), error, r.nbytes,
                                       r.tail_landed))
            self._ended.notify_all()

    def prefilled(self, req_ids: set[str]) -> None:
        """The prefills of these requests are done (the metaserver answered ok): each receive opens
        its missing keys once more, and what is still missing fails at once (vLLM recomputes it)."""
        with self._lock:
            for rid in req_ids:
                job = self._running.get(rid)
                if job is not None:
                    job.recv.prefilled.set()

    def cancel(self, req_ids: set[str]) -> None:
        """Requests that finished (aborted) while receiving: stop soon (a queued one goes to the
        front of the queue); they are still reported."""
        with self._lock:
            for rid in req_ids:
                job = self._running.get(rid)
                if job is None:
                    continue
                job.recv.stop.set()
                if job in self._queue:
                    self._queue.remove(job)
                    self._queue.appendleft(job)

    def take_done(self, idle_wait_s: float = 0.0) -> list[RecvDone]:
        """Ended receives; with ``idle_wait_s``, wait that long for one while some still run."""
        with self._lock:
            if idle_wait_s > 0 and not self._done and self._running:
                self._ended.wait(idle_wait_s)
            out, self._done = self._done, []
        return out

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._running)

    @property
    def worker_count(self) -> int:
        with self._lock:
            return len(self._workers)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop every receive (each is still reported) and end the workers."""
        with self._lock:
            self._closing = True
            for job in self._running.values():
                job.recv.stop.set()
            workers = list(self._workers)
            self._work.notify_all()
        end = time.monotonic() + timeout_s
        for t in workers:
            t.join(max(0.0, end - time.monotonic()))
