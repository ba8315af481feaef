"""``purge_offline``: ``lw-pool purge`` on an embedded pool, whether or not engines run on it.

When the DRAM pool exists it is attached (never built or rebuilt: ``create=False``) and purged with
its disk tier (``EmbeddedBackend.purge``). When it does not (the host rebooted: tmpfs is empty, but
the disk tier survives) the disk tier's directory is purged alone.
"""

from __future__ import annotations

import os
from typing import Any

from lw_core.backends.embedded.backend import EmbeddedBackend
from lw_core.backends.embedded.disk_dir import purge_dir
from lw_core.backends.embedded.purge import COUNTS


def purge_offline(keys: Any, prefix: str, timeout_s: float) -> dict[str, int]:
    """Purge what ``keys`` (a parsed config's ``EmbeddedKeys``) names: counts as ``Purger.purge``."""
    if os.path.exists(os.path.join(keys.embedded_path, "index.lmdb")):
        with EmbeddedBackend.from_keys(keys, populate=False, create=False) as pool:
            return pool.purge(prefix, timeout_s)
    out = dict.fromkeys(COUNTS, 0)
    disk = keys.embedded_disk_path
    if disk is not None and os.path.isdir(disk):
        out["disk_objects"] = len(purge_dir(disk, prefix.encode()))
    return out
