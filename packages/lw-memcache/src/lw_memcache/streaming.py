"""The optional streaming extension of ``MemcacheBackend`` (rules: ``lw_core.backend``): its design,
and what it puts in the store (the trailer, the head's magic). The writer's side is
``lw_memcache.stream_write.StreamWriter``, the reader's ``lw_memcache.stream_read.StreamReader``.

memcache-hybrid only lets a client copy out of objects it holds a *read lease* on, and only
committed objects take one: an unfinished object cannot be read at its address at all (the
client's blob tracker refuses it, -3101/-3102), not even by its writer. And an address proves
nothing: an aborted object's space (once its write lease ends) and an orphaned key's space (taken
over by the next writer) are handed out again at the same address. So a published prefix is made
of separate *committed* objects whose names carry a random per-reservation token:

* ``reserve`` (streaming backend) draws an 8-byte token per reservation, writes it into the last
  ``TRAILER`` bytes of the object (every object is allocated ``nbytes + TRAILER``), and commits a
  small head object ``<key>#h`` naming the token, the size and the writer (boot id, pid
  namespace, pid, start time).
* ``write`` also copies each range into a segment object ``<key>#s<token>/<end>`` (allocated, not
  committed): the prefiller's bytes go to the pool twice while streaming is on.
* ``publish(upto)`` commits the segments that end at or before ``upto``.
* ``commit`` commits the object; ``abort`` (and ``close`` with reservations open) first commits an
  abort marker ``<key>#x<token>``. Either way the head and the segments are removed
  ``REMOVE_GRACE_S`` later, by the reaper (``lw_core.backends.segment_stream.reaper``; at once at
  ``close``): memcache removes leased
  objects too, and a reader's lease on an object removed under it outlives its release in
  memcache-hybrid 1.3.0 (the client keeps renewing it, -3102), so that reader's client can lease
  nothing placed at that address again until the lease ends: the next prompt's head or segment
  landing there would fail to stream. Readers hold leases on heads and segments for one copy, far
  shorter than the grace (the clean-up policy, shared with Mooncake, is
  ``lw_core.backends.segment_stream.policy``).

A reader (``open_streaming``) takes the committed object with a lease when there is one, else reads
the head for the token. ``read`` of a range leases the segment named by the token and the range's
end (reads follow the writer's write ranges: the pipeline writes and reads one layer of an object
per call), copies, checks the segment still exists, and drops the lease: bytes come only from
objects named by this reservation's token, which only its writer creates, while they are leased
and not removed. Once the object is committed the reader leases it and checks its trailer holds
the token (a later reservation of the key writes its own token there before any data), then reads
it whole. ``wait_published`` (``lw_core.backends.segment_stream.poll``) polls (0.5 ms up to
20 ms) whether the segment ending at ``upto`` exists; it answers ``False`` promptly when the abort
marker exists, when the committed object carries another token, or when the writer runs on this
machine and is dead; else at the deadline.

An abandoned reservation never becomes visible: only its writer's ``batch_write_finish`` commits
the object (``lookup``/``open`` are unchanged). Costs while streaming: per ``write`` one more
allocation and copy, per ``publish`` one ``batch_write_finish``, per streaming ``read`` four
metadata calls (lease, info, exists, unlease) for the batch.
"""

from __future__ import annotations

import struct

from lw_core.backends.segment_stream.policy import REMOVE_GRACE_S

TRAILER = 16  # bytes after each object's data: magic + the reservation's token
_TRAILER = struct.Struct("<8s8s")
_TRAILER_MAGIC = b"lwmcTOK1"
HEAD_MAGIC = b"lwmcHED1"  # the head's layout: lw_core.backends.segment_stream.head
MARKER_BYTES = 64  # an abort marker's size (its content is never read)


def pack_trailer(token: bytes) -> bytes:
    """The last ``TRAILER`` bytes of an object reserved with ``token``."""
    return _TRAILER.pack(_TRAILER_MAGIC, token)


def trailer_token(trailer: bytes) -> bytes | None:
    """The token a trailer holds; None when it is not one of ours."""
    magic, token = _TRAILER.unpack(trailer)
    return token if magic == _TRAILER_MAGIC else None


__all__ = ["HEAD_MAGIC", "MARKER_BYTES", "REMOVE_GRACE_S", "TRAILER", "pack_trailer", "trailer_token"]
