"""The embedded pool: a single-host object store shared by several processes, no server.

The pool directory (``embedded_path``, on tmpfs) holds ``arena`` (the bytes, ``mmap``'d by every
process), ``index.lmdb`` (the metadata, one LMDB write transaction per batch), ``leases`` (object
generations and per-backend lease rows), the ``LW_POOL`` marker and three ``flock`` files. The
design, the rules it keeps and the measurements behind it: packages/lw-core/docs/embedded.md.

Modules, one job each:

* ``backend``  -- ``EmbeddedBackend``: construction, close, re-attach to a replaced pool; it owns
  the collaborators below and takes the rest as mixins.
* ``records``  -- record formats (LMDB values), counters, ``EmbeddedHandle``, constants.
* ``pool_files`` -- ``PoolFiles``: create, check, attach to and map the pool files (index, arena, leases).
* ``writer_lock`` -- ``WriterLock``: the writer lock (an ``flock`` with a deadline, and a thread lock).
* ``txn``      -- ``Tx``, one write transaction, and the read/write transaction runners.
* ``sweep``    -- reclaiming dead writers' reservations, and eviction (CLOCK over the LRU order).
* ``ops``      -- the ``Backend`` protocol operations (lookup, reserve, write, read, view, ...).
* ``stream``   -- the optional streaming extension (publish a prefix before commit, wait for it).
* ``verify``   -- ``stats`` and the full-index consistency check.
* ``leases``   -- per-process lease rows and per-page object generations (no pool-wide lock).
* ``fences``   -- the full memory fences those lock-free reads need, per CPU (refused without one).
* ``files``    -- who may own the pool directory and files, ``O_NOFOLLOW``, space reserved up front.
* ``env``      -- one LMDB environment per process and path, ``flock`` with a deadline.
* ``arena_alloc`` -- the arena's free extents, kept in LMDB.

Whether a reservation's or a lease row's owner (pid namespace, pid, start time) still lives is
``lw_core.procs`` (shared with the other stores' streaming, which do not need LMDB).
"""

from lw_core.backends.embedded.backend import EmbeddedBackend
from lw_core.backends.embedded.records import COUNTERS, FORMAT, PAGE, EmbeddedHandle

__all__ = ["COUNTERS", "FORMAT", "PAGE", "EmbeddedBackend", "EmbeddedHandle"]
