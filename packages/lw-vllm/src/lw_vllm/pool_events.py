"""KV cache events with the pool as their medium, for KV-aware routers (vLLM's ``take_events``).

vLLM publishes what the connector's scheduler side returns from ``take_events`` with its own
events (``--kv-events-config``, e.g. the ZMQ publisher), so a router that follows vLLM's prefix
cache also learns what the pool holds:

* ``BlockStored`` (medium ``MEDIUM``, "CPU": a commit lands in host memory) once a chunk is
  readable: every TP rank that saves has committed its object of it (the workers report each
  rank's committed chunk hashes with the step's output; ranks' reports of one chunk may come in
  different steps), one event per run of consecutive chunks: their chain hashes (``lw_core.keys``;
  each names the whole prefix up to it), the parent chunk's hash, the token ids, the block size,
  and what vLLM's own events carry besides: the LoRA (``lora_id``, ``lora_name``), the extra keys
  of each block (multimodal inputs, cache salt, prompt embeddings: vLLM's
  ``generate_block_hash_extra_keys``, published untagged as vLLM does) and the session. A PD
  prefill's trailing partial chunk is scoped to its request and is not announced.
* When a lookup finds announced chunks in another tier than the one announced (the embedded
  pool's disk tier: ``lw_core.backend.lookup_tiers``), ``BlockRemoved`` from the old medium and
  ``BlockStored`` in the new one: ``MEDIA`` names the tiers the way vLLM's events name media
  ("CPU", and "STORAGE" as vLLM's own disk offloading says).
* ``BlockRemoved`` when this engine finds a chunk it announced missing from the pool (evicted or
  the pool was wiped): the pool's stores do not tell anyone what they evicted, so the engine that
  next looks the prefix up says so; its later chunks go with it (chained keys); and every announced
  chunk after a prefix-cache reset purged the model's objects (``pool_reset``).

Announced chunks, and chunks some ranks but not yet all committed, are remembered up to
``MAX_ANNOUNCED`` each (oldest forgotten first). Events are built only when vLLM publishes KV
events (``kv_events_config.enable_kv_cache_events``).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

from lw_core.backend import TIER_DISK, TIER_DRAM

# The medium each tier is announced in: vLLM's MEDIUM_CPU and MEDIUM_STORAGE (its disk offloading's).
MEDIA = {TIER_DRAM: "CPU", TIER_DISK: "STORAGE"}
MEDIUM = MEDIA[TIER_DRAM]  # a commit lands in host memory (or a store of host memory)
MAX_ANNOUNCED = 1 << 17


def events_enabled(vllm_config: Any) -> bool:
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


class PoolEvents:
    """Events of chunks of ``block_size`` tokens; ``ranks``: the TP ranks whose objects make a
    chunk readable (each saving rank's: ``lw_vllm.pool.rank_tags``)."""

    def __init__(self, block_size: int, enabled: bool, ranks: int = 1, max_announced: int = MAX_ANNOUNCED) -> None:
        self.block_size = block_size
        self.enabled = enabled
        self.ranks = ranks
        self.max_announced = max_announced
        self._announced: collections.OrderedDict[bytes, str] = collections.OrderedDict()  # hash -> medium
        self._pending: collections.OrderedDict[bytes, set[int]] = collections.OrderedDict()  # hash -> ranks committed
        self._events: list[Any] = []

    def stored(self, req: Any, chain: Sequence[bytes], committed: Mapping[int, Sequence[bytes]]) -> None:
        """``committed[rank]``: chunk hashes whose object ``rank`` committed, of request ``req``
        (a vLLM ``Request``) whose chunk hashes are ``chain``; a chunk is announced once every
        rank committed its object. Hashes not in ``chain`` (a partial chunk) are not announced."""
        if not self.enabled or not committed:
            return
        where = {h: i for i, h in enumerate(chain)}
        ready: set[int] = set()
        for rank, hashes in committed.items():
            for h in hashes:
                if h not in where or h in self._announced:
                    continue
                got = self._pending.setdefault(h, set())
                got.add(rank)
                self._pending.move_to_end(h)
                if len(got) >= self.ranks:
                    ready.add(where[h])
        for i in ready:
            self._pending.pop(chain[i], None)
        while len(self._pending) > self.max_announced:
            self._pending.popitem(last=False)
        for run in _runs(sorted(ready)):
            self._store(req, chain, run[0], run[-1] + 1, MEDIUM)

    def found(self, req: Any, chain: Sequence[bytes], start: int, tiers: Sequence[str]) -> None:
        """A lookup found ``chain[start + i]`` in tier ``tiers[i]``: announced chunks held in another
        medium than announced are removed from the old one and stored in the new one."""
        if not self.enabled:
            return
        moved: dict[int, tuple[str, str]] = {}  # chain index -> (old medium, new medium)
        for i, tier in enumerate(tiers):
            old = self._announced.get(chain[start + i])
            new = MEDIA.get(tier, MEDIUM)
            if old is not None and old != new:
                moved[start + i] = (old, new)
        if not moved:
            return
        from vllm.distributed.kv_events import BlockRemoved

        for old in dict.fromkeys(o for o, _ in moved.values()):
            self._events.append(BlockRemoved(block_hashes=[chain[i] for i in sorted(moved) if moved[i][0] == old],
                                             medium=old))
        for new in dict.fromkeys(n for _, n in moved.values()):
            for run in _runs([i for i in sorted(moved) if moved[i][1] == new]):
                self._store(req, chain, run[0], run[-1] + 1, new)

    def _store(self, req: Any, chain: Sequence[bytes], a: int, b: int, medium: str) -> None:
        """One ``BlockStored`` of chunks ``[a, b)`` of ``req``, as vLLM's own events describe blocks."""
        from vllm.distributed.kv_events import BlockStored

        bs = self.block_size
        lora = getattr(req, "lora_request", None)
        self._events.append(BlockStored(
            block_hashes=list(chain[a:b]), parent_block_hash=chain[a - 1] if a else None,
            token_ids=list(req.all_token_ids[a * bs:b * bs]), block_size=bs,
            lora_id=lora.adapter_id if lora else None, medium=medium, lora_name=lora.lora_name if lora else None,
            extra_keys=_extra_keys(req, a, b, bs), session_id=getattr(req, "session_id", None)))
        for h in chain[a:b]:
            self._announced[h] = medium
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

        media = {h: self._announced.pop(h) for h in gone}
        for medium in dict.fromkeys(media.values()):
            self._events.append(BlockRemoved(block_hashes=[h for h in gone if media[h] == medium], medium=medium))

    def cleared(self) -> None:
        """The pool forgot this model's objects (a prefix-cache reset): every announced chunk is gone."""
        if not self.enabled or not self._announced:
            return
        from vllm.distributed.kv_events import BlockRemoved

        media = dict(self._announced)
        self._announced.clear()
        for medium in dict.fromkeys(media.values()):  # each chunk from the medium it was announced in
            self._events.append(BlockRemoved(block_hashes=[h for h, m in media.items() if m == medium], medium=medium))

    def take(self) -> list[Any]:
        out, self._events = self._events, []
        return out


def _extra_keys(req: Any, a: int, b: int, bs: int) -> list[tuple[Any, ...] | None] | None:
    """vLLM's extra keys of blocks ``[a, b)`` of ``req`` (LoRA, multimodal inputs, cache salt,
    prompt embeddings), untagged as its events publish them; None when no block has any."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    out: list[tuple[Any, ...] | None] = []
    mm = 0  # the multimodal input a block starts looking from, carried from block 0 as vLLM does
    for i in range(b):
        keys, mm = generate_block_hash_extra_keys(req, i * bs, (i + 1) * bs, mm)
        if i >= a:
            out.append(keys)
    if all(k is None for k in out):
        return None
    return to_event_extra_keys(out)


def _runs(idx: Sequence[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for i in idx:
        if runs and runs[-1][-1] + 1 == i:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
