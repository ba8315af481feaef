"""``StreamReader``: the reader's side of Mooncake streaming (the design: ``lw_mooncake.streaming``):
``open_streaming``, ``wait_published`` (it is the poll's store, ``PollStore``) and reads through
streaming handles. It holds no state of its own: a streaming handle carries its token, size and
writer, and whether it reads the committed object now (``committed``) or is ``dead``.

Invariants: bytes come only from a segment named by the handle's token whose header says it
starts where the read starts (only that reservation's writer puts such names, and a Mooncake
object never changes while it exists), or from the committed object of the key: objects are
write-once and a key names its content, so any committed object of the key is the whole, right
object. A handle is adopted (reads the object) only when the committed object has its size, and
is dead otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lw_core.backend import BackendError, ObjectMissing
from lw_core.backends.segment_stream import abort_key, head_key, seg_key, wait_published
from lw_core.backends.segment_stream.checks import check_lengths, check_range
from lw_mooncake.buffers import byte_view
from lw_mooncake.client import StoreClient
from lw_mooncake.gets import StagedGets
from lw_mooncake.handle import MooncakeStreamHandle
from lw_mooncake.streaming import HEAD_SIZE, SEG_HEADER, unpack_head


class StreamReader:
    """Streaming reads through ``client`` (existence, sizes) and ``gets`` (ranged gets)."""

    def __init__(self, client: StoreClient, gets: StagedGets) -> None:
        self.client = client
        self.gets = gets

    def open_streaming(self, keys: Sequence[str]) -> list[MooncakeStreamHandle | None]:
        out: list[MooncakeStreamHandle | None] = [None] * len(keys)
        if not keys:
            return out
        ks = list(keys)
        n = len(ks)
        ex = self.client.exist(ks + [head_key(k) for k in ks])
        committed = [k for k, r in zip(ks, ex[:n]) if r == 1]
        sizes = self.client.sizes(committed) if committed else {}
        for i, k in enumerate(ks):
            if k in sizes:
                out[i] = MooncakeStreamHandle(k, sizes[k], None, committed=True)
        want = [i for i in range(n) if out[i] is None and ex[n + i] == 1]
        if not want:
            return out
        bufs = {i: np.zeros(HEAD_SIZE, np.uint8) for i in want}
        self.gets.ranges([(head_key(ks[i]), 0, bufs[i]) for i in want], missing_ok=True)
        for i in want:
            head = unpack_head(ks[i], bufs[i].tobytes())
            if head is not None:  # else gone or replaced while read: the caller retries
                out[i] = MooncakeStreamHandle(ks[i], head.nbytes, head.token, head.boot, head.owner)
        return out

    def _streams(self, handles: Sequence[Any], what: str) -> list[MooncakeStreamHandle]:
        for h in handles:
            if not isinstance(h, MooncakeStreamHandle):
                raise BackendError(f"mooncake: {what} needs handles from open_streaming, got {h!r}")
        return list(handles)

    def exists(self, names: list[str]) -> list[int]:
        """``PollStore.exists``: 1 where the object exists, 0 where not."""
        return self.client.exist(names)

    def adopt(self, hs: Sequence[MooncakeStreamHandle]) -> None:
        """Handles whose key is committed now read the object (of their size; else they are dead)."""
        sizes = self.client.sizes([h.key for h in hs])
        for h in hs:
            if h.key in sizes:
                h.committed = sizes[h.key] == h.nbytes
                h.dead = not h.committed

    def wait_published(self, handles: Sequence[Any], upto: int, timeout_s: float) -> list[bool]:
        hs = self._streams(handles, "wait_published")
        return wait_published("mooncake", self, hs, upto, timeout_s, lambda h: h.committed)

    def read(self, handles: Sequence[Any], offsets: Sequence[int], dsts: Sequence[Any]) -> None:
        hs = self._streams(handles, "a streaming read")
        check_lengths(hs, offsets, dsts)
        arrs = [byte_view(d, writable=True, what="read") for d in dsts]
        for h, off, a in zip(hs, offsets, arrs):
            check_range("read", h, off, a.nbytes)
        dead = [h.key for h in hs if h.dead]
        if dead:
            raise ObjectMissing(f"mooncake: streaming read of {len(dead)} abandoned reservation(s) (aborted, writer dead, "
                                f"or released): {dead[:3]}")
        segs = [j for j, h in enumerate(hs) if not h.committed and arrs[j].nbytes]
        done: set[int] = set()
        if segs:
            scratch = {j: np.empty(SEG_HEADER.size + arrs[j].nbytes, np.uint8) for j in segs}
            names = {j: seg_key(hs[j].key, hs[j].token, offsets[j] + arrs[j].nbytes) for j in segs}  # type: ignore[arg-type]
            gone = self.gets.ranges([(names[j], 0, scratch[j]) for j in segs], missing_ok=True)
            late = []
            for j in segs:
                if names[j] in gone:
                    late.append(j)  # not published as such, or removed after a commit or an abort
                elif SEG_HEADER.unpack_from(scratch[j][: SEG_HEADER.size].tobytes())[0] != offsets[j]:
                    raise ObjectMissing(f"mooncake: streaming read of {hs[j].key} [{offsets[j]}, "
                                        f"{offsets[j] + arrs[j].nbytes}) is not one published range")
                else:
                    arrs[j][:] = scratch[j][SEG_HEADER.size :]
                    done.add(j)
            if late:
                marks = self.client.exist([abort_key(hs[j].key, hs[j].token) for j in late])  # type: ignore[arg-type]
                for j, m in zip(late, marks):
                    hs[j].dead = hs[j].dead or m == 1
                self.adopt([hs[j] for j in late if not hs[j].dead])
                short = [hs[j].key for j in late if not hs[j].committed]
                if short:
                    raise ObjectMissing(
                        f"mooncake: streaming read of {len(short)} object(s) beyond their published bytes (or not at a "
                        f"published range), or their reservation is gone: {short[:3]}")
        whole = [j for j in range(len(hs)) if arrs[j].nbytes and j not in done]  # committed ones, all of them
        if whole:
            self.gets.ranges([(hs[j].key, offsets[j], arrs[j]) for j in whole])

