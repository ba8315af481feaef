"""``StagedGets``: ranged gets (``get_into_ranges``) through registered get staging into the
caller's buffers, or straight into an extent of the get arena lent to the caller (``lent``); gets
of whole objects (``batch_get_into``) into the get arena (``lw_mooncake.get_arena``; registered
once, with Mooncake and, through the backend's ``host_regions``, with a device) or, without room
there, into a buffer registered for the call; and the count of the bytes they read
(``counts["bytes_read"]``).

Invariants:

* One batch at a time uses the staging (its lock is held from the call to the copy out); callers
  size each batch to fit ``staging_size``.
* Bytes reach the caller's buffers only from a call that returned them whole; a get past its
  deadline retires the staging (``lw_mooncake.buffers.Staging``) or its whole-get buffer, as the
  late call may still write it. A whole-get buffer is never let go while registered: a get that
  raises anything hands it to ``LateBuffers``, which unregisters it before dropping it; arena
  extents given to such a get are freed only once it has returned (``Arena.hold_late``).
* An object that is gone is ``ObjectMissing`` (or, where asked, reported and left out); any other
  failure is the lw-core error of its status (``lw_mooncake.errors``).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from lw_core.backend import BackendError, BackendUnavailable, ObjectMissing
from lw_mooncake.buffers import Staging
from lw_mooncake.client import StoreClient
from lw_mooncake.errors import OBJECT_NOT_FOUND, to_error
from lw_mooncake.get_arena import ArenaLend, GetArena

# A ranged get: the object's key, the offset in it, and the buffer its bytes go to.
Range = tuple[str, int, np.ndarray]


class StagedGets:
    def __init__(self, client: StoreClient, staging_size: int, arena: GetArena | None = None) -> None:
        self.client = client
        self.staging_size = staging_size
        self.arena = arena  # where whole gets land when it has room (``lw_mooncake.get_arena``)
        self._staging = Staging(client.store, staging_size, client.calls, "get")
        self.counts: Counter[str] = Counter()
        self._late = self._staging.late  # buffers of failed whole gets (never read)

    def ranges(self, batch: list[Range], *, missing_ok: bool = False) -> set[str]:
        """Ranged gets of ``(key, offset, into)``. ``missing_ok``: keys whose object is missing or
        too short are returned (their ``into`` is left as it was) instead of raised."""
        self.client.check_open()
        missing: set[str] = set()
        by_key: dict[str, list[tuple[int, int, np.ndarray]]] = {}
        pos = 0
        for key, off, arr in batch:
            by_key.setdefault(key, []).append((pos, off, arr))
            pos += arr.nbytes
        keys = list(by_key)
        with self._staging.lock:
            buf = self._staging.get()
            try:
                res = self.client.calls.call(
                    "get_into_ranges", self.client.store.get_into_ranges, [int(buf.ctypes.data)], [keys],
                    [[[p for p, _, _ in by_key[k]] for k in keys]], [[[o for _, o, _ in by_key[k]] for k in keys]],
                    [[[a.nbytes for _, _, a in by_key[k]] for k in keys]])
            except BackendUnavailable as e:
                self._staging.retire(e)
                raise
            for k, got in zip(keys, res[0]):
                if missing_ok and any(n != arr.nbytes and not (n <= -900 or n == -1)
                                      for (_, _, arr), n in zip(by_key[k], got)):
                    missing.add(k)
                    continue
                for (p, _, arr), n in zip(by_key[k], got):
                    if n < 0:
                        raise to_error(n, f"ranged get of {k!r}") if n != OBJECT_NOT_FOUND else ObjectMissing(
                            f"ranged get of {k!r}: the object is gone (evicted, or the master restarted)")
                    if n != arr.nbytes:
                        raise BackendError(f"ranged get of {k!r}: {n} of {arr.nbytes} bytes")
                    arr[:] = buf[p : p + n]
        self.counts["bytes_read"] += pos
        return missing

    def lent(self, items: list[tuple[str, int]], nbytes: int) -> ArenaLend | None:
        """Ranged gets of ``nbytes`` at each ``(key, offset)`` of ``items`` in one call, straight
        into one extent of the get arena, lent to the caller (views in the order of ``items``);
        None without an arena, or room in it. An extent given to a call that raised stays taken
        until the call has returned (``Arena.hold_late``); one whose call returned an error is
        free again at once."""
        arena = self.arena
        if arena is None or not items or nbytes <= 0:
            return None
        self.client.check_open()
        got = arena.take([nbytes * len(items)])
        if got is None:
            return None
        (off,) = got
        by_key: dict[str, list[tuple[int, int]]] = {}  # key -> [(position in the extent, offset in the object)]
        for j, (key, obj_off) in enumerate(items):
            by_key.setdefault(key, []).append((j * nbytes, obj_off))
        keys = list(by_key)
        try:
            res = self.client.calls.call(
                "get_into_ranges", self.client.store.get_into_ranges, [arena.base + off], [keys],
                [[[p for p, _ in by_key[k]] for k in keys]], [[[o for _, o in by_key[k]] for k in keys]],
                [[[nbytes] * len(by_key[k]) for k in keys]])
        except BaseException as e:
            arena.hold_late([off], e)  # Mooncake may still write it
            raise
        try:
            answers = res[0] if len(res) == 1 else None
            if answers is None or len(answers) != len(keys):
                raise BackendError(f"get_into_ranges answered {len(res)} buffers for one, or not one list per key")
            for k, sizes in zip(keys, answers):
                if len(sizes) != len(by_key[k]):
                    raise BackendError(f"ranged get of {k!r}: {len(sizes)} answers for {len(by_key[k])} ranges")
                for n in sizes:
                    if n < 0:
                        raise to_error(n, f"ranged get of {k!r}") if n != OBJECT_NOT_FOUND else ObjectMissing(
                            f"ranged get of {k!r}: the object is gone (evicted, or the master restarted)")
                    if n != nbytes:
                        raise BackendError(f"ranged get of {k!r}: {n} of {nbytes} bytes")
        except BaseException:
            arena.hold_at(off, 0)  # the call has returned: nothing writes it any more
            raise
        self.counts["bytes_read"] += nbytes * len(items)
        self.counts["arena_range_gets"] += 1
        return ArenaLend(arena, off, [arena.buf[off + j * nbytes : off + (j + 1) * nbytes] for j in range(len(items))])

    def whole(self, keys: list[str], sizes: dict[str, int], fetched: dict[str, np.ndarray]) -> None:
        """The objects ``keys`` (of ``sizes``, together within the staging size) into ``fetched``:
        one ``batch_get_into`` straight into extents of the get arena when it has room (held, with
        no holder yet: the caller says how many read handles hold each, ``GetArena.hold``), else
        into a fresh buffer of their total size, registered for that call only, whose slices
        become the copies (no second copy out of shared staging). An object gone since its size
        was read is left out; the memory of a call past its deadline is retired (kept, never
        read), as the late call may still write it."""
        self.client.check_open()
        self._late.prune()
        offs_in = self.arena.take([sizes[k] for k in keys]) if self.arena is not None and keys else None
        if offs_in is not None:
            self._whole_in_arena(keys, sizes, fetched, offs_in)
            return
        offs = np.cumsum([0] + [sizes[k] for k in keys[:-1]]).tolist()
        total = offs[-1] + sizes[keys[-1]] if keys else 0
        if total > self.staging_size:
            raise BackendError(f"whole get of {total} bytes exceeds mooncake_staging_size={self.staging_size}")
        buf = np.empty(total, np.uint8)
        base = int(buf.ctypes.data)
        store, calls = self.client.store, self.client.calls
        try:
            rc = calls.call("register_buffer (whole get)", store.register_buffer, base, total)
        except BackendUnavailable as e:
            self._late.keep(buf, e)  # a late registration: unregistered once it returns
            raise
        if rc != 0:
            raise to_error(rc, f"register_buffer of {total} bytes (whole get)")
        try:
            res = calls.call("batch_get_into", store.batch_get_into, keys, [base + o for o in offs],
                             [sizes[k] for k in keys])
        except BaseException as e:  # still registered: never freed under Mooncake
            self._late.keep(buf, e)  # unregistered once the call has returned (at once for an error it raised)
            raise
        try:
            rc = calls.call("unregister_buffer (whole get)", store.unregister_buffer, base)
        except BackendUnavailable:
            rc = -1
        if rc != 0:
            self._late.keep_forever(buf)  # left registered: never freed under Mooncake
        for k, o, n in zip(keys, offs, res):
            if n == sizes[k]:
                fetched[k] = buf[o : o + n]
                self.counts["bytes_read"] += n
            elif n != OBJECT_NOT_FOUND:
                raise to_error(n, f"get of {k!r}") if n < 0 else BackendError(
                    f"get of {k!r}: {n} of {sizes[k]} bytes")

    def _whole_in_arena(self, keys: list[str], sizes: dict[str, int], fetched: dict[str, np.ndarray], offs: list[int]) -> None:
        arena = self.arena
        assert arena is not None
        try:
            res = self.client.calls.call("batch_get_into", self.client.store.batch_get_into, keys,
                                         [arena.base + o for o in offs], [sizes[k] for k in keys])
        except BaseException as e:
            arena.hold_late(offs, e)  # freed once the call has returned
            raise
        self.counts["arena_gets"] += 1
        error: BackendError | None = None
        for k, o, n in zip(keys, offs, res):
            if n == sizes[k]:
                fetched[k] = arena.buf[o : o + n]
                self.counts["bytes_read"] += n
                continue
            arena.hold_at(o, 0)  # nothing of it is used: free
            if n != OBJECT_NOT_FOUND and error is None:
                error = to_error(n, f"get of {k!r}") if n < 0 else BackendError(f"get of {k!r}: {n} of {sizes[k]} bytes")
        if error is not None:
            raise error  # the caller lets the extents in ``fetched`` go
