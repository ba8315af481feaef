"""The embedded pool: a single-host object store shared by several processes, no server.

The pool directory (``embedded_path``, on tmpfs) holds ``arena`` (the bytes, ``mmap``'d by every
process), ``index.lmdb`` (the metadata, one LMDB write transaction per batch), ``leases`` (object
generations and per-backend lease rows), the ``LW_POOL`` marker and three ``flock`` files. The
design, the rules it keeps and the measurements behind it: packages/lw-core/docs/embedded.md.

Modules, one job each. ``EmbeddedBackend`` is a facade: it owns one of each class below, built
with explicit arguments, and holds only its settings, its own counters and the re-attach check.

* ``backend``  -- ``EmbeddedBackend``: construction, close, re-attach to a replaced pool, and the
  ``Backend`` protocol's methods, each delegating to a collaborator.
* ``pool_files`` -- ``PoolFiles``: create, check, attach to and map the pool files (the LMDB index
  and its tables, the arena mapping, the lease table, ``attach.lock``, the attachment's epoch);
  the read and write transaction runners.
* ``writer_lock`` -- ``WriterLock``: ``writer.lock`` (an ``flock`` with a deadline), the thread
  lock, and ``create.lock``.
* ``object_reader`` -- ``ObjectReader``: lookup, open (leases), read, view, intact, release.
* ``object_writer`` -- ``ObjectWriter``: reserve, write, commit, abort.
* ``sweep``    -- ``Sweeper``: reclaiming dead writers' reservations, eviction (CLOCK over the LRU order).
* ``stream``   -- ``StreamIndex``: the streaming extension (publish a prefix before commit, wait for it).
* ``purge``    -- ``Purger``: removing every object under a key prefix (a model's, or all), DRAM and disk
  (vLLM's prefix-cache reset, ``lw-pool purge``); ``offline``: the same for a pool no engine runs on.
* ``verify``   -- ``Verifier``: the shared counters and the full-index consistency check.
* ``disk_tier`` -- ``DiskTier``: the opt-in local-disk tier (``embedded_disk_path``): evicted objects
  are demoted to files by a writer thread, found again by lookup/open, read with ``pread``.
* ``disk_payload_reads`` -- ``PayloadReads``: a hit's payload from the page cache when it is all
  there, else with direct I/O (``O_DIRECT``), else buffered.
* ``disk_format`` -- the disk tier's file format and read handle.
* ``disk_dir`` -- ``TierDir``: the disk tier's directory shared by processes (its ``LW_DISK_TIER``
  marker with the capacity, the lock and byte count every process evicts against, temporaries).
* ``tiered``   -- ``TieredReads``: lookup, open, read, view, intact, release over DRAM then disk.
* ``txn``      -- ``Tx``, one write transaction plus the counter record.
* ``records``  -- record formats (LMDB values), counters, ``EmbeddedHandle``, key encoding, constants.
* ``leases``   -- ``LeaseTable``: per-process lease rows and per-page object generations (no pool-wide lock).
* ``fences``   -- the full memory fences those lock-free reads need, per CPU (refused without one).
* ``files``    -- who may own the pool directory and files, ``O_NOFOLLOW``, space reserved up front.
* ``env``      -- one LMDB environment per process and path, ``flock`` with a deadline.
* ``arena_alloc`` -- ``ExtentAllocator``: the arena's free extents, kept in LMDB.

Whether a reservation's or a lease row's owner (pid namespace, pid, start time) still lives is
``lw_core.procs`` (shared with the other stores' streaming, which do not need LMDB).
"""

from lw_core.backends.embedded.backend import EmbeddedBackend
from lw_core.backends.embedded.offline import purge_offline
from lw_core.backends.embedded.records import COUNTERS, FORMAT, PAGE, EmbeddedHandle

__all__ = ["COUNTERS", "FORMAT", "PAGE", "EmbeddedBackend", "EmbeddedHandle", "purge_offline"]
