"""``StreamWriter``: the writer's side of Mooncake streaming (the design: ``lw_mooncake.streaming``):
a head per reservation, ``publish`` as segment objects, an abort marker, and the clean-up.

State it owns: one ``WriteStream`` per open reservation of ``Reservations`` that streams (its
token, its published prefix, where written ranges ended, its segments' names), under its own lock,
and the ``Collector`` of what could not be removed yet (with the quiet period after a timeout).

Invariants:

* A reservation's stream exists from ``start`` (after ``reserve``) until ``end`` (after commit,
  before abort, at close); a segment is put only for a held reservation (``Reservations.holds``).
* The published prefix grows only without gaps: ``published`` moves to a segment's end only when
  that segment starts at the old ``published``.
* During the quiet period (``QUIET_S`` after a store call timed out) ``publish`` raises
  ``BackendUnavailable`` at once and the clean-up after commit and abort is skipped: a dead master
  costs one deadline, not one per layer. Leftovers are never read (past a marker or a commit).
* Lock order: this writer's lock, then ``Reservations``' (never the other way).
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lw_core.backend import BackendError, BackendUnavailable
from lw_core.backends.segment_stream import abort_key, head_key, seg_key
from lw_core.backends.segment_stream.checks import check_publish, unpublishable
from lw_core.backends.segment_stream.collector import Collector
from lw_core.backends.segment_stream.head import TOKEN_BYTES
from lw_core.backends.segment_stream.policy import MARKER_KEEP_S, QUIET_S
from lw_core.procs import boot_id, current_owner
from lw_mooncake.client import StoreClient
from lw_mooncake.errors import OBJECT_HAS_LEASE, OBJECT_NOT_FOUND, to_error
from lw_mooncake.handle import MooncakeHandle
from lw_mooncake.puts import StagedPuts
from lw_mooncake.reservations import Reservations
from lw_mooncake.streaming import MARKER, SEG_HEADER, pack_head

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class WriteStream:
    token: bytes
    published: int = 0  # end of the published prefix
    ends: set[int] = field(default_factory=set)  # where written (or viewed) ranges ended
    segs: list[str] = field(default_factory=list)
    head: bool = False


class StreamWriter:
    """Streams of ``reservations``' objects: calls through ``client``, puts through ``puts``."""

    def __init__(self, client: StoreClient, puts: StagedPuts, reservations: Reservations) -> None:
        self.client = client
        self.puts = puts
        self.reservations = reservations
        self._lock = threading.Lock()
        self._streams: dict[str, WriteStream] = {}
        self.collector = Collector("mooncake streaming", self._remove_names)

    def stream(self, key: str) -> WriteStream | None:
        """The stream of the open reservation of ``key``, if any."""
        with self._lock:
            return self._streams.get(key)

    def start(self, handles: Sequence[MooncakeHandle | None]) -> None:
        """After ``reserve``: a token and a head object per new reservation. A head that cannot be
        put only costs readers the stream (they read the object once committed)."""
        hs = [h for h in handles if h is not None]
        if not hs:
            return
        streams = {h.key: WriteStream(secrets.token_bytes(TOKEN_BYTES)) for h in hs}
        with self._lock:
            self._streams.update(streams)
        heads = [head_key(h.key) for h in hs]
        try:
            stale = [k for k, r in zip(heads, self.client.exist(heads)) if r == 1]
            if stale:  # an earlier reservation's head: this one replaces it (readers check digests)
                self.client.remove(stale, force=True)
            me, boot = current_owner(), boot_id()
            res = self.puts.put_all([(hk, [pack_head(h.key, streams[h.key].token, h.nbytes, boot, me)])
                                     for h, hk in zip(hs, heads)])
        except BackendError as e:
            if isinstance(e, BackendUnavailable):
                self.go_quiet()
            log.warning("mooncake streaming: heads of %d reservation(s) not put (%s); readers wait for the commit",
                        len(hs), e)
            return
        for h, r in zip(hs, res):
            streams[h.key].head = r == 0

    def written(self, key: str, end: int) -> None:
        """A ``write`` or ``view`` of ``key``'s reservation ended at ``end``: publish cuts a segment there."""
        with self._lock:
            ws = self._streams.get(key)
            if ws is not None:
                ws.ends.add(end)

    def publish(self, handles: Sequence[Any], upto: int) -> None:
        check_publish("mooncake", handles, upto, lambda h: isinstance(h, MooncakeHandle) and h.reserved)
        todo: list[tuple[WriteStream, str, int, np.ndarray]] = []  # segments: stream, name, end, bytes
        lost = []
        pinned: list[int] = []  # put arena extents of the buffers read here, held until the put returned
        with self._lock:
            for h in handles:
                assert isinstance(h, MooncakeHandle)
                ws, buf = self._streams.get(h.key), h.buf  # buf: as held now (a commit may end it meanwhile)
                if ws is None or buf is None or not self.reservations.holds(h):
                    if not h.committed:
                        lost.append(h.key)
                    continue
                pinned += self.reservations.pin([h])
                start = ws.published
                for end in sorted({e for e in ws.ends if start < e < upto} | {upto}) if upto > start else ():
                    todo.append((ws, seg_key(h.key, ws.token, end), end, buf[start:end]))
                    start = end
        try:
            if lost:
                raise unpublishable("mooncake", lost)
            if not todo:
                return
            if self.quiet():
                raise BackendUnavailable(f"mooncake: publish skipped: the store did not answer a call in the last {QUIET_S:g} s")
            try:
                res = self.puts.put_all([(name, [np.frombuffer(SEG_HEADER.pack(end - data.nbytes), np.uint8), data])
                                         for _, name, end, data in todo])
            except BackendUnavailable:
                self.go_quiet()
                raise
        finally:  # a segment is a header and its bytes, copied into the staging: nothing reads the buffers now
            self.reservations.unpin(pinned)
        bad = []
        with self._lock:
            for (ws, name, end, data), r in zip(todo, res):  # in order of end, per stream
                if r == 0:
                    ws.segs.append(name)
                    if ws.published == end - data.nbytes:  # the prefix grows only without gaps
                        ws.published = end
                else:
                    bad.append((name, r))
        self.collect()
        if bad:
            raise to_error(bad[0][1], f"publish (put) of {len(bad)} segment(s), first {bad[0][0]}")

    def end(self, handles: Sequence[MooncakeHandle], *, aborted: bool) -> None:
        """Before abort (marker first: waiters fail at once) and after commit: remove the head and
        the segments. Best effort: a leftover is never read past a marker or a commit."""
        with self._lock:
            ended = [(h.key, self._streams.pop(h.key)) for h in handles if h.key in self._streams]
        if not ended or self.quiet():
            return
        try:
            if aborted:
                marks = [abort_key(k, ws.token) for k, ws in ended]
                res = self.puts.put_all([(m, [np.frombuffer(MARKER, np.uint8)]) for m in marks])
                self.collector.later([m for m, r in zip(marks, res) if r == 0], MARKER_KEEP_S)
            heads = [head_key(k) for k, ws in ended if ws.head]
            if heads:
                self.client.remove(heads, force=True)
            self.collector.remove([s for _, ws in ended for s in ws.segs])
        except BackendError as e:
            if isinstance(e, BackendUnavailable):
                self.go_quiet()
            log.debug("mooncake streaming: cleaning up after %s failed: %s", "abort" if aborted else "commit", e)

    def close(self) -> None:
        """At the backend's close: reservations still open are aborted for streaming readers, and
        every leftover due is removed. Best effort (a failure is logged)."""
        try:
            open_ = self.reservations.handles()
            with self._lock:
                open_ = [h for h in open_ if h.key in self._streams]
            if open_:
                self.end(open_, aborted=True)
            self.collect(every_s=0.0)
        except BackendError as e:
            log.debug("mooncake streaming: clean-up at close: %s", e)

    def quiet(self) -> bool:
        return bool(self.collector.quiet)

    def go_quiet(self) -> None:
        self.collector.quiet.start()

    def collect(self, *, every_s: float = 0.5) -> None:
        """Removes the leftovers that are due (at most every ``every_s``), as later calls do."""
        self.collector.collect(every_s=every_s)

    def _remove_names(self, keys: list[str]) -> list[bool]:
        """``batch_remove`` for the collector: True where gone, False where refused (a read lease)."""
        res = self.client.remove(keys, force=False)
        for k, r in zip(keys, res):
            if r not in (0, OBJECT_NOT_FOUND, OBJECT_HAS_LEASE):
                log.debug("mooncake streaming: removal of %s: %s", k, r)
        return [r in (0, OBJECT_NOT_FOUND) for r in res]
