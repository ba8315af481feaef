"""``ObjectWriter``: the writing half of the ``Backend`` protocol on Mooncake (reserve, write, view
of a reservation, commit, abort).

Two ways, chosen per reservation:

* put sessions (``sessions``, when the client has them; ``lw_mooncake.session_writer``): reserve
  starts a session, each ``write`` puts its range at once (the layer pipeline writes each layer as
  its attention ends, so the transfer overlaps compute), commit ends the session, abort revokes
  it. ``view`` of such a reservation is None (the pipeline then calls ``write``).
* whole objects (clients without sessions, ``put_sessions=False``, and 0-byte objects): a
  reservation is a local buffer (``Reservations``) filled layer by layer, and ``commit`` puts it
  whole (``StagedPuts``).

Invariants:

* Nothing of a reservation is visible in Mooncake before its put (or session end) completes; a
  failed put or session end leaves nothing visible (a failed session is revoked), and ``abort``
  drops the local buffer and revokes the session.
* After ``commit`` returns or raises, none of its handles is held: a handle whose put succeeded
  (here or before) counts as committed (committing it again is a no-op), one whose put failed
  raises that put's error again.
* With streaming (``streams``), every reservation's stream starts after ``reserve`` and ends
  after its commit or before its abort; the writer's own state is its counters
  (``bytes_written``, ``objects_put``, ``bytes_put``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from lw_core.backend import BackendError, BackendUnavailable, ObjectMissing
from lw_mooncake.buffers import byte_view
from lw_mooncake.client import StoreClient
from lw_mooncake.errors import to_error
from lw_mooncake.handle import MooncakeHandle
from lw_mooncake.puts import StagedPuts
from lw_mooncake.reservations import Reservations, uncovered
from lw_mooncake.session_writer import SessionWriter
from lw_mooncake.stream_write import StreamWriter


class ObjectWriter:
    """Reservations in ``reservations``, put through ``puts``; ``streams``: the stream writer, or
    None without streaming; ``sessions``: put sessions (``SessionWriter``), or None for whole puts.
    Objects larger than ``staging_size`` are refused."""

    def __init__(self, client: StoreClient, puts: StagedPuts, reservations: Reservations, *, staging_size: int,
                 streams: StreamWriter | None, sessions: SessionWriter | None = None) -> None:
        self.client = client
        self.puts = puts
        self.reservations = reservations
        self.staging_size = staging_size
        self.streams = streams
        self.sessions = sessions
        self.counts: Counter[str] = sessions.counts if sessions is not None else Counter()

    def reserve(self, keys: Sequence[str], nbytes: int) -> list[MooncakeHandle | None]:
        if nbytes < 0:
            raise ValueError(f"reserve: nbytes={nbytes} must be >= 0")
        if nbytes > self.staging_size:
            raise BackendError(f"reserve: an object of {nbytes} bytes exceeds mooncake_staging_size={self.staging_size}")
        if not keys:
            return []
        if self.sessions is not None and nbytes > 0:
            out = self.sessions.reserve(keys, nbytes)  # the session start answers for stored keys
        else:
            out = self.reservations.reserve(keys, self.client.exist(list(keys)), nbytes)
        if self.streams is not None:
            self.streams.start(out)
        return out

    def _local(self, h: MooncakeHandle, off: int, n: int, what: str) -> np.ndarray:
        buf = h.buf
        if buf is None or not self.reservations.holds(h):
            raise ObjectMissing(f"{what}: {h.key!r} is not reserved here (committed or aborted)")
        if off < 0 or off + n > h.nbytes:
            raise ValueError(f"{what}: range [{off}, {off + n}) outside {h.key!r} of {h.nbytes} bytes")
        if self.streams is not None and n:
            self.streams.written(h.key, off + n)  # publish cuts segments where written ranges end
        if h.extent is not None and n and not h.session:
            h.filled.append((off, off + n))  # the rest is zeroed before the whole put (a session's: its gap fill)
        return buf[off : off + n]

    def write(self, handles: Sequence[MooncakeHandle], offsets: Sequence[int], srcs: Sequence[Any]) -> None:
        """Copies each source into its reservation's local object (nothing to copy for a source
        that is that range of it already, ``write_buffers``); a put session's ranges are put at
        once. The local objects in the put arena stay held until this returns."""
        pinned = self.reservations.pin(handles)
        try:
            n = 0
            sess: list[tuple[MooncakeHandle, int, int]] = []
            for h, off, src in zip(handles, offsets, srcs, strict=True):
                data = byte_view(src, writable=False, what="write")
                local = self._local(h, off, data.nbytes, "write")
                if local.ctypes.data != data.ctypes.data:
                    local[:] = data
                n += data.nbytes
                if h.session:
                    sess.append((h, off, data.nbytes))
            self.counts["bytes_written"] += n
            if sess and self.sessions is not None:
                self.sessions.write([h for h, _, _ in sess], [o for _, o, _ in sess], [k for _, _, k in sess])
        finally:
            self.reservations.unpin(pinned)

    def view(self, handle: MooncakeHandle, offset: int, nbytes: int) -> memoryview | None:
        """A writable view of a reservation's local object; None once it ended, and for a put
        session (its bytes go out as they are written: callers ``write``)."""
        if handle.buf is None or handle.session:
            return None
        return self._local(handle, offset, nbytes, "view").data

    def write_buffers(self, handles: Sequence[MooncakeHandle], offsets: Sequence[int], nbytes: int) -> list[np.ndarray] | None:
        """The put sessions' local objects in the put arena, at these ranges (lw-core's optional
        ``Backend.write_buffers``): filled by the caller, then passed to ``write``, which copies
        nothing and puts straight from them. None unless every handle is such a held reservation."""
        if not handles or any(h.extent is None or not h.session for h in handles):
            return None
        held = self.reservations.held(handles)
        if not all(held):
            return None
        out = []
        for h, off in zip(handles, offsets, strict=True):
            buf = h.buf
            if buf is None or off < 0 or off + nbytes > h.nbytes:
                return None
            out.append(buf[off : off + nbytes])
        return out

    def commit(self, handles: Sequence[MooncakeHandle]) -> None:
        """Puts the objects; raises the first error (and how many more) when any put failed. A
        handle whose put succeeded, here or before, counts as committed: the layer pipeline, after
        a failed batch, commits each object again to find the failed ones. A failed one is dropped
        (nothing of it is visible) and committing it again raises its put's error again."""
        todo = [h for h in handles if not h.committed]
        again = [h.failed for h in todo if h.failed is not None]
        todo = [h for h in todo if h.failed is None]
        missing = [h.key for h, held in zip(todo, self.reservations.held(todo)) if not held]
        live = [h for h in todo if h.key not in missing]
        errors: list[BackendError] = [type(e)(str(e)) for e in again]
        try:
            sess = [h for h in live if h.session]
            if sess and self.sessions is not None:
                errors += self.sessions.commit(sess)
            for batch in self._batches([h for h in live if not h.session]):
                errors += self._put(batch)
        except BackendError as e:  # e.g. a put past its deadline: this and any later batch failed
            for h in live:
                if not h.committed and h.failed is None:
                    h.failed = e
            if isinstance(e, BackendUnavailable) and self.streams is not None:
                self.streams.go_quiet()  # no streaming clean-up calls into a store that does not answer
            if self.sessions is not None:  # nothing of a failed session stays (revoked unless quiet)
                self.sessions.abort([h for h in live if h.session and not h.committed],
                                    quiet=isinstance(e, BackendUnavailable))
            raise
        finally:
            self.reservations.end(live)
            if self.streams is not None:
                self.streams.end([h for h in live if h.committed], aborted=False)
                self.streams.end([h for h in live if not h.committed], aborted=True)
        if missing:
            errors.insert(0, ObjectMissing(f"commit: {', '.join(map(repr, missing))} not reserved (aborted)"))
        if errors:
            if len(errors) > 1:
                raise type(errors[0])(f"{errors[0]} (and {len(errors) - 1} more of {len(handles)})")
            raise errors[0]

    def _batches(self, hs: list[MooncakeHandle]) -> list[list[MooncakeHandle]]:
        out: list[list[MooncakeHandle]] = []
        size = self.staging_size + 1
        for h in hs:
            if size + h.nbytes > self.staging_size:
                out.append([])
                size = 0
            out[-1].append(h)
            size += h.nbytes
        return out

    def _put(self, batch: list[MooncakeHandle]) -> list[BackendError]:
        items = []
        for h in batch:
            assert h.buf is not None
            self.reservations.zero(h, uncovered(h.filled, h.nbytes))  # an arena extent is not zeroed when taken
            items.append((h.key, [h.buf]))
        res = self.puts.put_parts(items)
        errors = []
        for h, r in zip(batch, res):
            h.committed = r == 0
            if r != 0:
                h.failed = to_error(r, f"put of {h.key!r}")
                errors.append(h.failed)
        self.counts["objects_put"] += len(batch) - len(errors)
        self.counts["bytes_put"] += sum(h.nbytes for h, r in zip(batch, res) if r == 0)
        return errors

    def abort(self, handles: Sequence[MooncakeHandle]) -> None:
        if self.streams is not None:
            self.streams.end(handles, aborted=True)
        if self.sessions is not None:
            self.sessions.abort(handles, quiet=self.streams is not None and self.streams.quiet())
        self.reservations.end(handles)

    def close(self) -> None:
        """At the backend's close: open reservations end (their sessions revoked, best effort)."""
        open_ = self.reservations.handles()
        if self.sessions is not None and open_ and not self.client.closed:
            self.sessions.abort(open_)
        self.reservations.clear()
