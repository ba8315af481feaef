"""memcache_hybrid return codes -> lw_core exceptions, each with the code and a hint.

Codes observed with memcache-hybrid 1.3.0 (the library publishes no table):
-3014 the MetaService is unreachable (every call fails at once while it is down; clients reconnect
within about a second after it is back), -3102 / -3007 no such key, -3101 the key exists but is
not readable (still being written), -3106 no lease to remove, -2 direction mismatch (host_tcp right
after a rank joined), -1 generic failure (bad size, unregistered or foreign memory, store full).

``batch_add_lease`` also answers -1 (``LEASE_REFUSED``; the client logs "failed to register gva
interval") for an object that exists and is committed: the client keeps the address range of an
object it leased for about 0.8 s after the release (measured on an idle machine, whatever the
lease's length), and when another client removed that object meanwhile (a streaming writer's reaper,
the MetaService's eviction) and the space went to a new object at an overlapping range, this
client cannot lease the new one until then. It clears by itself (``StoreClient.add_lease`` retries).
"""

from __future__ import annotations

from lw_core.backend import BackendError, BackendUnavailable, ObjectMissing

META_UNREACHABLE = -3014
NOT_READABLE = -3101
NO_SUCH_KEY = -3102
NO_SUCH_KEY_IN_BATCH = -3007
NO_LEASE = -3106
DIRECTION_MISMATCH = -2
LEASE_REFUSED = -1  # batch_add_lease on an existing object: see the module docstring

_HINTS = {
    META_UNREACHABLE: (
        BackendUnavailable,
        "the memcache MetaService is unreachable (down or partitioned); start it with `lw-memcache meta` "
        "and check ock.mmc.meta_service_url in the client config; clients reconnect on their own",
    ),
    NOT_READABLE: (ObjectMissing, "the object is reserved but not yet committed (still being written)"),
    NO_SUCH_KEY: (ObjectMissing, "no such object (never written, evicted, its holder exited, or a reservation outlived memcache_write_lease_s)"),
    NO_SUCH_KEY_IN_BATCH: (ObjectMissing, "no such object (never written, evicted, its holder exited, or a reservation outlived memcache_write_lease_s)"),
    NO_LEASE: (ObjectMissing, "no lease to remove (it expired; raise the lease TTL if reads take longer)"),
    DIRECTION_MISMATCH: (
        BackendError,
        "copy direction rejected: host memory needs H2G/G2H, device memory L2G/G2L; with host_tcp this "
        "also happens right after another client joined (retry after a few seconds)",
    ),
}


def error_for(code: int, what: str) -> BackendError:
    """The exception to raise for return code ``code`` of operation ``what``."""
    cls, hint = _HINTS.get(
        code,
        (BackendError, "see the client log (ock.mmc.log_level in mmc-local.conf) and the MetaService log"),
    )
    return cls(f"memcache {what} failed with code {code}: {hint}")


def is_unavailable(code: int) -> bool:
    return code == META_UNREACHABLE
