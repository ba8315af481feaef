"""The Backend protocol: what the layer pipeline needs from a pool store.

An object holds all layers of one chunk, layer-major (``[L0][L1]...``), so one layer of it is a
ranged read or write at a fixed offset. Rules every backend keeps:

* Only committed objects are visible: ``lookup`` and ``open`` never return an object that is
  reserved but not yet committed, and a writer that dies before ``commit`` leaves nothing visible.
* Objects are write-once: ``reserve`` returns ``None`` for a key that is already committed or being
  written by someone else (the caller just skips saving it).
* ``open`` takes a lease: a leased object is not evicted until ``release`` (or the lease expires).
* Calls are batched (one call per layer for a whole step, never one per block).
* Failures raise ``BackendError`` subclasses with a clear message; they never hang: a backend that
  talks to a server bounds every call.

Optional extension, streaming (``StreamingBackend``; ``supports_streaming(backend)`` tells): a
writer makes a *prefix* of a reserved object readable before ``commit``, so a reader can pull
layer i while the writer still computes layer i+1 (an object is layer-major, so layers 0..i are
the bytes ``[0, (i+1) * layer_nbytes)``; ``publish_layers``/``wait_layers`` below convert). Rules:

* ``publish(handles, upto)``: bytes ``[0, upto)`` of each reservation are final; the writer never
  writes them again. The published prefix only grows (a smaller ``upto`` is a no-op). Publishing
  is not committing: ``lookup`` and ``open`` still do not see the object until ``commit``.
* ``open_streaming(keys)``: a handle on the reservation (or the committed object) that holds each
  key now, ``None`` where there is neither. The handle is tied to that very reservation: if it is
  aborted, its writer dies, or it is evicted after commit, the handle fails; it never reads a later
  reservation of the same key (abort, then reserve again).
* ``wait_published(handles, upto, timeout_s) -> list[bool]``: blocks until ``[0, upto)`` of each
  handle is published (or the object committed), at most ``timeout_s``. ``False`` where it is not
  readable: the deadline passed, or (answered promptly, not at the deadline) the reservation was
  aborted or reclaimed, or its writer is dead.
* ``read`` on streaming handles copies only published bytes of their own reservation, and raises
  ``ObjectMissing`` otherwise (range beyond the published prefix, reservation gone). ``view`` is
  not offered for them (no lease pins the space); ``release`` ends them (a no-op where nothing is
  held).
* An abandoned reservation (aborted, writer dead) never becomes committed or visible to
  ``lookup``/``open``: only ``commit`` by its writer publishes the whole object.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

# Anything exposing the buffer protocol (memoryview, bytearray, numpy array). Writable for reads.
Buffer = Any


class BackendError(RuntimeError):
    """A pool operation failed; the caller recomputes (loads) or skips publishing (saves)."""


class BackendUnavailable(BackendError):
    """The store cannot be reached (server down, partitioned); retry later."""


class ObjectMissing(BackendError):
    """An object that was looked up (or leased) is gone."""


class PoolFull(BackendError):
    """No room for a new object even after eviction."""


class Lent(Protocol):
    """Bytes a backend read into memory of its own (``read_lent``): ``views[i]`` holds the range
    asked of ``handles[i]``. The memory is the caller's to read until ``give_back``, which the
    caller calls once, after the last copy that reads the views has completed (never, if it cannot
    tell: the backend then never reuses it). The backend never writes the views before that."""

    views: Sequence[Buffer]

    def give_back(self) -> None: ...


class Handle(Protocol):
    key: str
    nbytes: int


# A backend's own handle class. Each backend is a ``Backend[ItsHandle]``: what ``reserve``/``open``
# return is what its ``write``/``read``/``commit``/... take, so mypy checks a backend's methods
# against each other; the pipeline, which never looks inside a handle, holds a ``Backend[Any]``.
H = TypeVar("H", bound=Handle)


@runtime_checkable
class Backend(Protocol[H]):
    name: str

    def lookup(self, keys: Sequence[str]) -> int:
        """Number of leading keys that are committed (stop at the first miss)."""

    def reserve(self, keys: Sequence[str], nbytes: int) -> list[H | None]:
        """Reserve space for new objects of ``nbytes`` each; ``None`` where a key exists already,
        is being written by another writer, or cannot fit."""

    def write(self, handles: Sequence[H], offsets: Sequence[int], srcs: Sequence[Buffer]) -> None:
        """Copy ``srcs[i]`` into reserved object ``handles[i]`` at ``offsets[i]``."""

    def commit(self, handles: Sequence[H]) -> None:
        """Publish fully written objects, each atomically."""

    def abort(self, handles: Sequence[H]) -> None:
        """Drop reservations; nothing becomes visible."""

    def open(self, keys: Sequence[str]) -> list[H | None]:
        """Lease committed objects for reading; ``None`` where missing."""

    def read(self, handles: Sequence[H], offsets: Sequence[int], dsts: Sequence[Buffer]) -> None:
        """Copy ``len(dsts[i])`` bytes of object ``handles[i]`` from ``offsets[i]`` into ``dsts[i]``."""

    def release(self, handles: Sequence[H]) -> None:
        """End read leases."""

    def view(self, handle: H, offset: int, nbytes: int) -> memoryview | None:
        """A zero-copy window into an object (writable for reserved handles), or ``None`` when the
        store is not host-addressable; callers then use ``read``/``write``."""

    # Optional: ``lookup_tiers(keys) -> list[str]``, ``lookup`` that also names the tier each
    # leading committed key is held in (``TIER_DRAM``, ``TIER_DISK``): a backend with tiers (the
    # embedded pool's disk tier) provides it; the function ``lookup_tiers`` answers for any backend.

    # Optional: ``intact(handles) -> list[bool]``, whether each leased object still holds its own
    # bytes (not evicted, its space not reused). A backend whose ``view`` windows can outlive the
    # object (a lease that expired) provides it; the pipeline calls it after copying from views and
    # fails the objects that went meanwhile, so their blocks are recomputed.

    # Optional: ``host_regions() -> list[memoryview]``, the host memory this process maps that
    # every ``view`` window lies in (the embedded pool: its arena). A device copier registers it
    # with the device once (``LayerPipeline`` hands it over), so copies to and from views need no
    # staging. Each memoryview keeps its range mapped while the copier holds it. With it, optional:
    # ``host_regions_epoch() -> int``, a value that changes whenever ``host_regions`` would answer
    # differently (the embedded pool re-attached to a pool made anew at its path): the pipeline
    # then registers the new memory, and the copier lets the old go once no copy uses it.
    # With it, optional: ``view_addresses(handles, offset, nbytes) -> int64 array | None``, the host
    # addresses of ``view``'s windows for a batch (same checks and lease renewals as ``view``), so a
    # device copier moves a batch by address with no Python object per window. With that,
    # optional: ``address_table(handles) -> table | None`` and ``table_addresses(table, rows,
    # offset, nbytes)``: the same for the handles at ``rows`` of a table built once per step (the
    # pipeline asks for every layer's batches of the same handles); and with a table,
    # ``table_intact(table, rows) -> bool array``: ``intact`` of the handles at ``rows``.
    # Optional: ``read_lent(handles, offsets, nbytes) -> Lent | None``, ``read`` of ``nbytes`` from
    # each handle at ``offsets[i]`` into memory the backend owns and lends (``Lent``), for a store
    # whose reads land in host memory it registered for its own transfers anyway (Mooncake's get
    # arena, also in ``host_regions``): the pipeline copies from the views into the KV cache, so
    # nothing passes through a staging buffer, and a device copier moves them by the direct
    # mechanisms. None where the backend has no room or no such memory (the caller reads into
    # staging). A call that raises lends nothing (memory a late call may still write is the
    # backend's to keep).
    # Optional: ``write_buffers(handles, offsets, nbytes) -> list | None``, for reservations whose
    # ``view`` is None because ``write`` must send the bytes on (Mooncake's put sessions): the
    # reservations' own memory at those ranges (in ``host_regions``), for the caller to fill and
    # then hand to ``write``, which sends from it with no copy. The memory is the reservation's:
    # the caller neither commits nor aborts a handle while a copy into its buffer may still run.
    # None where the backend has no such memory (the caller writes from staging).
    # Optional: ``purge(prefix, timeout_s) -> dict[str, int]``, remove every committed object whose
    # key starts with ``prefix`` ("" = all) and keep reservations under it from being published;
    # counts: ``objects``, ``bytes``, ``reservations``, ``disk_objects`` removed, and ``leased``,
    # objects still being read at ``timeout_s``, which stay. vLLM's prefix-cache reset (the
    # connector's ``reset_cache``) purges the engine's model; a backend without it says so and the
    # reset reports failure. ``supports_purge(backend)`` tells.

    def stats(self) -> dict[str, int]:
        """Counters (objects, bytes, evictions, ...) for metrics."""

    def close(self) -> None: ...


@runtime_checkable
class StreamingBackend(Backend[H], Protocol[H]):
    """A backend with the optional streaming extension (the rules are in the module docstring)."""

    def publish(self, handles: Sequence[H], upto: int) -> None:
        """Make bytes ``[0, upto)`` of each reserved object readable by streaming readers."""

    def open_streaming(self, keys: Sequence[str]) -> list[H | None]:
        """Handles on the reservation or committed object holding each key; ``None`` where none."""

    def wait_published(self, handles: Sequence[H], upto: int, timeout_s: float) -> list[bool]:
        """Whether ``[0, upto)`` of each handle became readable within ``timeout_s``; ``False``
        (promptly) for aborted reservations and dead writers, at the deadline otherwise."""


STREAMING_METHODS = ("publish", "open_streaming", "wait_published")

TIER_DRAM = "dram"  # host memory (the embedded pool's arena, a store's memory)
TIER_DISK = "disk"  # the embedded pool's disk tier


def lookup_tiers(backend: Any, keys: Sequence[str]) -> list[str]:
    """The tier of each leading committed key (as many as ``lookup`` counts): the backend's own
    ``lookup_tiers`` where it has tiers, else ``TIER_DRAM`` for each."""
    tiers = getattr(backend, "lookup_tiers", None)
    if callable(tiers):
        return list(tiers(keys))
    return [TIER_DRAM] * backend.lookup(keys)


def supports_streaming(backend: Any) -> bool:
    """Whether ``backend`` offers the optional streaming extension."""
    return all(callable(getattr(backend, m, None)) for m in STREAMING_METHODS)


def supports_purge(backend: Any) -> bool:
    """Whether ``backend`` can remove objects by key prefix (the optional ``purge``)."""
    return callable(getattr(backend, "purge", None))


def _layer_bytes(upto_layer: int, layer_nbytes: int) -> int:
    if isinstance(upto_layer, bool) or not isinstance(upto_layer, int) or upto_layer < 0:
        raise ValueError(f"upto_layer={upto_layer!r} must be an int >= 0")
    if isinstance(layer_nbytes, bool) or not isinstance(layer_nbytes, int) or layer_nbytes <= 0:
        raise ValueError(f"layer_nbytes={layer_nbytes!r} must be an int > 0")
    return (upto_layer + 1) * layer_nbytes


def publish_layers(backend: StreamingBackend[H], handles: Sequence[H], upto_layer: int, layer_nbytes: int) -> None:
    """Publish layers ``0..upto_layer`` of layer-major objects of ``layer_nbytes`` per layer."""
    backend.publish(handles, _layer_bytes(upto_layer, layer_nbytes))


def wait_layers(
    backend: StreamingBackend[H], handles: Sequence[H], layer: int, layer_nbytes: int, timeout_s: float
) -> list[bool]:
    """Wait (at most ``timeout_s``) until layers ``0..layer`` of each handle are readable."""
    return backend.wait_published(handles, _layer_bytes(layer, layer_nbytes), timeout_s)
