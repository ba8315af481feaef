"""Importing memcache_hybrid: lazily, with an install hint, and with the runtime it needs.

On an Ascend machine ``ASCEND_HOME_PATH`` points at the real runtime and nothing is changed. On a
CPU-only machine the host protocols run on the stand-in (``lw_memcache.standin``), activated here
before the first import. ``LW_MEMCACHE_STANDIN=0`` disables the stand-in; ``=1`` forces it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from types import ModuleType

from lw_core.backend import BackendError
from lw_memcache import standin
from lw_memcache.conf import HOST_PROTOCOLS

INSTALL_HINT = (
    "memcache_hybrid is not installed: pip install 'lw-memcache[store]' "
    "(memcache-hybrid==1.3.0 and memfabric-hybrid==1.3.0; wheels exist for Linux x86_64/aarch64, "
    "CPython 3.10/3.11)"
)


def real_runtime() -> str | None:
    """ASCEND_HOME_PATH of a real Ascend runtime, when one is configured."""
    home = os.environ.get("ASCEND_HOME_PATH")
    if home and (Path(home) / "lib64" / "libascendcl.so").exists() and not standin.is_standin(home):
        return home
    return None


def check_transport(home: Path) -> None:
    """host_tcp's client loads memfabric's bundled ``libhcom.so`` by name, which needs its
    directory on LD_LIBRARY_PATH when the process *starts* (the loader reads it once; the library
    needs ``libboundscheck.so``, which has no soname, so preloading it by path does not help).
    Without it ``init`` fails with a bare -1 ("LoadExtendLibrary for HOST RDMA failed: -6" in the
    client log): say what to do instead."""
    import ctypes

    try:
        ctypes.CDLL("libhcom.so", mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        mf = standin.memfabric_lib_dir() or "<site-packages>/memfabric_hybrid/lib"
        raise BackendError(
            f"memcache_protocol='host_tcp' needs memfabric's bundled libhcom.so loadable when the process starts "
            f"({e}): start it with LD_LIBRARY_PATH={home / 'lib64'}:{mf} (and MF_HCOM_MAX_SEND_RECV_DATA_CNT=256), "
            "e.g. `eval $(lw-memcache standin)` in the shell that starts vLLM"
        ) from None


def import_memcache(protocol: str = "host_shm") -> ModuleType:
    """``memcache_hybrid``, ready for a data client with ``protocol``."""
    if importlib.util.find_spec("memcache_hybrid") is None:
        raise BackendError(INSTALL_HINT)
    mode = os.environ.get("LW_MEMCACHE_STANDIN", "auto")
    if mode not in ("auto", "0", "1"):
        raise BackendError(f"LW_MEMCACHE_STANDIN={mode!r}; accepted: auto (default), 0 (never), 1 (always)")
    use_standin = mode == "1" or (mode == "auto" and real_runtime() is None)
    if use_standin:
        if protocol not in HOST_PROTOCOLS:
            raise BackendError(
                f"memcache_protocol={protocol!r} moves data between NPUs and needs the Ascend runtime: set "
                f"ASCEND_HOME_PATH (e.g. /usr/local/Ascend/ascend-toolkit/latest); without an NPU use one of "
                f"{', '.join(HOST_PROTOCOLS)}"
            )
        try:
            home = standin.activate()
        except standin.StandinError as e:
            raise BackendError(f"memcache_hybrid needs the Ascend runtime or lw-memcache's CPU stand-in: {e}") from e
        if protocol == "host_tcp":
            check_transport(home)
    try:
        return importlib.import_module("memcache_hybrid")
    except ImportError as e:  # e.g. a wheel for another platform, or a missing system library
        raise BackendError(f"importing memcache_hybrid failed ({e}); {INSTALL_HINT}") from e
