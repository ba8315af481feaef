"""The optional streaming extension of ``MooncakeBackend`` (rules: ``lw_core.backend``): the writer.

Mooncake has no reserve/commit and a stored object never grows, so a reservation's published
prefix cannot be made readable in place (the object itself is put whole at ``commit``). Instead
each ``publish`` puts the newly published bytes as a *segment* object of their own, named by a
random per-reservation token (the same design as lw-memcache's streaming, without its address
worries: Mooncake is read by key, never by address):

* ``reserve`` (``MooncakeBackend(streaming=True)``; ``from_config`` sets it from
  ``pd_streaming``) draws an 8-byte token per reservation and puts a small head object ``<key>#h``
  naming it, with the object's size, the writer (boot id, pid namespace, pid, start time) and a
  BLAKE2b digest of all that keyed by the key. A head left by an earlier reservation of the key
  (aborted, writer dead, or one whose removal was refused) is replaced; as heads may be removed
  while a reader fetches one (``force``: a head is read under Mooncake's lease like any get), a
  reader uses a head only when its digest matches.
* ``publish(upto)`` puts ``[published, upto)`` of the local object as segment objects
  ``<key>#s<token>/<end>``, cut where the writer's ``write`` and ``view`` ranges ended (the
  pipeline writes one layer of an object per call, so segments are layers), each an 8-byte header
  holding its start, then the bytes. A reader reads exactly one segment's range: reads follow the
  writer's write ranges, as with memcache (another split reads as not published: a recompute,
  never other bytes).
* ``commit`` puts the object as before, then removes the head and the segments. ``abort`` (and a
  failed put, and ``close`` with reservations open) first puts an abort marker
  ``<key>#x<token>``, so waiters fail at once, then removes them.

Removal respects Mooncake's read leases (``--default_kv_lease_ttl``) for segments and markers: a
segment a reader fetched a moment ago cannot be removed until its lease ends, and the master grants
that lease on ``batch_is_exist`` too (measured: a segment a waiter polled refuses ``batch_remove``
with OBJECT_HAS_LEASE), so nearly every segment outlives its commit by about one lease. What could not be
removed is retried from later calls (``_collect``), so while streaming the pool holds a
reservation's bytes twice from its first publish until shortly after commit (plus the lease).
Markers are kept ``MARKER_KEEP_S`` for readers that poll late, then removed the same way (the
policy, shared with memcache: ``lw_core.backends.segment_stream.policy``).

Costs while streaming: per ``reserve`` batch one ``batch_is_exist`` and one put (heads); per
``publish`` one put of the layer's bytes (the prefiller sends each byte twice: segment and
object); per ``commit`` one ``batch_remove``. When the store stops answering (a call past
``mooncake_call_timeout_s``), publishing and the clean-up after commit and abort are skipped for
``QUIET_S``: a dead master must not cost every layer's publish its own deadline in the save path
(readers then wait for their deadline and recompute, as without streaming). The reader's side is
``lw_mooncake.stream_read``.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lw_core.backend import BackendError, BackendUnavailable
from lw_core.backends.segment_stream import abort_key, head_key, seg_key
from lw_core.backends.segment_stream.checks import check_publish, require_streaming, unpublishable
from lw_core.backends.segment_stream.collector import Collector
from lw_core.backends.segment_stream.head import HEAD, TOKEN_BYTES, StreamHead
from lw_core.backends.segment_stream.head import pack_head as pack_stream_head
from lw_core.backends.segment_stream.head import unpack_head as unpack_stream_head
from lw_core.backends.segment_stream.policy import MARKER_KEEP_S, QUIET_S
from lw_core.procs import Owner, boot_id, current_owner
from lw_mooncake.errors import OBJECT_HAS_LEASE, OBJECT_NOT_FOUND, to_error
from lw_mooncake.handle import MooncakeHandle, MooncakeStreamHandle

log = logging.getLogger(__name__)

# head: lw_core.backends.segment_stream.head's layout under this magic, then a digest
HEAD_MAGIC = b"lwmkHED1"
_DIGEST = 16
HEAD_SIZE = HEAD.size + _DIGEST
SEG_HEADER = struct.Struct("<Q")  # a segment's start offset in its object
MARKER = b"lwmkABT1"


def _digest(key: str, body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=_DIGEST, key=hashlib.sha256(key.encode()).digest()).digest()


def pack_head(key: str, token: bytes, nbytes: int, boot: bytes, owner: Owner) -> np.ndarray:
    body = pack_stream_head(HEAD_MAGIC, token, nbytes, boot, owner)
    return np.frombuffer(body + _digest(key, body), np.uint8).copy()


def unpack_head(key: str, raw: bytes) -> StreamHead | None:
    """(token, object bytes, boot id, writer) of a head fetched for ``key``; None unless it is
    whole, of this key, and unchanged (the digest matches)."""
    if len(raw) != HEAD_SIZE:
        return None
    body, dig = raw[: HEAD.size], raw[HEAD.size :]
    if dig != _digest(key, body):
        return None
    return unpack_stream_head(HEAD_MAGIC, body)


@dataclass(eq=False, slots=True)
class WriteStream:
    token: bytes
    published: int = 0  # end of the published prefix
    ends: set[int] = field(default_factory=set)  # where written (or viewed) ranges ended
    segs: list[str] = field(default_factory=list)
    head: bool = False


class StreamWrites:
    """The writer's side for MooncakeBackend: hooks of reserve/commit/abort, and ``publish``."""

    # From MooncakeBackend / Writes.
    store: Any
    calls: Any
    _lock: threading.Lock
    _pending: dict[str, MooncakeHandle]
    _streaming: bool
    _wstreams: dict[str, WriteStream]
    _collector: Collector
    _exist: Callable[[list[str]], list[int]]
    _put_all: Callable[[list[tuple[str, list[np.ndarray]]]], list[int]]

    def _stream_start(self, handles: Sequence[MooncakeHandle | None]) -> None:
        """After ``reserve``: a token and a head object per new reservation. A head that cannot be
        put only costs readers the stream (they read the object once committed)."""
        hs = [h for h in handles if h is not None]
        if not self._streaming or not hs:
            return
        streams = {h.key: WriteStream(secrets.token_bytes(TOKEN_BYTES)) for h in hs}
        with self._lock:
            self._wstreams.update(streams)
        heads = [head_key(h.key) for h in hs]
        try:
            stale = [k for k, r in zip(heads, self._exist(heads)) if r == 1]
            if stale:  # an earlier reservation's head: this one replaces it (readers check digests)
                self.calls.call("batch_remove", self.store.batch_remove, stale, True)
            me, boot = current_owner(), boot_id()
            res = self._put_all([(hk, [pack_head(h.key, streams[h.key].token, h.nbytes, boot, me)])
                                 for h, hk in zip(hs, heads)])
        except BackendError as e:
            if isinstance(e, BackendUnavailable):
                self._go_quiet()
            log.warning("mooncake streaming: heads of %d reservation(s) not put (%s); readers wait for the commit",
                        len(hs), e)
            return
        for h, r in zip(hs, res):
            streams[h.key].head = r == 0

    def publish(self, handles: Sequence[Any], upto: int) -> None:
        check_publish("mooncake", handles, upto, lambda h: isinstance(h, MooncakeHandle) and h.reserved)
        require_streaming("mooncake", self._streaming, "MooncakeBackend", "reservations get a head streaming readers find")
        todo: list[tuple[WriteStream, str, int, np.ndarray]] = []  # segments: stream, name, end, bytes
        lost = []
        with self._lock:
            for h in handles:
                assert isinstance(h, MooncakeHandle)
                ws = self._wstreams.get(h.key)
                if ws is None or h.buf is None or self._pending.get(h.key) is not h:
                    if not h.committed:
                        lost.append(h.key)
                    continue
                start = ws.published
                for end in sorted({e for e in ws.ends if start < e < upto} | {upto}) if upto > start else ():
                    todo.append((ws, seg_key(h.key, ws.token, end), end, h.buf[start:end]))
                    start = end
        if lost:
            raise unpublishable("mooncake", lost)
        if not todo:
            return
        if self._quiet():
            raise BackendUnavailable(f"mooncake: publish skipped: the store did not answer a call in the last {QUIET_S:g} s")
        try:
            res = self._put_all([(name, [np.frombuffer(SEG_HEADER.pack(end - data.nbytes), np.uint8), data])
                                 for _, name, end, data in todo])
        except BackendUnavailable:
            self._go_quiet()
            raise
        bad = []
        with self._lock:
            for (ws, name, end, data), r in zip(todo, res):  # in order of end, per stream
                if r == 0:
                    ws.segs.append(name)
                    if ws.published == end - data.nbytes:  # the prefix grows only without gaps
                        ws.published = end
                else:
                    bad.append((name, r))
        self._collect()
        if bad:
            raise to_error(bad[0][1], f"publish (put) of {len(bad)} segment(s), first {bad[0][0]}")

    def _stream_end(self, handles: Sequence[MooncakeHandle], *, aborted: bool) -> None:
        """Before abort (marker first: waiters fail at once) and after commit: remove the head and
        the segments. Best effort: a leftover is never read past a marker or a commit."""
        with self._lock:
            ended = [(h.key, self._wstreams.pop(h.key)) for h in handles if h.key in self._wstreams]
        if not ended or self._quiet():
            return
        try:
            if aborted:
                marks = [abort_key(k, ws.token) for k, ws in ended]
                res = self._put_all([(m, [np.frombuffer(MARKER, np.uint8)]) for m in marks])
                self._collector.later([m for m, r in zip(marks, res) if r == 0], MARKER_KEEP_S)
            heads = [head_key(k) for k, ws in ended if ws.head]
            if heads:
                self.calls.call("batch_remove", self.store.batch_remove, heads, True)
            self._collector.remove([s for _, ws in ended for s in ws.segs])
        except BackendError as e:
            if isinstance(e, BackendUnavailable):
                self._go_quiet()
            log.debug("mooncake streaming: cleaning up after %s failed: %s", "abort" if aborted else "commit", e)

    def _stream_close(self) -> None:
        """``close`` with reservations open: they are aborted for streaming readers."""
        with self._lock:
            open_ = [h for h in self._pending.values() if h.key in self._wstreams]
        if open_:
            self._stream_end(open_, aborted=True)

    def _quiet(self) -> bool:
        return bool(self._collector.quiet)

    def _go_quiet(self) -> None:
        self._collector.quiet.start()

    # ----- removal that respects read leases: the collector, over this -----

    def _remove_names(self, keys: list[str]) -> list[bool]:
        """``batch_remove`` for the collector: True where gone, False where refused (a read lease)."""
        res = self.calls.call("batch_remove", self.store.batch_remove, keys, False)
        for k, r in zip(keys, res):
            if r not in (0, OBJECT_NOT_FOUND, OBJECT_HAS_LEASE):
                log.debug("mooncake streaming: removal of %s: %s", k, r)
        return [r in (0, OBJECT_NOT_FOUND) for r in res]

    def _collect(self, *, every_s: float = 0.5) -> None:
        self._collector.collect(every_s=every_s)


__all__ = ["HEAD_SIZE", "MARKER", "MARKER_KEEP_S", "QUIET_S", "SEG_HEADER", "MooncakeStreamHandle", "StreamWrites", "WriteStream", "pack_head",
           "unpack_head"]
