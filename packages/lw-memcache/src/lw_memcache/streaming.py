"""The optional streaming extension of ``MemcacheBackend`` (rules: ``lw_core.backend``).

memcache-hybrid only lets a client copy out of objects it holds a *read lease* on, and only
committed objects take one: an unfinished object cannot be read at its address at all (the
client's blob tracker refuses it, -3101/-3102), not even by its writer. And an address proves
nothing: an aborted object's space (once its write lease ends) and an orphaned key's space (taken
over by the next writer) are handed out again at the same address. So a published prefix is made
of separate *committed* objects whose names carry a random per-reservation token:

* ``reserve`` (streaming backend) draws an 8-byte token per reservation, writes it into the last
  ``TRAILER`` bytes of the object (every object is allocated ``nbytes + TRAILER``), and commits a
  small head object ``<key>#h`` naming the token, the size and the writer (boot id, pid
  namespace, pid, start time).
* ``write`` also copies each range into a segment object ``<key>#s<token>/<end>`` (allocated, not
  committed): the prefiller's bytes go to the pool twice while streaming is on.
* ``publish(upto)`` commits the segments that end at or before ``upto``.
* ``commit`` commits the object; ``abort`` (and ``close`` with reservations open) first commits an
  abort marker ``<key>#x<token>``. Either way the head and the segments are removed
  ``REMOVE_GRACE_S`` later, by the reaper (``lw_core.backends.segment_stream.reaper``; at once at
  ``close``): memcache removes leased
  objects too, and a reader's lease on an object removed under it outlives its release in
  memcache-hybrid 1.3.0 (the client keeps renewing it, -3102), so that reader's client can lease
  nothing placed at that address again until the lease ends: the next prompt's head or segment
  landing there would fail to stream. Readers hold leases on heads and segments for one copy, far
  shorter than the grace (the clean-up policy, shared with Mooncake, is
  ``lw_core.backends.segment_stream.policy``).

A reader (``open_streaming``) takes the committed object with a lease when there is one, else reads
the head for the token. ``read`` of a range leases the segment named by the token and the range's
end (reads follow the writer's write ranges: the pipeline writes and reads one layer of an object
per call), copies, checks the segment still exists, and drops the lease: bytes come only from
objects named by this reservation's token, which only its writer creates, while they are leased
and not removed. Once the object is committed the reader leases it and checks its trailer holds
the token (a later reservation of the key writes its own token there before any data), then reads
it whole. ``wait_published`` (``lw_core.backends.segment_stream.poll``) polls (0.5 ms up to
20 ms) whether the segment ending at ``upto`` exists; it answers ``False`` promptly when the abort
marker exists, when the committed object carries another token, or when the writer runs on this
machine and is dead; else at the deadline.

An abandoned reservation never becomes visible: only its writer's ``batch_write_finish`` commits
the object (``lookup``/``open`` are unchanged). Costs while streaming: per ``write`` one more
allocation and copy, per ``publish`` one ``batch_write_finish``, per streaming ``read`` four
metadata calls (lease, info, exists, unlease) for the batch.
"""

from __future__ import annotations

import logging
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lw_core.backend import BackendError
from lw_core.backends.segment_stream import abort_key, head_key, seg_key
from lw_core.backends.segment_stream.checks import check_publish, require_streaming, unpublishable
from lw_core.backends.segment_stream.head import HEAD, TOKEN_BYTES, pack_head
from lw_core.backends.segment_stream.policy import REMOVE_GRACE_S
from lw_core.procs import Owner, boot_id, current_owner

log = logging.getLogger(__name__)

TRAILER = 16  # bytes after each object's data: magic + the reservation's token
_TRAILER = struct.Struct("<8s8s")
_TRAILER_MAGIC = b"lwmcTOK1"
HEAD_MAGIC = b"lwmcHED1"  # the head's layout: lw_core.backends.segment_stream.head
_MARKER_BYTES = 64
_FINISH_OK = 0
MEDIA_DRAM = 1


@dataclass(eq=False, slots=True)
class _Seg:
    """A segment object the writer allocated: duck-types as a writable MemcacheHandle for _copy."""

    key: str
    nbytes: int
    gva: int
    start: int
    writable: bool = True
    published: bool = False


@dataclass(eq=False, slots=True)
class WriteStream:
    token: bytes
    segs: dict[int, _Seg] = field(default_factory=dict)  # by end offset
    head: bool = False
    head_gva: int = 0


@dataclass(eq=False, slots=True)
class MemcacheStreamHandle:
    """A reader's handle from ``open_streaming``: on a committed object (``leased``, read at
    ``gva``) or on a reservation (``token``)."""

    key: str
    nbytes: int
    token: bytes | None
    boot: bytes = b""
    owner: Owner | None = None
    gva: int = 0
    leased: bool = False
    dead: bool = False
    writable: bool = False


