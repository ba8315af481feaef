"""What the scheduler-side connector tells the workers each step, and what workers report back.

msgspec Structs: cheap to build and to pickle through vLLM's executor. The scheduler sends chunk
hashes, not object keys: each worker names its objects with its own rank tag.
"""

from __future__ import annotations

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


class Xfer(msgspec.Struct, frozen=True, array_like=True):
    """Move chunk ``hashes[i]`` to/from KV block ``block_ids[i]`` for request ``req_id``."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[int]


class LayerwiseMeta(KVConnectorMetadata):
    """One step's plan: loads run before (bulk) or during (layerwise) the forward, saves after
    each layer's attention (layerwise) or after the forward (bulk)."""

    def __init__(self, loads: list[Xfer] | None = None, saves: list[Xfer] | None = None) -> None:
        self.loads = loads or []
        self.saves = saves or []

    def __repr__(self) -> str:
        return f"LayerwiseMeta(loads={len(self.loads)}, saves={len(self.saves)})"


class LayerwiseWorkerMeta(KVConnectorWorkerMetadata):
    """Per request: blocks loaded, blocks that failed to load, chunks committed to the pool."""

    def __init__(self, loaded: dict[str, int] | None = None, failed: dict[str, int] | None = None,
                 saved: dict[str, int] | None = None) -> None:
        self.loaded = loaded or {}
        self.failed = failed or {}
        self.saved = saved or {}

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # Several workers (TP ranks) each report: a block counts as loaded only if every rank
        # loaded it, so keep the minimum for loads and the maximum for failures.
        assert isinstance(other, LayerwiseWorkerMeta)
        loaded = {k: min(v, other.loaded.get(k, 0)) for k, v in self.loaded.items()}
        for k in other.loaded.keys() - self.loaded.keys():
            loaded[k] = 0
        failed = dict(self.failed)
        for k, v in other.failed.items():
            failed[k] = max(v, failed.get(k, 0))
        saved = dict(self.saved)
        for k, v in other.saved.items():
            saved[k] = max(v, saved.get(k, 0))
        return LayerwiseWorkerMeta(loaded, failed, saved)
