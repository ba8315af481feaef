"""``SessionWriter``: reservations as Mooncake put sessions, so each layer's bytes go to the store
as that layer is written (``ObjectWriter`` uses it when the client has put sessions).

* ``reserve``: ``batch_put_session_start`` (the master allocates; nothing is visible). A key that is
  stored or in another writer's session (-705), or does not fit (-200), gets None. The reservation
  also keeps its local object (``Reservations``): streaming segments and the commit's gap fill
  read it.
* ``write`` (after ``ObjectWriter`` copied the bytes into the local object): a ranged put of those
  bytes from put staging (``StagedPuts.put_ranges``); the ranges that landed are remembered.
* ``commit``: the ranges never written are put from the local object (zeros, as the whole-object
  path stores them: Mooncake would leave the segment's old bytes there), then
  ``batch_put_session_end`` makes the object readable. ``abort`` and a failed commit revoke.

Invariants (on top of ``ObjectWriter``'s):

* A session is ended only when every byte of its object was written by a ranged put that landed;
  an object whose ranged put failed is revoked, never ended.
* Every session this writer started is ended or revoked (best effort: a revoke that fails is
  logged; the master discards an abandoned session after ``--put_start_discard_timeout_sec``).
  Revokes are skipped for ``QUIET_S`` after a call timed out (here, or streaming's: ``abort(...,
  quiet=True)``), so a frozen master costs an abort no deadline (ranged puts go to the holders,
  not the master, and still answer).
* Its own state: which handles had a write fail (``_bad``), under ``_lock``, and ``quiet``.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence

from lw_core.backend import BackendError, BackendUnavailable
from lw_core.backends.segment_stream.policy import QuietPeriod
from lw_mooncake.errors import INVALID_PARAMS, NO_AVAILABLE_HANDLE, OBJECT_ALREADY_EXISTS, to_error
from lw_mooncake.handle import MooncakeHandle
from lw_mooncake.put_sessions import PutSessions
from lw_mooncake.puts import StagedPuts
from lw_mooncake.reservations import Reservations
from lw_mooncake.reservations import uncovered as gaps  # the ranges of an object no ranged put wrote

log = logging.getLogger(__name__)
_NOT_RESERVED = (OBJECT_ALREADY_EXISTS, NO_AVAILABLE_HANDLE)


class SessionWriter:
    def __init__(self, sessions: PutSessions, puts: StagedPuts, reservations: Reservations, counts: Counter[str]) -> None:
        self.sessions = sessions
        self.puts = puts
        self.reservations = reservations
        self.counts = counts
        self._lock = threading.Lock()
        self._bad: dict[MooncakeHandle, BackendError] = {}
        self.quiet = QuietPeriod()

    def reserve(self, keys: Sequence[str], nbytes: int) -> list[MooncakeHandle | None]:
        res = self.sessions.start(keys, nbytes)
        stale = [k for k, r in zip(keys, res) if r == INVALID_PARAMS and not self.reservations.is_open(k)]
        if stale:  # a session of ours that a failed revoke left behind: revoke it, start again
            self._revoke_keys(stale)
            again = dict(zip(stale, self.sessions.start(stale, nbytes)))
            res = [again.get(k, r) if r == INVALID_PARAMS else r for k, r in zip(keys, res)]
        fatal = [(k, r) for k, r in zip(keys, res) if r != 0 and r not in _NOT_RESERVED and r != INVALID_PARAMS]
        if fatal:
            self._revoke_keys([k for k, r in zip(keys, res) if r == 0])
            raise to_error(fatal[0][1], f"put session start of {fatal[0][0]!r}")
        out = self.reservations.reserve(keys, [int(r != 0) for r in res], nbytes)
        for h in out:
            if h is not None:
                h.session = True
        return out

    def write(self, handles: Sequence[MooncakeHandle], offsets: Sequence[int], nbytes: Sequence[int]) -> None:
        """Puts ``[offsets[i], offsets[i] + nbytes[i])`` of each handle's local object into its
        session; raises the first failure (the failed handles are revoked at commit or abort)."""
        ranges = []
        for h, off, n in zip(handles, offsets, nbytes):
            buf = h.buf
            if buf is not None and n:
                ranges.append((h, off, n, buf[off : off + n]))
        if not ranges:
            return
        try:
            res = self.puts.put_ranges(self.sessions, [(h.key, off, data) for h, off, _, data in ranges])
        except BackendError as e:
            if isinstance(e, BackendUnavailable):
                self.quiet.start()
            with self._lock:
                for h, _, _, _ in ranges:
                    self._bad.setdefault(h, e)
            raise
        errors = []
        with self._lock:
            for (h, off, n, _), r in zip(ranges, res):
                if r == 0:
                    h.sent.append((off, off + n))
                else:
                    errors.append(self._bad.setdefault(h, to_error(r, f"ranged put into {h.key!r}")))
        self.counts["bytes_ranged"] += sum(n for (_, _, n, _), r in zip(ranges, res) if r == 0)
        if errors:
            raise errors[0]

    def commit(self, handles: list[MooncakeHandle]) -> list[BackendError]:
        """Fills each session's unwritten ranges, ends the sessions; marks each handle committed or
        failed (then revoked) and returns the errors."""
        with self._lock:
            for h in handles:
                if h in self._bad:
                    h.failed = self._bad.pop(h)
        fill = [(h, a, b) for h in handles if h.failed is None and h.buf is not None for a, b in gaps(h.sent, h.nbytes)]
        for h, a, b in fill:
            self.reservations.zero(h, [(a, b)])  # an arena extent is not zeroed when taken
        if fill:
            res = self.puts.put_ranges(self.sessions, [(h.key, a, h.buf[a:b]) for h, a, b in fill if h.buf is not None])
            for (h, _, _), r in zip(fill, res):
                if r != 0 and h.failed is None:
                    h.failed = to_error(r, f"ranged put (unwritten bytes) into {h.key!r}")
        ok = [h for h in handles if h.failed is None]
        if ok:
            for h, r in zip(ok, self.sessions.end([h.key for h in ok])):
                h.committed = r == 0
                if r != 0:
                    h.failed = to_error(r, f"put session end of {h.key!r}")
        failed = [h for h in handles if h.failed is not None]
        self._revoke_keys([h.key for h in failed])
        done = [h for h in handles if h.committed]
        self.counts["objects_put"] += len(done)
        self.counts["bytes_put"] += sum(h.nbytes for h in done)
        return [h.failed for h in failed if h.failed is not None]

    def abort(self, handles: Sequence[MooncakeHandle], *, quiet: bool = False) -> None:
        """Revokes the sessions of ``handles`` still held here (call before ``Reservations.end``);
        ``quiet``: another call timed out lately (skip the revoke, as in ``quiet``)."""
        held = [h for h, x in zip(handles, self.reservations.held(handles)) if x and h.session]
        with self._lock:
            for h in held:
                self._bad.pop(h, None)
        if quiet:
            self.quiet.start()
        self._revoke_keys([h.key for h in held])

    def _revoke_keys(self, keys: list[str]) -> None:
        if not keys:
            return
        if self.quiet:
            log.debug("mooncake: %d put session(s) not revoked: the store did not answer lately", len(keys))
            return
        try:
            res = self.sessions.revoke(keys)
        except BackendError as e:
            if isinstance(e, BackendUnavailable):
                self.quiet.start()
            log.warning("mooncake: revoking %d put session(s) failed (%s); the master discards them later", len(keys), e)
            return
        bad = [(k, r) for k, r in zip(keys, res) if r not in (0, INVALID_PARAMS)]
        if bad:
            log.warning("mooncake: revoke of put session %r: %s", bad[0][0], to_error(bad[0][1], "revoke"))