class StreamMixin:
    """The writer's side of streaming for MemcacheBackend: the hooks of reserve/write/commit/abort
    and ``publish``; the reader's side is ``lw_memcache.stream_read.StreamReadMixin``."""

    # ----- writer side (hooks called by MemcacheBackend) -----

    def _stream_start(self: Any, handles: Sequence[Any]) -> None:
        """After ``reserve``: token into each object's trailer, then its head object."""
        hs = [h for h in handles if h is not None]
        if not self._streaming or not hs:
            return
        streams = {h.key: WriteStream(secrets.token_bytes(TOKEN_BYTES)) for h in hs}
        trailers = np.frombuffer(b"".join(_TRAILER.pack(_TRAILER_MAGIC, streams[h.key].token) for h in hs), np.uint8).copy()
        tails = [trailers[i * TRAILER : (i + 1) * TRAILER] for i in range(len(hs))]
        # Written before any data and before the handle is returned: a later reservation of the
        # same space is told apart from this one from now on.
        self._copy([_Seg(h.key, h.nbytes + TRAILER, h.gva, 0) for h in hs], [h.nbytes for h in hs], tails, to_store=True)
        with self._lock:
            self._wstreams.update(streams)
        store = self._store
        heads = [head_key(h.key) for h in hs]
        stale = [k for k, r in zip(heads, store.batch_is_exist(heads)) if r == 1]
        if stale:  # a dead or aborted writer's head: this reservation replaces it
            store.remove_batch(stale)
        gvas = store.batch_alloc(heads, [HEAD.size] * len(heads), MEDIA_DRAM, self._write_lease_ms)
        me, boot = current_owner(), boot_id()
        ok = [(h, hk, g) for h, hk, g in zip(hs, heads, gvas) if g > 0]
        failed = [hk for (hk, g) in zip(heads, gvas) if g <= 0]
        if failed:
            store.remove_batch(failed)  # readers find these only once committed
        if not ok:
            return
        bufs = [
            np.frombuffer(pack_head(HEAD_MAGIC, streams[h.key].token, h.nbytes, boot, me), np.uint8).copy()
            for h, _, _ in ok
        ]
        try:
            self._copy([_Seg(hk, HEAD.size, g, 0) for _, hk, g in ok], [0] * len(ok), bufs, to_store=True)
        except BackendError:
            store.batch_write_finish([hk for _, hk, _ in ok], [1] * len(ok))
            raise
        keys = [hk for _, hk, _ in ok]
        res = store.batch_write_finish(keys, [_FINISH_OK] * len(keys))
        store.batch_remove_lease([k for k, r in zip(keys, res) if r == 0])
        with self._lock:
            for (h, _, g), r in zip(ok, res):
                streams[h.key].head, streams[h.key].head_gva = r == 0, int(g)

    def _stream_write(self: Any, handles: Sequence[Any], offsets: Sequence[int], srcs: Sequence[Any]) -> None:
        """After ``write``: the same ranges into the reservations' segment objects."""
        todo: list[tuple[WriteStream, Any, int, Any]] = []
        with self._lock:
            for h, off, src in zip(handles, offsets, srcs):
                ws = self._wstreams.get(h.key)
                if ws is not None:
                    todo.append((ws, h, off, src))
        if not todo:
            return
        new: dict[str, tuple[WriteStream, int, int]] = {}
        for ws, h, off, src in todo:
            n = _nbytes(src)
            seg = ws.segs.get(off + n)
            if seg is not None and (seg.start != off or seg.published):
                raise BackendError(
                    f"memcache streaming: write of {h.key} [{off}, {off + n}) overlaps a range written or published "
                    "before with another split; a streaming writer writes each range once"
                )
            if seg is None and n > 0:
                new[seg_key(h.key, ws.token, off + n)] = (ws, off, n)
        if new:
            keys = list(new)
            gvas = self._store.batch_alloc(keys, [new[k][2] for k in keys], MEDIA_DRAM, self._write_lease_ms)
            failed = []
            with self._lock:  # the pipeline writes several layers of an object at once
                for k, g in zip(keys, gvas):
                    ws, off, n = new[k]
                    if g > 0:
                        ws.segs[off + n] = _Seg(k, n, int(g), off)
                    else:
                        failed.append(k)
            if failed:  # no room: those ranges are not streamed; readers get them at commit
                self._store.remove_batch(failed)
        segs, bufs = [], []
        for ws, _h, off, src in todo:
            seg = ws.segs.get(off + _nbytes(src))
            if seg is not None and seg.start == off:
                segs.append(seg)
                bufs.append(src)
        if segs:
            self._copy(segs, [0] * len(segs), bufs, to_store=True)

    def _stream_end(self: Any, handles: Sequence[Any], *, aborted: bool) -> None:
        """Before abort (marker first: waiters fail at once) and after commit: drop the head and
        the segments. Best effort: what is left is never readable past a marker or a commit."""
        with self._lock:
            ended = [(h.key, self._wstreams.pop(h.key)) for h in handles if h.key in self._wstreams]
        if not ended:
            return
        store = self._store
        try:
            if aborted:
                marks = [abort_key(k, ws.token) for k, ws in ended]
                gvas = store.batch_alloc(marks, [_MARKER_BYTES] * len(marks), MEDIA_DRAM, self._write_lease_ms)
                done = [m for m, g in zip(marks, gvas) if g > 0]
                if done:
                    store.batch_write_finish(done, [_FINISH_OK] * len(done))
                    store.batch_remove_lease(done)
            unfinished = [s.key for _, ws in ended for s in ws.segs.values() if not s.published]
            if unfinished:  # never readable, so never leased: dropped now
                store.batch_write_finish(unfinished, [1] * len(unfinished))
        except Exception as e:  # noqa: BLE001 - leftovers are unreadable and get evicted
            log.debug("memcache streaming: cleaning up after %s failed: %s", "abort" if aborted else "commit", e)
        heads = [(head_key(k), ws.head_gva) for k, ws in ended if ws.head]
        segs = [s.key for _, ws in ended for s in ws.segs.values() if s.published]
        if heads or segs:
            self._remove_later(heads, segs)

    # ----- removal after the grace (see the module docstring): the reaper calls _remove_now -----

    def _remove_later(self: Any, heads: list[tuple[str, int]], segs: list[str]) -> None:
        """Hand heads (with the address we wrote each at) and segments (address None) to the reaper."""
        dropped = self._reaper.later([*heads, *((s, None) for s in segs)])
        if dropped:
            log.warning("memcache streaming: removal queue full; %d object(s) left to eviction, first %s",
                        len(dropped), dropped[0][0])

    def _remove_now(self: Any, items: Sequence[tuple[str, int | None]]) -> None:
        """Remove segments (named by a token only their writer has) and heads that are still the
        ones this client wrote (same address, and no reservation of ours has the key again)."""
        heads = [(k, g) for k, g in items if g is not None]
        gone = [k for k, g in items if g is None]
        store = self._store
        try:
            if heads:
                with self._lock:
                    mine = set(self._wstreams)
                infos = store.batch_get_key_info([k for k, _ in heads], 0)
                for (k, g), info in zip(heads, infos):
                    at = list(info.gva_list()) if info.size() else []
                    if at and int(at[0]) == g and k[: -len(head_key(""))] not in mine:
                        gone.append(k)
            if gone:
                store.remove_batch(gone)
        except Exception as e:  # noqa: BLE001 - leftovers are unreadable and get evicted
            log.debug("memcache streaming: removing %d finished stream object(s) failed: %s", len(gone), e)

    # ----- StreamingBackend -----

    def publish(self: Any, handles: Sequence[Any], upto: int) -> None:
        store = self._live()
        check_publish("memcache", handles, upto,
                      lambda h: not isinstance(h, MemcacheStreamHandle) and getattr(h, "writable", False))
        require_streaming("memcache", self._streaming, "MemcacheBackend", "writes are also staged for streaming readers")
        todo: list[_Seg] = []
        lost = []
        with self._lock:
            for h in handles:
                ws = self._wstreams.get(h.key)
                if ws is None or self._writing.get(h.key) is not h:
                    if getattr(h, "state", 0) != 1:  # committed already: a no-op
                        lost.append(h.key)
                    continue
                todo += [s for end, s in sorted(ws.segs.items()) if end <= upto and not s.published]
        if lost:
            raise unpublishable("memcache", lost)
        if not todo:
            return
        res = store.batch_write_finish([s.key for s in todo], [_FINISH_OK] * len(todo))
        for s, r in zip(todo, res):
            s.published = r == 0
        bad = [(s.key, r) for s, r in zip(todo, res) if r != 0]
        if bad:
            self._fail(bad[0][1], f"publish (batch_write_finish) of {len(bad)} segment(s), first {bad[0][0]}")


def _nbytes(buf: Any) -> int:
    n = getattr(buf, "nbytes", None)
    return int(n) if n is not None else memoryview(buf).nbytes


__all__ = ["HEAD_MAGIC", "REMOVE_GRACE_S", "TRAILER", "MemcacheStreamHandle", "StreamMixin", "WriteStream"]
