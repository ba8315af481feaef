"""What the scheduler-side connector tells the workers each step, and what workers report back.

msgspec Structs: cheap to build and to pickle through vLLM's executor. The scheduler sends chunk
hashes, not object keys: each worker names its objects with its own rank tag.
"""

from __future__ import annotations

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


class Xfer(msgspec.Struct, frozen=True, array_like=True):
    """Move chunk ``hashes[i]`` to/from KV block ``block_ids[i]`` for request ``req_id``.
    ``src_tp`` (loads): the TP size of the engine that saved the chunks when it is not this
    engine's (GQA: each worker reads its heads from that size's objects); 0 = this engine's.
    Hybrid models: ``block_ids`` are the anchor group's and ``more[g][i]`` is chunk ``i``'s block in
    the other attention groups (``lw_vllm.hybrid.group_copier``)."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    src_tp: int = 0
    more: list[list[int]] = msgspec.field(default_factory=list)
    # Recurrent-state models (loads): per state group, the block the state after the last chunk
    # goes to (``state_store``); empty: no state.
    state: list[int] = msgspec.field(default_factory=list)
    # Streaming PD loads: the receive is reported only once the prefill's answer came (or at its
    # deadline), so the request continues from the answer's first token (``stream_recv.Receive``).
    holds: bool = False


class StateXfer(msgspec.Struct, frozen=True, array_like=True):
    """Save the recurrent state in ``blocks`` (one per state group) as the state after the chunk
    whose hash is ``chunk_hash`` (``state_store``)."""

    req_id: str
    chunk_hash: bytes
    blocks: list[int]


class LayerwiseMeta(KVConnectorMetadata):
    """One step's plan: loads run before (bulk) or during (layerwise) the forward, saves after
    each layer's attention (layerwise) or after the forward (bulk)."""

    def __init__(self, loads: list[Xfer] | None = None, saves: list[Xfer] | None = None, bulk_load: bool = False,
                 stream_loads: list[Xfer] | None = None) -> None:
        self.loads = loads or []
        self.saves = saves or []
        # Streaming PD, and every load of a hybrid model: receives the worker starts now and
        # reports through get_finished later.
        self.stream_loads = stream_loads or []
        # Streaming PD: receives to end now (their prefill failed); still reported as finished.
        self.stream_cancels: list[str] = []
        # Streaming PD: receives whose prefill is done (the metaserver's ok answer): keys still
        # neither reserved nor committed fail after one more open try; vLLM recomputes them.
        self.stream_prefilled: list[str] = []
        # The step schedules no tokens: a worker with receives running may wait a little for one
        # to end instead of letting vLLM spin through empty steps (see stream_recv.IDLE_WAIT_S).
        self.idle = False
        # Layerwise mode, but this step's forward computes next to nothing (e.g. a PD decoder's last
        # prompt token): no compute to overlap, so every layer loads at once before the forward.
        self.bulk_load = bulk_load
        # Background saves (pool.saves_in_background): requests vLLM now frees only once this worker
        # lists them in finished_sending, i.e. once no save of theirs is running; and this step's
        # preempted requests, whose blocks vLLM frees at once (handle_preemptions waits for their saves).
        self.free_late: list[str] = []
        self.preempted: list[str] = []
        # This step saves a PD prefill: its saves end in the step even with background saves.
        self.saves_in_step = False
        # Recurrent-state models: boundary states vLLM handed off this step (``state_plan``).
        self.state_saves: list[StateXfer] = []

    def __repr__(self) -> str:
        return (f"LayerwiseMeta(loads={len(self.loads)}, saves={len(self.saves)}, bulk_load={self.bulk_load}, "
                f"stream_loads={len(self.stream_loads)}, state_saves={len(self.state_saves)})")


class LayerwiseWorkerMeta(KVConnectorWorkerMetadata):
    """Per request: blocks loaded, blocks that failed to load, chunks committed to the pool (and,
    when vLLM publishes KV events, their hashes per TP rank that committed its object: ``stored``).
    ``rank``: the TP rank that made the report (its ``stored`` entries are under it)."""

    def __init__(self, loaded: dict[str, int] | None = None, failed: dict[str, int] | None = None,
                 saved: dict[str, int] | None = None, load_span: dict[str, tuple[float, float]] | None = None,
                 stored: dict[str, dict[int, list[bytes]]] | None = None, loaded_bytes: dict[str, int] | None = None,
                 rank: int = 0) -> None:
        self.rank = rank
        self.loaded = loaded or {}
        self.failed = failed or {}
        self.saved = saved or {}
        self.stored = stored or {}
        self.loaded_bytes = loaded_bytes or {}  # read from the pool into the KV cache
        # Wall-clock (start, end) of the step's load per request, for the stats record's breakdown.
        self.load_span = load_span or {}

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
        span = dict(self.load_span)
        for k, (a, b) in other.load_span.items():
            mine = span.get(k)
            span[k] = (a, b) if mine is None else (min(a, mine[0]), max(b, mine[1]))
        # ``saved`` holds each rank's running total per request (save_book), so the maximum is the
        # count of the rank that committed most, whichever step its report comes in.
        # Each rank's commits stay its own: a chunk is announced once every saving rank's object
        # is committed (pool_events; MLA: rank 0 alone saves).
        stored = {rid: {r: list(hs) for r, hs in by_rank.items()} for rid, by_rank in self.stored.items()}
        for rid, by_rank in other.stored.items():
            ranks = stored.setdefault(rid, {})
            for r, hs in by_rank.items():
                ranks[r] = list(dict.fromkeys(ranks.get(r, []) + list(hs)))
        nbytes = dict(self.loaded_bytes)  # every rank's reads count
        for rid, n in other.loaded_bytes.items():
            nbytes[rid] = nbytes.get(rid, 0) + n
        return LayerwiseWorkerMeta(loaded, failed, saved, span, stored, nbytes, self.rank)
