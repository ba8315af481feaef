"""The optional streaming extension of ``MooncakeBackend`` (rules: ``lw_core.backend``): its design,
and the formats of its objects (head, segment header, abort marker).

Mooncake makes an object readable only whole (a put, or the end of a put session), so a
reservation's published prefix cannot be made readable in place (the object itself becomes
readable at ``commit``; with put sessions its layers are already in the store, unreadable). Instead
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
* ``commit`` puts the object (or ends its put session) as before, then removes the head and the segments. ``abort`` (and a
  failed put, and ``close`` with reservations open) first puts an abort marker
  ``<key>#x<token>``, so waiters fail at once, then removes them.

Removal respects Mooncake's read leases (``--default_kv_lease_ttl``) for segments and markers: a
segment a reader fetched a moment ago cannot be removed until its lease ends, and the master grants
that lease on ``batch_is_exist`` too (measured: a segment a waiter polled refuses ``batch_remove``
with OBJECT_HAS_LEASE), so nearly every segment outlives its commit by about one lease. What could not be
removed is retried from later calls (``StreamWriter.collect``), so while streaming the pool holds a
reservation's bytes twice from its first publish until shortly after commit (plus the lease).
Markers are kept ``MARKER_KEEP_S`` for readers that poll late, then removed the same way (the
policy, shared with memcache: ``lw_core.backends.segment_stream.policy``).

Costs while streaming: per ``reserve`` batch one ``batch_is_exist`` and one put (heads); per
``publish`` one put of the layer's bytes (the prefiller sends each byte twice: segment and
object); per ``commit`` one ``batch_remove``. When the store stops answering (a call past
``mooncake_call_timeout_s``), publishing and the clean-up after commit and abort are skipped for
``QUIET_S``: a dead master must not cost every layer's publish its own deadline in the save path
(readers then wait for their deadline and recompute, as without streaming).

The writer's side is ``lw_mooncake.stream_write.StreamWriter``, the reader's
``lw_mooncake.stream_read.StreamReader``. Invariant of the formats: a head is used only when it is
whole, of its key and unchanged (a BLAKE2b digest keyed by the key); a segment's 8-byte header is
its start in its object.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from lw_core.backends.segment_stream.head import HEAD, StreamHead
from lw_core.backends.segment_stream.head import pack_head as pack_stream_head
from lw_core.backends.segment_stream.head import unpack_head as unpack_stream_head
from lw_core.procs import Owner

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


__all__ = ["HEAD_MAGIC", "HEAD_SIZE", "MARKER", "SEG_HEADER", "pack_head", "unpack_head"]
