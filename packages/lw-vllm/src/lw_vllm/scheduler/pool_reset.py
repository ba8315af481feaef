"""vLLM's prefix-cache reset, for the pool (the connector's ``reset_cache``).

``POST /reset_prefix_cache?reset_external=true`` (vLLM's dev API), ``LLM.reset_prefix_cache(
reset_connector=True)`` and ``pause_generation(clear_cache=True)`` (weight updates) reach the
scheduler side's connector. A reset means "no KV computed before it is served after it", so the
pool forgets every object of this engine's model: all its keys, ``lw1/<model fingerprint>/``, at
every layout, TP size and rank (other engines of the same model lose them too; other models' stay),
in DRAM and on the embedded pool's disk tier (which survives restarts), through the backend's
``purge`` (``lw_core.backend``). Saves in flight are not published. What the reset cannot do, it
says: a backend without ``purge`` (memcache, Mooncake) or objects still being read when its
deadline passed make it return False, which vLLM reports as ``{"success": false}`` (or, for a
weight update, raises), rather than serve KV of the old weights.
"""

from __future__ import annotations

import logging
from typing import Any

from lw_core.backend import supports_purge
from lw_core.keys import KEY_VERSION, KeySpace
from lw_vllm.pool_events import PoolEvents

log = logging.getLogger(__name__)

# How long a reset retries objects that a load is reading (a load holds them for one step).
RESET_TIMEOUT_S = 5.0


def model_prefix(keyspace: KeySpace) -> str:
    """Every key of this engine's model: ``lw1/<model fingerprint>/``."""
    return f"{KEY_VERSION}/{keyspace.model_fp}/"


def reset_pool(backend: Any, keyspace: KeySpace, events: PoolEvents) -> bool:
    """Purge this model's objects from ``backend``; whether all of them are gone."""
    name = getattr(backend, "name", type(backend).__name__)
    prefix = model_prefix(keyspace)
    if not supports_purge(backend):
        log.warning("lw-vllm: prefix-cache reset: the %s backend cannot remove objects, so the pool still holds "
                    "this model's KV (keys %s...) and later requests may load it; reported as a failed reset. "
                    "Clear that store with its own tools (docs/guide/failures.md)", name, prefix)
        return False
    try:
        got = backend.purge(prefix, RESET_TIMEOUT_S)
    except Exception as e:
        log.error("lw-vllm: prefix-cache reset: removing this model's objects (keys %s...) from the %s pool "
                  "failed: %s; reported as a failed reset", prefix, name, e)
        return False
    events.cleared()
    log.info("lw-vllm: prefix-cache reset: removed this model's objects (keys %s...) from the %s pool: %d from "
             "DRAM (%d bytes), %d disk-tier files; %d saves in flight will not be published",
             prefix, name, got.get("objects", 0), got.get("bytes", 0), got.get("disk_objects", 0),
             got.get("reservations", 0))
    if got.get("leased"):
        log.warning("lw-vllm: prefix-cache reset: %d object(s) of this model were being read for %.0f s and stay in "
                    "the pool; reported as a failed reset (reset again)", got["leased"], RESET_TIMEOUT_S)
        return False
    return True
