"""The segment-streaming protocol, shared by the backends whose objects become readable only whole
(the memcache and the Mooncake backend packages): a reservation's published prefix is a series of
committed *segment* objects named by a random per-reservation token, found through a *head* object
naming that token, and failed at once by an *abort marker*.

Each piece lives in one module here, so a backend supplies only what its store does differently:

* ``names``  - the object names (head, segment, abort marker);
* ``head``   - the head's layout (token, size, writer) behind a per-backend magic;
* ``checks`` - the argument checks of ``publish``, ``wait_published`` and reads, one copy for all
  backends (the embedded and memory backends use them too);
* ``poll``   - the reader's ``wait_published`` loop over a small ``PollStore`` adapter (one
  existence call per poll, and adopting committed objects), the poll pacing and the judgment of a
  writer's liveness from what its head recorded;
* ``policy`` - the one clean-up policy (how long heads, segments and markers outlive their
  reservation, retries of refused removals, the quiet period after a store timeout), with why;
* ``removals`` - the bounded queue of what waits for removal, and the two collaborators that run
  it: ``reaper.Reaper`` (a thread removing after the grace: memcache) and ``collector.Collector``
  (retries from the backend's own calls, with the quiet period: Mooncake).

What stays in each backend: how its store writes a head, stages and publishes a segment, puts a
marker and removes objects, and how a reader opens a head and copies a segment out (memcache by
leased address, Mooncake by key).
"""

from __future__ import annotations

from lw_core.backends.segment_stream.names import abort_key, head_key, seg_key
from lw_core.backends.segment_stream.poll import (
    POLL_MAX_S,
    POLL_MIN_S,
    PolledHandle,
    PollStore,
    WriterJudge,
    poll_names,
    read_poll,
    wait_published,
)

__all__ = ["POLL_MAX_S", "POLL_MIN_S", "PollStore", "PolledHandle", "WriterJudge", "abort_key", "head_key", "poll_names", "read_poll",
           "seg_key", "wait_published"]
