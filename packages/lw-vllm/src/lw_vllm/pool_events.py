"""KV cache events with the pool as their medium, for KV-aware routers (vLLM's ``take_events``).

vLLM publishes what the connector's scheduler side returns from ``take_events`` with its own
events (``--kv-events-config``, e.g. the ZMQ publisher), so a router that follows vLLM's prefix
cache also learns what the pool holds:

* ``BlockStored`` (medium ``MEDIUM``) once a request's chunks are committed to the pool (the worker
  reports the committed chunk hashes with the step's output), one event per run of consecutive
  chunks: their chain hashes (``lw_core.keys``; each names the whole prefix up to it), the parent
  chunk's hash, the token ids and the block size. A PD prefill's trailing partial chunk is scoped
  to its request and is not announced.
* ``BlockRemoved`` when this engine finds a chunk it announced missing from the pool (evicted or
  the pool was wiped): the pool's stores do not tell anyone what they evicted, so the engine that
  next looks the prefix up says so; its later chunks go with it (chained keys); and every announced
  chunk after a prefix-cache reset purged the model's objects (``pool_reset``).

Announced chunks are remembered up to ``MAX_ANNOUNCED`` (oldest forgotten first). Events are built
only when vLLM publishes KV events (``kv_events_config.enable_kv_cache_events``).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

MEDIUM = "CPU"  # the pool's chunks live in host memory (or a store of host memory)
MAX_ANNOUNCED = 1 << 17


def events_enabled(vllm_config: Any) -> bool:
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


class PoolEvents:
    def __init__(self, block_size: int, enabled: bool, max_announced: int = MAX_ANNOUNCED) -> None:
        self.block_size = block_size
        self.enabled = enabled
        self.max_announced = max_announced
        self._announced: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._events: list[Any] = []

    def stored(self, chain: Sequence[bytes], token_ids: Sequence[int], committed: Sequence[bytes],
               lora_name: str | None = None) -> None:
        """``committed`` chunk hashes of a request whose chunk hashes are ``chain`` (over
        ``token_ids``); hashes not in ``chain`` (a partial chunk) are not announced."""
        if not self.enabled or not committed:
            return
        from vllm.distributed.kv_events import BlockStored

        where = {h: i for i, h in enumerate(chain)}
        # Once per chunk: TP ranks' commits of one chunk may be reported in different steps.
        idx = sorted({where[h] for h in committed if h in where and h not in self._announced})
        bs = self.block_size
        for run in _runs(idx):
            a, b = run[0], run[-1] + 1
            self._events.append(BlockStored(
                block_hashes=list(chain[a:b]), parent_block_hash=chain[a - 1] if a else None,
                token_ids=list(token_ids[a * bs:b * bs]), block_size=bs, lora_id=None, medium=MEDIUM,
                lora_name=lora_name))
            for h in chain[a:b]:
                self._announced[h] = None
                self._announced.move_to_end(h)
        while len(self._announced) > self.max_announced:
            self._announced.popitem(last=False)

    def missing(self, chain: Sequence[bytes]) -> None:
        """A lookup found ``chain[0]`` missing: announced chunks from there on are gone."""
        if not self.enabled or not chain:
            return
        gone = [h for h in chain if h in self._announced]
        if not gone:
            return
        from vllm.distributed.kv_events import BlockRemoved

        for h in gone:
            del self._announced[h]
        self._events.append(BlockRemoved(block_hashes=gone, medium=MEDIUM))

    def cleared(self) -> None:
        """The pool forgot this model's objects (a prefix-cache reset): every announced chunk is gone."""
        if not self.enabled or not self._announced:
            return
        from vllm.distributed.kv_events import BlockRemoved

        gone = list(self._announced)
        self._announced.clear()
        self._events.append(BlockRemoved(block_hashes=gone, medium=MEDIUM))

    def take(self) -> list[Any]:
        out, self._events = self._events, []
        return out


def _runs(idx: Sequence[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for i in idx:
        if runs and runs[-1][-1] + 1 == i:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
