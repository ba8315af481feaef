"""One step's saves as the worker part books them: ``SaveBook``, built by ``WorkerSide`` per step.

It names the request that owns each pool key (the first one that planned it) and, with KV events
on, the chunk hash behind the key, so a ``SaveResult`` (now, or from a background save steps
later) is credited to the right requests in the worker report: ``saved`` counts and the ``stored``
hashes ``pool_events`` announces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lw_core.pipeline import SaveResult
from lw_vllm.meta import LayerwiseWorkerMeta


@dataclass(slots=True)
class SaveBook:
    owner: dict[str, str] = field(default_factory=dict)  # key -> request id
    hashes: dict[str, bytes] = field(default_factory=dict)  # key -> chunk hash (KV events only)
    reqs: set[str] = field(default_factory=set)  # every request with a save in the step

    def add(self, key: str, req_id: str, chunk_hash: bytes | None) -> None:
        self.owner.setdefault(key, req_id)
        self.reqs.add(req_id)
        if chunk_hash is not None:
            self.hashes[key] = chunk_hash

    def credit(self, res: SaveResult, report: LayerwiseWorkerMeta, totals: dict[str, int]) -> None:
        """Count ``res``'s committed keys per owning request into ``totals`` (this worker's running
        count per request) and put each changed total into ``report``: a total, not an increment,
        because TP ranks' background saves end in different steps and vLLM merges one step's
        reports of all ranks (``LayerwiseWorkerMeta.aggregate`` keeps the maximum)."""
        for k in res.committed_keys:
            rid = self.owner.get(k)
            if rid is None:
                continue
            totals[rid] = totals.get(rid, 0) + 1
            report.saved[rid] = totals[rid]
            h = self.hashes.get(k)
            if h is not None:  # this rank's object of the chunk is committed
                report.stored.setdefault(rid, {}).setdefault(report.rank, []).append(h)
