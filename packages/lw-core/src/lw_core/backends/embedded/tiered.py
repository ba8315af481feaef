"""``TieredReads``: the reading half of the protocol when the disk tier (``disk_tier``) is on.

DRAM first (``ObjectReader``), then disk: ``lookup`` counts a key held by either tier
(``lookup_tiers`` names the tier of each), ``open``
hands out a ``DiskHandle`` where DRAM misses and disk hits, and ``read``/``view``/``intact``/
``release`` route each handle to the tier it came from. ``reserve`` refuses keys already on disk
(objects are write-once). Holds no state of its own; ``local`` is the backend's counters."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lw_core.backend import TIER_DISK, TIER_DRAM, Buffer
from lw_core.backends.embedded.disk_format import DiskHandle
from lw_core.backends.embedded.disk_tier import DiskTier
from lw_core.backends.embedded.object_reader import ObjectReader
from lw_core.backends.embedded.object_writer import ObjectWriter
from lw_core.backends.embedded.records import encode_keys


class TieredReads:
    """Reads over ``reader`` (DRAM) then ``disk``; ``read_dram`` reads DRAM (and streaming) handles."""

    def __init__(
        self,
        disk: DiskTier,
        reader: ObjectReader,
        writer: ObjectWriter,
        *,
        read_dram: Callable[[Sequence[Any], Sequence[int], Sequence[Buffer]], None],
        usable: Callable[[], None],
        local: dict[str, int],
    ) -> None:
        self.disk = disk
        self.reader = reader
        self.writer = writer
        self.read_dram = read_dram
        self.usable = usable
        self.local = local

    def lookup(self, keys: Sequence[str]) -> int:
        return len(self.lookup_tiers(keys))

    def lookup_tiers(self, keys: Sequence[str]) -> list[str]:
        """The tier of each leading key held by either (DRAM first, as ``open`` reads)."""
        n = self.reader.lookup(keys)
        out = [TIER_DRAM] * n
        bkeys = encode_keys(keys)
        while n < len(keys):  # past the DRAM prefix: each key in either tier
            if self.disk.has(bkeys[n]):
                out.append(TIER_DISK)
                n += 1
                continue
            more = self.reader.lookup(keys[n:])
            if not more:
                break
            out += [TIER_DRAM] * more
            n += more
        return out

    def reserve(self, keys: Sequence[str], nbytes: int) -> list[Any]:
        on_disk = [self.disk.known(bk) for bk in encode_keys(keys)]  # write-once: committed on disk
        if not any(on_disk):
            return self.writer.reserve(keys, nbytes)
        got = iter(self.writer.reserve([k for k, d in zip(keys, on_disk) if not d], nbytes))
        return [None if d else next(got) for d in on_disk]

    def open(self, keys: Sequence[str]) -> list[Any]:
        out: list[Any] = self.reader.open(keys)
        if all(h is not None for h in out):
            return out
        bkeys = encode_keys(keys)
        miss = [i for i, h in enumerate(out) if h is None]
        try:
            disk = self.disk.open_many([keys[i] for i in miss], [bkeys[i] for i in miss])
        except BaseException:  # the DRAM handles' leases go back too: the caller gets no handle
            self.reader.release([h for h in out if h is not None])
            raise
        for i, d in zip(miss, disk):
            if d is not None:  # a hit on disk is a hit (its handle reads the file)
                out[i] = d
                self.local["open_hits"] += 1
                self.local["open_misses"] -= 1
        return out

    def read(self, handles: Sequence[Any], offsets: Sequence[int], dsts: Sequence[Buffer]) -> None:
        if not any(type(h) is DiskHandle for h in handles):
            self.read_dram(handles, offsets, dsts)
            return
        self.usable()
        if not (len(handles) == len(offsets) == len(dsts)):
            raise ValueError(f"embedded pool: read got {len(handles)} handles, {len(offsets)} offsets, {len(dsts)} dsts")
        rest = [i for i, h in enumerate(handles) if type(h) is not DiskHandle]
        for h, off, dst in zip(handles, offsets, dsts):
            if type(h) is DiskHandle:
                self.disk.read(h, off, dst)
        if rest:
            self.read_dram([handles[i] for i in rest], [offsets[i] for i in rest], [dsts[i] for i in rest])

    def view(self, handle: Any, offset: int, nbytes: int) -> memoryview | None:
        if type(handle) is DiskHandle:
            self.usable()
            return self.disk.view(handle, offset, nbytes)  # a copy: the file is not mapped
        return self.reader.view(handle, offset, nbytes)

    def view_addresses(self, handles: Sequence[Any], offset: int, nbytes: int) -> Any:
        if any(type(h) is DiskHandle for h in handles):
            return None  # a disk hit's bytes are not in the arena
        return self.reader.view_addresses(handles, offset, nbytes)

    def address_table(self, handles: Sequence[Any]) -> Any:
        if any(type(h) is DiskHandle for h in handles):
            return None  # a disk hit's bytes are not in the arena
        return self.reader.address_table(handles)

    def intact(self, handles: Sequence[Any]) -> list[bool]:
        rest = [i for i, h in enumerate(handles) if type(h) is not DiskHandle]
        if len(rest) == len(handles):
            return self.reader.intact(handles)
        out = [True] * len(handles)  # a disk view is a copy of checked bytes: it cannot go stale
        for i, ok in zip(rest, self.reader.intact([handles[i] for i in rest]) if rest else []):
            out[i] = ok
        return out

    def release(self, handles: Sequence[Any]) -> None:
        for h in handles:
            if type(h) is DiskHandle:
                self.disk.release(h)
        self.reader.release([h for h in handles if type(h) is not DiskHandle])
