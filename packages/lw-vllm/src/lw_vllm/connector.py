"""LayerwiseStoreConnector: vLLM V1 KV connector over the layerwise KV pool.

Thin: the scheduler role delegates to ``scheduler_side.SchedulerSide``, the worker role to
``worker_side.WorkerSide``; both build on lw-core (config, keys, plans, pipeline, backend).
Configured through ``kv_transfer_config.kv_connector_extra_config`` (see lw_core.config); a bad
key or value fails engine start-up with a message naming it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from lw_vllm import pool
from lw_vllm.metrics import Collector, LayerwisePromMetrics, LayerwiseStats

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class LayerwiseStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """Supports vLLM's hybrid KV cache manager (``SupportsHMA``): full-attention and sliding-window
    groups share each chunk's object (``group_copier``); a model with recurrent-state groups also saves
    the state vLLM hands off at chunk boundaries and restores it with a hit (``state_plan``), with
    prefix caching on; otherwise the pool is inert for it (``scheduler_side``)."""

    _cache_hit_source = getattr(CacheHitSource, "HOST", CacheHitSource.EXTERNAL_UNSPECIFIED)

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.cfg = pool.pool_config(vllm_config)  # ConfigError names the bad key
        pool.check_supported(vllm_config, kv_cache_config)
        kv_role = self._kv_transfer_config.kv_role or "kv_both"
        self._sched = None
        self._worker = None
        self.stats = Collector()
        if role == KVConnectorRole.SCHEDULER:
            from lw_vllm.scheduler.scheduler_side import SchedulerSide

            # vLLM reads its load-failure policy right after creating this connector.
            self._kv_transfer_config.kv_load_failure_policy = self.cfg.kv_load_failure_policy
            # The scheduler part records what only it sees (lookup errors, metaserver waits) in stats.
            self._sched = SchedulerSide(vllm_config, kv_cache_config, self.cfg, kv_role, self.stats)
        else:
            from lw_vllm.worker.worker_side import WorkerSide

            self._worker = WorkerSide(vllm_config, kv_cache_config, self.cfg, kv_role, self.stats)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return bool((extra_config or {}).get("use_layerwise", False))

    # --- worker ---
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.bind(None)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Sending: requests freed late whose background saves are done (save_in_background).
        # Receiving: streaming PD receives and hybrid models' loads; other loads end in their step.
        if self._worker is None:
            return None, None
        recving = self._worker.get_finished(finished_req_ids)
        return self._worker.take_finished_sending(), recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_recving() if self._worker is not None else set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=failed)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None:
            self._worker.handle_preemptions(kv_connector_metadata)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_report() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.shutdown()

    # --- metrics (vLLM merges worker and scheduler stats; see lw_vllm.metrics) ---
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is not None:
            self._worker.poll_pool_stats()
        return self.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return LayerwiseStats(data=dict(data)) if data else LayerwiseStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> LayerwisePromMetrics:
        return LayerwisePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --- scheduler ---
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        n, is_async = self._sched.get_num_new_matched_tokens(request, num_computed_tokens)
        if self._sched.last_call_looked_up:  # "not ready yet" answers are not lookups
            self.stats.add(lookups=1, lookup_tokens=len(request.prompt_token_ids or ()), hit_tokens=n or 0)
        return n, is_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._sched is not None:
            self._sched.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def has_pending_block_frees(self) -> bool:
        """Asked by vLLM's scheduler before it preempts a request for lack of blocks: ``True``
        while finished requests' blocks are held for their background saves (they come back
        within the saves' deadlines), so it waits for those instead of preempting."""
        return self._sched is not None and self._sched.has_pending_block_frees()
    def reset_cache(self) -> bool | None:
        """vLLM's prefix-cache reset of the connector's cache (``reset_external`` /
        ``reset_connector``): this model's objects leave the pool, DRAM and disk tier
        (``pool_reset``); False when the backend cannot or some stayed. Scheduler side only."""
        return self._sched.reset_pool() if self._sched is not None else None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The pool's chunks stored and found gone since the last call (``pool_events``)."""
        return self._sched.events.take() if self._sched is not None else ()

    @property
    def requires_kv_delivery(self) -> bool:
        """A prefiller's saves are a hand-off a decoder waits for; kv_both saves are best effort
        (a dropped one is a later miss) and a decoder hands nothing off."""
        return self._kv_transfer_config.kv_role == "kv_producer"

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished_all_groups(request, block_ids)
