"""Full memory fences for the embedded pool's lock-free reads, and the CPUs the pool runs on.

Readers take no pool-wide lock (see ``leases``), so each side orders its own loads and stores with
a full fence wherever the protocol needs one:

* a reader publishes its lease, fences, then checks the object's generation (``open``, ``view``);
  the evictor clears the generation, fences, then checks the leases (``leases.evict``): at least one
  side sees the other's store;
* a reader copies, fences, then re-reads the generation (``read``, ``intact``): a copy that saw any
  byte of a reused extent also sees the tombstone the evictor stored before handing the extent on.
  The first read of a generation (``open``) is followed by a fence too, so the copy's loads come
  after it (an acquire);
* a writer fences between its copies into the arena and publishing them (``commit`` setting the
  generation, ``publish``); a streaming read fences between the record reads and the copy, both ways.

On x86 (TSO: loads are not reordered with loads, nor stores with stores) only the first pair needs a
barrier, and any locked instruction is one. On weakly ordered CPUs (aarch64: Kunpeng, Grace;
ppc64le; ...) every one of them needs a real barrier (``dmb ish``). A lock acquire/release is not
one there: acquire and release are one-way, so a load after the release may be satisfied before a
load before the acquire, and a reader could copy a reused extent and still see the old generation.

The fence: libatomic's ``atomic_thread_fence(memory_order_seq_cst)`` (GCC's runtime library of
atomics, ``libatomic.so.1``, through ctypes: ``mfence`` on x86-64, ``dmb ish`` on aarch64; about
0.5 us a call, at most one per batch operation) wherever it loads. Else, on x86 only, a lock
acquire/release (a locked instruction). A weakly ordered CPU without libatomic has no fence: the
embedded pool refuses to open there (``require_fence``) naming the CPU, what to install and the
other backends, unless ``LW_POOL_EMBEDDED_UNFENCED=1`` says to run anyway, at the risk above.

Callers use ``fences.fence()`` (looked up on the module at each call, so tests can watch it).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import threading
from collections.abc import Callable

from lw_core.backend import BackendError
from lw_core.backends.embedded.records import log

# platform.machine() of CPUs whose memory order is TSO (x86 and x86-64, as Linux and others name them).
TSO_MACHINES = frozenset({"x86_64", "amd64", "i386", "i486", "i586", "i686", "x86"})
LIBATOMIC = "libatomic.so.1"
UNFENCED_ENV = "LW_POOL_EMBEDDED_UNFENCED"
_SEQ_CST = 5  # memory_order_seq_cst

_LOCK = threading.Lock()


def lock_fence() -> None:
    """A lock acquire/release: a full barrier on x86 only (its atomic exchange is a locked instruction)."""
    _LOCK.acquire()
    _LOCK.release()


def load_libatomic(name: str = LIBATOMIC) -> Callable[[], None] | None:
    """libatomic's ``atomic_thread_fence(memory_order_seq_cst)`` as a no-argument callable, or None."""
    try:
        f = ctypes.CDLL(name).atomic_thread_fence
    except (OSError, AttributeError):
        return None
    f.restype = None
    return functools.partial(f, _SEQ_CST)


def choose(machine: str, libatomic: Callable[[], None] | None) -> tuple[Callable[[], None] | None, str]:
    """The full fence for ``machine`` (None when there is none) and what it is."""
    if libatomic is not None:
        return libatomic, f"{LIBATOMIC} atomic_thread_fence(memory_order_seq_cst)"
    if machine.lower() in TSO_MACHINES:
        return lock_fence, f"a lock acquire/release (a locked instruction; {machine} is TSO)"
    return None, f"none ({machine} is weakly ordered and {LIBATOMIC} did not load)"


def detect() -> tuple[str, Callable[[], None] | None, str]:
    """This CPU's name (``platform.machine()``), its full fence (None when there is none), and what it is."""
    machine = platform.machine()
    return (machine, *choose(machine, load_libatomic()))


MACHINE, REAL, HOW = detect()
fence: Callable[[], None] = REAL or lock_fence


def require_fence(path: str) -> None:
    """Refuse to open the pool at ``path`` when this CPU has no full fence (see the module docstring)."""
    if REAL is not None:
        return
    if os.environ.get(UNFENCED_ENV) == "1":
        log.warning(
            "embedded pool %r: %s=1: running on %s without a memory fence; a read racing the eviction of its "
            "object may return another object's bytes",
            path,
            UNFENCED_ENV,
            MACHINE,
        )
        return
    raise BackendError(
        f"embedded pool {path!r}: this CPU ({MACHINE}) reorders memory accesses, and its lock-free reads need a "
        f"full memory fence, which comes from {LIBATOMIC} (GCC's atomics library) and it did not load. Install it "
        "(Debian/Ubuntu: apt-get install libatomic1; openEuler/RHEL: dnf install libatomic), or use another "
        'backend ("backend": "memcache" or "mooncake" in kv_connector_extra_config), or set '
        f"{UNFENCED_ENV}=1 to run anyway (a read racing an eviction may then return another object's bytes)"
    )
