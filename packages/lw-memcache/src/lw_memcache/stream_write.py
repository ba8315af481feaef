"""``StreamWriter``: the writer's side of memcache streaming (design: ``lw_memcache.streaming``):
the hooks ``ObjectWriter`` calls around reserve, write, commit and abort, and ``publish``.

Invariants:

* It owns the open reservations' streams (``WriteStream``: token, segments by end offset, head),
  under its own lock, and the reaper that removes heads and segments ``REMOVE_GRACE_S`` after
  their reservation ended (at once at ``close``).
* A reservation's token is in its trailer before any data is written and before its handle is
  returned; its head is committed only after that.
* A segment is allocated once per (reservation, end offset) and published (committed) at most
  once; unpublished segments are dropped at the end, never read.
* Removal is best effort and never raises: what is left is unreadable past a marker or a commit.
  A head is removed only while it is still at the address this client wrote it and no reservation
  of ours has its key again.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lw_core.backend import BackendError
from lw_core.backends.segment_stream import abort_key, head_key, seg_key
from lw_core.backends.segment_stream.checks import check_publish, require_streaming, unpublishable
from lw_core.backends.segment_stream.head import HEAD, TOKEN_BYTES, pack_head
from lw_core.backends.segment_stream.reaper import Reaper
from lw_core.procs import boot_id, current_owner
from lw_memcache.client import FINISH_FAILED, FINISH_OK, INFO_ANY, MEDIA_DRAM, StoreClient
from lw_memcache.copies import Copier
from lw_memcache.handles import MemcacheHandle, MemcacheStreamHandle, Seg, nbytes_of
from lw_memcache.streaming import HEAD_MAGIC, MARKER_BYTES, REMOVE_GRACE_S, TRAILER, pack_trailer

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class WriteStream:
    token: bytes
    segs: dict[int, Seg] = field(default_factory=dict)  # by end offset
    head: bool = False
    head_gva: int = 0


class StreamWriter:
    """Streams the reservations of client ``client`` (copies through ``copier``) when ``enabled``;
    objects it allocates take write leases of ``write_lease_ms``."""

    def __init__(self, client: StoreClient, copier: Copier, *, enabled: bool, write_lease_ms: int) -> None:
        self.client = client
        self.copier = copier
        self.enabled = enabled  # writes are also staged for streaming readers
        self.write_lease_ms = write_lease_ms
        self._lock = threading.Lock()
        self._streams: dict[str, WriteStream] = {}  # key -> the stream of our open reservation
        # heads and segments waiting for their grace: (key, head's address or None)
        self.reaper: Reaper[tuple[str, int | None]] = Reaper("lw-memcache-reaper", self._remove_now,
                                                            grace_s=REMOVE_GRACE_S)

    def active(self) -> bool:
        """Whether ``write`` has anything to stream."""
        return self.enabled and bool(self._streams)

    # ----- hooks of ObjectWriter -----

    def start(self, handles: Sequence[MemcacheHandle | None]) -> None:
        """After ``reserve``: token into each object's trailer, then its head object."""
        hs = [h for h in handles if h is not None]
        if not self.enabled or not hs:
            return
        streams = {h.key: WriteStream(secrets.token_bytes(TOKEN_BYTES)) for h in hs}
        trailers = np.frombuffer(b"".join(pack_trailer(streams[h.key].token) for h in hs), np.uint8).copy()
        tails = [trailers[i * TRAILER : (i + 1) * TRAILER] for i in range(len(hs))]
        # Written before any data and before the handle is returned: a later reservation of the
        # same space is told apart from this one from now on.
        self.copier.copy([Seg(h.key, h.nbytes + TRAILER, h.gva, 0) for h in hs], [h.nbytes for h in hs], tails,
                         to_store=True)
        with self._lock:
            self._streams.update(streams)
        store = self.client.store
        heads = [head_key(h.key) for h in hs]
        stale = [k for k, r in zip(heads, store.batch_is_exist(heads)) if r == 1]
        if stale:  # a dead or aborted writer's head: this reservation replaces it
            store.remove_batch(stale)
        gvas = store.batch_alloc(heads, [HEAD.size] * len(heads), MEDIA_DRAM, self.write_lease_ms)
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
            self.copier.copy([Seg(hk, HEAD.size, g, 0) for _, hk, g in ok], [0] * len(ok), bufs, to_store=True)
        except BackendError:
            store.batch_write_finish([hk for _, hk, _ in ok], [FINISH_FAILED] * len(ok))
            raise
        keys = [hk for _, hk, _ in ok]
        res = store.batch_write_finish(keys, [FINISH_OK] * len(keys))
        store.batch_remove_lease([k for k, r in zip(keys, res) if r == 0])
        with self._lock:
            for (h, _, g), r in zip(ok, res):
                streams[h.key].head, streams[h.key].head_gva = r == 0, int(g)

    def write(self, handles: Sequence[MemcacheHandle], offsets: Sequence[int], srcs: Sequence[Any]) -> None:
        """After ``write``: the same ranges into the reservations' segment objects."""
        todo: list[tuple[WriteStream, MemcacheHandle, int, Any]] = []
        with self._lock:
            for h, off, src in zip(handles, offsets, srcs):
                ws = self._streams.get(h.key)
                if ws is not None:
                    todo.append((ws, h, off, src))
        if not todo:
            return
        new: dict[str, tuple[WriteStream, int, int]] = {}
        for ws, h, off, src in todo:
            n = nbytes_of(src)
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
            gvas = self.client.store.batch_alloc(keys, [new[k][2] for k in keys], MEDIA_DRAM, self.write_lease_ms)
            failed = []
            with self._lock:  # the pipeline writes several layers of an object at once
                for k, g in zip(keys, gvas):
                    ws, off, n = new[k]
                    if g > 0:
                        ws.segs[off + n] = Seg(k, n, int(g), off)
                    else:
                        failed.append(k)
            if failed:  # no room: those ranges are not streamed; readers get them at commit
                self.client.store.remove_batch(failed)
        segs, bufs = [], []
        for ws, _h, off, src in todo:
            seg = ws.segs.get(off + nbytes_of(src))
            if seg is not None and seg.start == off:
                segs.append(seg)
                bufs.append(src)
        if segs:
            self.copier.copy(segs, [0] * len(segs), bufs, to_store=True)

    def end(self, handles: Sequence[MemcacheHandle], *, aborted: bool) -> None:
        """Before abort (marker first: waiters fail at once) and after commit: drop the head and
        the segments. Best effort: what is left is never readable past a marker or a commit."""
        with self._lock:
            ended = [(h.key, self._streams.pop(h.key)) for h in handles if h.key in self._streams]
        if not ended:
            return
        store = self.client.store
        try:
            if aborted:
                marks = [abort_key(k, ws.token) for k, ws in ended]
                gvas = store.batch_alloc(marks, [MARKER_BYTES] * len(marks), MEDIA_DRAM, self.write_lease_ms)
                done = [m for m, g in zip(marks, gvas) if g > 0]
                if done:
                    store.batch_write_finish(done, [FINISH_OK] * len(done))
                    store.batch_remove_lease(done)
            unfinished = [s.key for _, ws in ended for s in ws.segs.values() if not s.published]
            if unfinished:  # never readable, so never leased: dropped now
                store.batch_write_finish(unfinished, [FINISH_FAILED] * len(unfinished))
        except Exception as e:  # noqa: BLE001 - leftovers are unreadable and get evicted
            log.debug("memcache streaming: cleaning up after %s failed: %s", "abort" if aborted else "commit", e)
        heads = [(head_key(k), ws.head_gva) for k, ws in ended if ws.head]
        segs = [s.key for _, ws in ended for s in ws.segs.values() if s.published]
        if heads or segs:
            self._remove_later(heads, segs)

    # ----- StreamingBackend.publish -----

    def publish(self, handles: Sequence[Any], upto: int, reserved: Callable[[Any], bool]) -> None:
        """Commit the segments of ``handles`` that end at or before ``upto``; ``reserved(h)``: ``h``
        is still an open reservation of the backend (``ObjectWriter.holds``)."""
        store = self.client.live()
        check_publish("memcache", handles, upto,
                      lambda h: not isinstance(h, MemcacheStreamHandle) and getattr(h, "writable", False))
        require_streaming("memcache", self.enabled, "MemcacheBackend", "writes are also staged for streaming readers")
        todo: list[Seg] = []
        lost = []
        with self._lock:
            for h in handles:
                ws = self._streams.get(h.key)
                if ws is None or not reserved(h):
                    if getattr(h, "state", 0) != 1:  # committed already: a no-op
                        lost.append(h.key)
                    continue
                todo += [s for end, s in sorted(ws.segs.items()) if end <= upto and not s.published]
        if lost:
            raise unpublishable("memcache", lost)
        if not todo:
            return
        res = store.batch_write_finish([s.key for s in todo], [FINISH_OK] * len(todo))
        for s, r in zip(todo, res):
            s.published = r == 0
        bad = [(s.key, r) for s, r in zip(todo, res) if r != 0]
        if bad:
            self.client.fail(bad[0][1], f"publish (batch_write_finish) of {len(bad)} segment(s), first {bad[0][0]}")

    # ----- removal after the grace (see lw_memcache.streaming): the reaper calls _remove_now -----

    def _remove_later(self, heads: list[tuple[str, int]], segs: list[str]) -> None:
        """Hand heads (with the address we wrote each at) and segments (address None) to the reaper."""
        dropped = self.reaper.later([*heads, *((s, None) for s in segs)])
        if dropped:
            log.warning("memcache streaming: removal queue full; %d object(s) left to eviction, first %s",
                        len(dropped), dropped[0][0])

    def _remove_now(self, items: Sequence[tuple[str, int | None]]) -> None:
        """Remove segments (named by a token only their writer has) and heads that are still the
        ones this client wrote (same address, and no reservation of ours has the key again)."""
        heads = [(k, g) for k, g in items if g is not None]
        gone = [k for k, g in items if g is None]
        store = self.client.store
        try:
            if heads:
                with self._lock:
                    mine = set(self._streams)
                infos = store.batch_get_key_info([k for k, _ in heads], INFO_ANY)
                for (k, g), info in zip(heads, infos):
                    at = list(info.gva_list()) if info.size() else []
                    if at and int(at[0]) == g and k[: -len(head_key(""))] not in mine:
                        gone.append(k)
            if gone:
                store.remove_batch(gone)
        except Exception as e:  # noqa: BLE001 - leftovers are unreadable and get evicted
            log.debug("memcache streaming: removing %d finished stream object(s) failed: %s", len(gone), e)

    def close(self) -> None:
        """Stop the reaper and remove what waits for it now (the client is leaving)."""
        self.reaper.close()


__all__ = ["StreamWriter", "WriteStream"]
