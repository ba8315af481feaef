"""``StreamReader``: the reader's side of memcache streaming (design: ``lw_memcache.streaming``):
``open_streaming``, ``wait_published`` and reads through streaming handles.

Invariants:

* It holds no state of its own beyond the read lease length: a streaming handle carries what it
  reads (the token, or the committed object's address and lease).
* Bytes come only from objects named by the reservation's token (its head and segments), each
  leased for one copy and checked to still exist after it, or from the committed object once its
  trailer holds that token (``adopt``); else the read fails with ``ObjectMissing``.
* Leases on committed objects are ``ObjectReader``'s (``open``/``release``), so ``close`` drops
  them with the others.
* A read whose lease the client refuses for a moment (``errors.LEASE_REFUSED``: a segment or
  object placed where an object this client leased just before was removed) tries it again for up
  to ``LEASE_RETRY_S`` before it fails; the failure says which objects were refused and which are
  not committed (still being written, aborted, or evicted).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from lw_core.backend import BackendError, ObjectMissing
from lw_core.backends.segment_stream import head_key, seg_key, wait_published
from lw_core.backends.segment_stream.checks import check_lengths, check_range
from lw_core.backends.segment_stream.head import HEAD, unpack_head
from lw_memcache import errors
from lw_memcache.client import INFO_READABLE, StoreClient
from lw_memcache.copies import Copier
from lw_memcache.handles import MemcacheStreamHandle, Seg, nbytes_of
from lw_memcache.object_reader import ObjectReader
from lw_memcache.streaming import HEAD_MAGIC, TRAILER, trailer_token

# How long a read tries again a lease the client refuses for a moment (errors.LEASE_REFUSED). The
# client clears the range about 0.8 s after its release on an idle machine; a reader that lost the
# CPU for more than a second before its copy (so the writer's reaper removed that segment within
# the 0.8 s, REMOVE_GRACE_S after the commit) lost the next chunks placed there without the retry.
LEASE_RETRY_S = 3.0


class StreamReader:
    """Streaming reads through the client ``client`` and ``copier``; committed objects are opened
    and released by ``objects``, with read leases of ``read_lease_ms``."""

    def __init__(self, client: StoreClient, copier: Copier, objects: ObjectReader, *, read_lease_ms: int) -> None:
        self.client = client
        self.copier = copier
        self.objects = objects
        self.read_lease_ms = read_lease_ms

    def open(self, keys: Sequence[str]) -> list[MemcacheStreamHandle | None]:
        store = self.client.live()
        out: list[MemcacheStreamHandle | None] = [None] * len(keys)
        if not keys:
            return out
        for i, h in zip(range(len(keys)), self.objects.open(keys)):  # committed: leased, like open
            if h is not None:
                out[i] = MemcacheStreamHandle(h.key, h.nbytes, None, gva=h.gva, leased=True)
        rest = [i for i in range(len(keys)) if out[i] is None]
        if not rest:
            return out
        heads = [head_key(keys[i]) for i in rest]
        res = store.batch_add_lease(heads, self.read_lease_ms)
        leased = [(i, hk) for i, hk, r in zip(rest, heads, res) if r == 0]
        if not leased:
            return out
        try:
            infos = store.batch_get_key_info([hk for _, hk in leased], INFO_READABLE)
            got = [(i, hk, int(info.gva_list()[0])) for (i, hk), info in zip(leased, infos)
                   if info.size() == HEAD.size and len(info.gva_list())]
            bufs = [np.zeros(HEAD.size, np.uint8) for _ in got]
            try:
                self.copier.copy([Seg(hk, HEAD.size, g, 0, False) for _, hk, g in got], [0] * len(got), bufs, to_store=False)
                copied = got
            except ObjectMissing:
                # A head removed after we leased it (its writer aborted, or closed; memcache removes
                # leased objects too) fails the whole batch_copy: copy the others one by one.
                copied = []
                for one, b in zip(got, bufs):
                    try:
                        self.copier.copy([Seg(one[1], HEAD.size, one[2], 0, False)], [0], [b], to_store=False)
                        copied.append(one)
                    except ObjectMissing:
                        pass
                bufs = [b for one, b in zip(got, bufs) if one in copied]
            for (i, _, _), b in zip(copied, bufs):
                head = unpack_head(HEAD_MAGIC, b.tobytes())
                if head is not None:
                    out[i] = MemcacheStreamHandle(keys[i], head.nbytes, head.token, head.boot, head.owner)
        finally:
            store.batch_remove_lease([hk for _, hk in leased])
        lost = [i for i, _ in leased if out[i] is None]
        if lost:  # committed meanwhile? (else: not openable now; the caller tries again)
            for i, h in zip(lost, self.objects.open([keys[i] for i in lost])):
                if h is not None:
                    out[i] = MemcacheStreamHandle(h.key, h.nbytes, None, gva=h.gva, leased=True)
        return out

    def _streams(self, handles: Sequence[Any], what: str) -> list[MemcacheStreamHandle]:
        for h in handles:
            if not isinstance(h, MemcacheStreamHandle):
                raise BackendError(f"memcache: {what} needs handles from open_streaming, got {h!r}")
            if h.token is None and not h.leased:
                h.dead = True  # a committed object's handle, released: it holds nothing any more
        return list(handles)

    def adopt(self, hs: Sequence[MemcacheStreamHandle], *, retry_s: float = 0.0) -> None:
        """Handles whose object is committed now: lease it and keep the handle if the trailer holds
        its token (else a later reservation committed the key: this one is dead). A lease refused
        for a moment is tried again for up to ``retry_s`` (a poll tries again anyway)."""
        got = self.objects.open([h.key for h in hs], retry_s=retry_s)
        pairs = [(h, o) for h, o in zip(hs, got) if o is not None]
        if not pairs:
            return
        bufs = [np.zeros(TRAILER, np.uint8) for _ in pairs]
        try:
            self.copier.copy([Seg(o.key, o.nbytes + TRAILER, o.gva, 0, False) for _, o in pairs], [o.nbytes for _, o in pairs],
                             bufs, to_store=False)
        except BackendError:
            self.objects.release([o for _, o in pairs])
            raise
        wrong = []
        for (h, o), b in zip(pairs, bufs):
            token = trailer_token(b.tobytes())
            if token is not None and token == h.token and o.nbytes == h.nbytes:
                h.gva, h.leased = o.gva, True
            else:
                h.dead = True
                wrong.append(o)
        if wrong:
            self.objects.release(wrong)

    def wait_published(self, handles: Sequence[Any], upto: int, timeout_s: float) -> list[bool]:
        hs = self._streams(handles, "wait_published")
        return wait_published("memcache", _Polls(self, self.client.live()), hs, upto, timeout_s, lambda h: h.leased)

    def read(self, handles: Sequence[Any], offsets: Sequence[int], dsts: Sequence[Any]) -> None:
        hs = self._streams(handles, "a streaming read")
        check_lengths(hs, offsets, dsts)
        store = self.client.live()
        sizes = [nbytes_of(d) for d in dsts]
        for h, off, n in zip(hs, offsets, sizes):
            check_range("read", h, off, n)
        dead = [h.key for h in hs if h.dead]
        if dead:
            raise ObjectMissing(f"memcache: streaming read of {len(dead)} abandoned reservation(s) (aborted, writer dead, or the key "
                                f"was committed by a later reservation): {dead[:3]}")
        idx = [j for j, (h, n) in enumerate(zip(hs, sizes)) if not h.leased and n > 0]
        segs: dict[int, Seg] = {}
        leased: list[str] = []
        try:
            if idx:
                # Not leased and not dead: a handle on a reservation, so it has a token (_streams).
                names = [seg_key(hs[j].key, cast(bytes, hs[j].token), offsets[j] + sizes[j]) for j in idx]
                res = self.client.add_lease(names, self.read_lease_ms, LEASE_RETRY_S)
                leased = [k for k, r in zip(names, res) if r == 0]
                if leased:
                    infos = dict(zip(leased, store.batch_get_key_info(leased, INFO_READABLE)))
                    for j, k in zip(idx, names):
                        info = infos.get(k)
                        if info is not None and info.size() == sizes[j] and len(info.gva_list()):
                            segs[j] = Seg(k, sizes[j], int(info.gva_list()[0]), offsets[j], False)
                missing = [hs[j] for j in idx if j not in segs]
                if missing:  # not published as such; maybe committed meanwhile
                    self.adopt(missing, retry_s=LEASE_RETRY_S)
                    short = [h.key for h in missing if not h.leased]
                    if short:
                        refused = {hs[j].key for j, r in zip(idx, res) if r == errors.LEASE_REFUSED}
                        raise self._missing(
                            store, short, refused,
                            f"memcache: streaming read of {len(short)} object(s) beyond their published bytes (or not at "
                            f"the writer's write ranges), or their reservation is gone",
                        )
            whole = [j for j in range(len(hs)) if j not in segs]
            if whole:
                self.copier.copy([hs[j] for j in whole], [offsets[j] for j in whole], [dsts[j] for j in whole], to_store=False)
            if segs:
                js = list(segs)
                try:
                    self.copier.copy([segs[j] for j in js], [0] * len(js), [dsts[j] for j in js], to_store=False)
                except ObjectMissing:
                    # A segment removed after we leased it (its reservation committed or aborted:
                    # memcache removes leased objects too) makes the whole batch_copy fail (-3102):
                    # copy the ones still there one by one, and treat the others as gone below.
                    for j, r in zip(js, store.batch_is_exist([segs[j].key for j in js])):
                        if r == 1:
                            self.copier.copy([segs[j]], [0], [dsts[j]], to_store=False)
                res = store.batch_is_exist([segs[j].key for j in js])
                gone = [j for j, r in zip(js, res) if r != 1]
                if gone:  # removed before or while being copied: committed (then read the object) or aborted
                    self.adopt([hs[j] for j in gone], retry_s=LEASE_RETRY_S)
                    lost = [hs[j].key for j in gone if not hs[j].leased]
                    if lost:
                        raise self._missing(store, lost, set(),
                                            f"memcache: {len(lost)} segment(s) went while being read: their bytes are not used")
                    self.copier.copy([hs[j] for j in gone], [offsets[j] for j in gone], [dsts[j] for j in gone], to_store=False)
        finally:
            if leased:
                store.batch_remove_lease(leased)

    def _missing(self, store: Any, keys: list[str], refused: set[str], what: str) -> ObjectMissing:
        """The error for streaming reads of ``keys`` that got no bytes (``refused``: those whose
        segment this client was still refused after ``LEASE_RETRY_S``), saying where each object is."""
        try:
            exists = list(store.batch_is_exist(keys))
        except Exception:  # noqa: BLE001 - only the message needs it
            exists = []
        committed = [k for k, r in zip(keys, exists) if r == 1]
        parts = [f"{what}: {keys[:3]}"]
        if refused:
            parts.append(f"this client was refused the lease (code {errors.LEASE_REFUSED}, 'failed to register gva "
                         f"interval') on the published segment of {sorted(refused)[:3]} for {LEASE_RETRY_S} s")
        if committed:
            parts.append(f"committed, but this client could not lease it or it is another reservation's: {committed[:3]}")
        if len(exists) == len(keys):
            gone = [k for k, r in zip(keys, exists) if r != 1]
            if gone:
                parts.append(f"not committed (still being written, aborted, or evicted): {gone[:3]}")
        return ObjectMissing("; ".join(parts))


class _Polls:
    """memcache as ``wait_published``'s store (``lw_core.backends.segment_stream.PollStore``)."""

    def __init__(self, reader: StreamReader, store: Any) -> None:
        self.reader, self.store = reader, store

    def exists(self, names: list[str]) -> list[int]:
        res = list(self.store.batch_is_exist(names))
        if len(res) != len(names) or any(r not in (0, 1) for r in res):
            bad = [r for r in res if r not in (0, 1)]
            self.reader.client.fail(bad[0] if bad else -1, "wait_published (batch_is_exist)")
        return res

    def adopt(self, handles: Sequence[MemcacheStreamHandle]) -> None:
        self.reader.adopt(handles)
